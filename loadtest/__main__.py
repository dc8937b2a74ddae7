"""`python -m exspec.loadtest`: a bounded load test against a running OpenAI-compatible server on this machine.

    python -m exspec.loadtest --base-url http://127.0.0.1:8000/v1 --dataset specbench --num-prompts 64 \\
        --request-rate 4 --max-tokens 128 --output result.json

Prints a vLLM-style table and writes JSON keyed like vLLM's `bench serve` results. Greedy output
equivalence needs no model here (`exspec.data.reference` defines the file):

    # record the target alone: a server started with --num-speculative-tokens 0
    python -m exspec.loadtest --tokenizer DIR --num-prompts 32 --write-reference ref.jsonl
    # (or: exspec bench --methods target-ar --batch-sizes 1 --write-reference ref.jsonl)
    # then compare a speculative server with it: prompts, max_tokens and ignore_eos come from the file
    python -m exspec.loadtest --reference ref.jsonl

Prompts are sent as token-id lists in both, so tokenisation cannot differ.

Exit status: 0 when the test ran (failed requests are counted, not fatal), 1 when the equivalence check found
a divergence that is not a near-tie, 2 for a bad option, a bad reference file or an unreachable server.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path

from exspec.loadtest.client import RequestInput
from exspec.data import DatasetError, encode_prompts, load_questions, random_prompts
from exspec.data.reference import (
    ReferenceError,
    ReferenceRow,
    compare_with_reference,
    read_reference,
    write_reference,
)
from exspec.loadtest.report import format_table, summarize
from exspec.loadtest.runner import FLAG_FIELDS, LoadConfig, LoadTestError, first_model, run_load


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m exspec.loadtest", description=__doc__.split("\n\n")[0])
    # LoadConfig's fields (FLAG_FIELDS) take their defaults from it, written once there
    p.add_argument("--base-url", default=LoadConfig.base_url,
                   help=f"the server's /v1 URL, this machine only (default: {LoadConfig.base_url})")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=LoadConfig.api_key, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--endpoint", choices=["completions", "chat"], default=LoadConfig.endpoint)
    p.add_argument("--dataset", choices=["specbench", "mtbench", "random"], default="specbench",
                   help="SpecBench or MT-Bench turns[0], or random prompts (default: specbench)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default: 128)")
    p.add_argument("--random-input-len", type=int, default=128, help="random dataset: prompt tokens (words without a tokenizer)")
    p.add_argument("--random-output-len", type=int, default=128, help="random dataset: max_tokens, with ignore_eos")
    p.add_argument("--request-rate", type=_rate, default=LoadConfig.request_rate,
                   help=f"Poisson arrivals, requests/s (default: {LoadConfig.request_rate}: all at once)")
    p.add_argument("--max-concurrency", type=int, default=LoadConfig.max_concurrency,
                   help="requests in flight at most (default: no cap)")
    p.add_argument("--temperature", type=float, default=LoadConfig.temperature,
                   help=f"default {LoadConfig.temperature:g}: greedy")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM extension)")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory: prompts are sent as token ids")
    p.add_argument("--chat-template", action="store_true", help="with a tokenizer: prompts as a user turn in its chat template")
    p.add_argument("--reference", type=Path, default=None,
                   help="greedy reference JSONL: send its prompts (with its max_tokens and ignore_eos) and compare "
                        "every output with its reference ids; replaces --dataset, --num-prompts and --max-tokens")
    p.add_argument("--write-reference", type=Path, default=None,
                   help="record this run's prompts and greedy output ids as a reference JSONL (needs token-id "
                        "prompts: --tokenizer; run against a server started with --num-speculative-tokens 0)")
    p.add_argument("--seed", type=int, default=LoadConfig.seed, help="arrival times and random prompts")
    p.add_argument("--request-timeout", type=float, default=LoadConfig.request_timeout,
                   help=f"seconds per request (default: {LoadConfig.request_timeout:g})")
    p.add_argument("--timeout", dest="total_timeout", type=float, default=LoadConfig.total_timeout,
                   help=f"seconds for the whole test (default: {LoadConfig.total_timeout:g})")
    p.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true")
    return p


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise LoadTestError(f"cannot load a tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from e


def build_requests(args, tokenizer) -> list[RequestInput]:
    """The prompts (token ids when a tokenizer is given, else text) and each one's max_tokens."""
    if args.num_prompts < 1:
        raise LoadTestError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset == "random":
        vocab = len(tokenizer) if tokenizer is not None else None
        prompts = random_prompts(args.num_prompts, args.random_input_len, args.seed, vocab)
        max_tokens = args.random_output_len
    else:
        prompts = load_questions(args.dataset, args.num_prompts)
        if tokenizer is not None:
            prompts = encode_prompts(tokenizer, prompts, args.chat_template)
        max_tokens = args.max_tokens
    if max_tokens < 1:
        raise LoadTestError(f"max tokens must be >= 1, got {max_tokens}")
    return [
        RequestInput(i, p, max_tokens, prompt_len=len(p) if isinstance(p, list) else None)
        for i, p in enumerate(prompts)
    ]


def reference_requests(rows: list[ReferenceRow]) -> list[RequestInput]:
    """One request per reference row: its prompt ids and max_tokens."""
    return [RequestInput(i, r.prompt_token_ids, r.max_tokens, prompt_len=len(r.prompt_token_ids))
            for i, r in enumerate(rows)]


def _token_ids(results) -> list[list[int]]:
    """The generated ids of each (successful) request; the server must have returned them."""
    missing = [r.index for r in results if r.token_ids is None or (r.output_tokens and not r.token_ids)]
    if missing:
        raise LoadTestError("the server returned no token ids (return_token_ids): cannot check equivalence")
    return [list(r.token_ids) for r in results]


def check_outputs(path: Path, rows: list[ReferenceRow], results) -> dict:
    """Compare each completed request's generated ids with its reference row (failed requests are counted
    as not checked)."""
    done = [(row, r) for row, r in zip(rows, results) if r.success]
    found = compare_with_reference(_token_ids([r for _, r in done]), [row for row, _ in done])
    counts = {kind: sum(1 for d in found if d["kind"] == kind) for kind in ("near-tie", "real", "unclassified")}
    for d in found:
        d["request"] = done[d.pop("index")][1].index
    return {
        "checked": len(done),
        "not_checked": len(rows) - len(done),
        "matched": len(done) - len(found),
        "near_ties": counts["near-tie"],
        "real": counts["real"],
        "unclassified": counts["unclassified"],
        "mismatches": found,
        "reference": f"{path} ({rows[0].source or 'unknown source'})",
    }


def recorded_reference(requests: list[RequestInput], results, ignore_eos: bool, source: str) -> list[ReferenceRow]:
    """This run's outputs as reference rows (no top-2 gaps: those need the model); every request must have
    completed."""
    failed = [r.index for r in results if not r.success]
    if failed:
        raise LoadTestError(f"{len(failed)} requests failed (first: {failed[:5]}): no reference written")
    ids = _token_ids(results)
    return [ReferenceRow(list(q.prompt), out, q.max_tokens, ignore_eos, None, None, source)
            for q, out in zip(requests, ids)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except (LoadTestError, DatasetError, ReferenceError) as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


async def _main(args) -> int:
    greedy_check = args.reference is not None or args.write_reference is not None
    if greedy_check:
        if args.temperature != 0:
            raise LoadTestError("--reference / --write-reference compare greedy outputs: use --temperature 0")
        if args.endpoint != "completions":
            raise LoadTestError("--reference / --write-reference send token ids: use --endpoint completions")
    if args.reference is not None and args.write_reference is not None:
        raise LoadTestError("pass one of --reference (compare) and --write-reference (record), not both")
    for out in (args.output, args.write_reference):
        if out is not None and not out.resolve().parent.is_dir():
            raise LoadTestError(f"output directory {str(out.resolve().parent)!r} does not exist")
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
    if args.chat_template and tokenizer is None:
        raise LoadTestError("--chat-template needs a tokenizer: pass --tokenizer")
    if args.endpoint == "chat" and tokenizer is not None:
        raise LoadTestError("--endpoint chat sends text: leave out --tokenizer")
    if args.write_reference is not None and tokenizer is None:
        raise LoadTestError("--write-reference records token-id prompts: pass --tokenizer")
    rows = read_reference(args.reference) if args.reference is not None else None
    if rows is not None:
        requests = reference_requests(rows)
        ignore_eos = rows[0].ignore_eos
        if any(r.ignore_eos != ignore_eos for r in rows):
            raise LoadTestError(f"{args.reference}: rows disagree on ignore_eos; one run sends one value")
    else:
        requests = build_requests(args, tokenizer)
        ignore_eos = args.ignore_eos or args.dataset == "random"
    model = args.model or await first_model(args.base_url, args.api_key)
    cfg = LoadConfig(model=model, ignore_eos=ignore_eos, return_token_ids=greedy_check,
                     **{name: getattr(args, name) for name in FLAG_FIELDS})
    results, duration = await run_load(requests, cfg, progress=not args.no_progress)
    metrics = summarize(results, duration)
    header = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai" if args.endpoint == "completions" else "openai-chat",
        "base_url": args.base_url,
        "model_id": model,
        "dataset_name": "reference" if rows is not None else args.dataset,
        "num_prompts": len(requests),
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": 1.0,
        "max_concurrency": args.max_concurrency,
        "max_tokens": requests[0].max_tokens,
        "temperature": args.temperature,
        "prompts_as_token_ids": tokenizer is not None or rows is not None,
    }
    result = {**header, **metrics}
    if rows is not None:
        result["equivalence"] = check_outputs(args.reference, rows, results)
    print(format_table(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"loadtest: wrote {args.output}", file=sys.stderr)
    if args.write_reference is not None:
        source = f"{model} at {args.base_url}, greedy, python -m exspec.loadtest"
        write_reference(args.write_reference, recorded_reference(requests, results, ignore_eos, source))
        print(f"loadtest: wrote {args.write_reference}", file=sys.stderr)
    eq = result.get("equivalence")
    return 1 if eq and (eq["real"] or eq["unclassified"]) else 0


if __name__ == "__main__":
    sys.exit(main())
