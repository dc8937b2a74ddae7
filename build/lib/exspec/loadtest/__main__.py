"""`python -m loadtest`: a bounded load test against a running OpenAI-compatible server on this machine.

    python -m loadtest --base-url http://127.0.0.1:8000/v1 --dataset specbench --num-prompts 64 \\
        --request-rate 4 --max-tokens 128 --output result.json

Prints a vLLM-style table and writes JSON keyed like vLLM's `bench serve` results. With
`--check-equivalence --reference-model DIR` (greedy only) every output's token ids are compared with the
target's own greedy output, computed offline by our engine at k = 0 and batch 1 on the same token ids (the
prompts are then sent as token-id lists, so tokenisation cannot differ).

Exit status: 0 when the test ran (failed requests are counted, not fatal), 1 when the equivalence check found
a real divergence, 2 for a bad option or an unreachable server.
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
from exspec.loadtest.report import format_table, summarize
from exspec.loadtest.runner import LoadConfig, LoadTestError, first_model, run_load


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL (this machine only)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--dataset", choices=["specbench", "mtbench", "random"], default="specbench",
                   help="SpecBench or MT-Bench turns[0], or random prompts (default: specbench)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default: 128)")
    p.add_argument("--random-input-len", type=int, default=128, help="random dataset: prompt tokens (words without a tokenizer)")
    p.add_argument("--random-output-len", type=int, default=128, help="random dataset: max_tokens, with ignore_eos")
    p.add_argument("--request-rate", type=_rate, default=float("inf"), help="Poisson arrivals, requests/s (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM extension)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer directory: prompts are sent as token ids (default: --reference-model's, if given)")
    p.add_argument("--chat-template", action="store_true", help="with a tokenizer: prompts as a user turn in its chat template")
    p.add_argument("--check-equivalence", action="store_true", help="compare every greedy output with the target's own")
    p.add_argument("--reference-model", type=Path, default=None, help="target model directory for --check-equivalence")
    p.add_argument("--reference-device", default="cpu", help="device of the offline reference (default: cpu)")
    p.add_argument("--reference-dtype", default="float32", help="dtype of the offline reference (default: float32)")
    p.add_argument("--seed", type=int, default=0, help="arrival times and random prompts")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request (default: 300)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole test (default: 1800)")
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


def check_outputs(args, requests: list[RequestInput], results) -> dict:
    """Compare each completed request's token ids with the target's own greedy output."""
    from exspec.bench.equivalence import TargetReference

    ref = TargetReference(args.reference_model, args.reference_device, args.reference_dtype)
    done = [(q, r) for q, r in zip(requests, results) if r.success]
    if not done:
        return {"checked": 0, "matched": 0, "near_ties": 0, "real": 0, "mismatches": []}
    missing = [r.index for _, r in done if r.token_ids is None or (r.output_tokens and not r.token_ids)]
    if missing:
        raise LoadTestError("the server returned no token ids (return_token_ids): cannot check equivalence")
    prompts = [q.prompt for q, _ in done]
    max_tokens = requests[0].max_tokens
    references = ref.generate(prompts, max_tokens, ignore_eos=args.ignore_eos or args.dataset == "random")
    outputs = [r.token_ids for _, r in done]
    found = ref.compare(prompts, outputs, references)
    for d in found:
        d["request"] = done[d.pop("prompt")][1].index
    near = sum(1 for d in found if d["kind"] == "near-tie")
    return {
        "checked": len(done),
        "matched": len(done) - len(found),
        "near_ties": near,
        "real": len(found) - near,
        "mismatches": found,
        "reference": f"{args.reference_model} alone, greedy, batch 1, our engine at k = 0 ({args.reference_dtype})",
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except (LoadTestError, DatasetError) as e:
        print(f"loadtest: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


async def _main(args) -> int:
    if args.check_equivalence:
        if args.reference_model is None:
            raise LoadTestError("--check-equivalence needs --reference-model DIR (the target model)")
        if args.temperature != 0:
            raise LoadTestError("--check-equivalence compares greedy outputs: use --temperature 0")
        if args.endpoint != "completions":
            raise LoadTestError("--check-equivalence sends token ids: use --endpoint completions")
    if args.output is not None and not args.output.resolve().parent.is_dir():
        raise LoadTestError(f"output directory {str(args.output.resolve().parent)!r} does not exist")
    tok_dir = args.tokenizer or args.reference_model
    tokenizer = _load_tokenizer(tok_dir) if tok_dir is not None else None
    if args.chat_template and tokenizer is None:
        raise LoadTestError("--chat-template needs a tokenizer: pass --tokenizer or --reference-model")
    if args.endpoint == "chat" and tokenizer is not None:
        raise LoadTestError("--endpoint chat sends text: leave out --tokenizer / --reference-model")
    requests = build_requests(args, tokenizer)
    model = args.model or await first_model(args.base_url, args.api_key)
    cfg = LoadConfig(
        base_url=args.base_url,
        model=model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos or args.dataset == "random",
        return_token_ids=args.check_equivalence,
        seed=args.seed,
        request_timeout=args.request_timeout,
        total_timeout=args.timeout,
    )
    results, duration = await run_load(requests, cfg, progress=not args.no_progress)
    metrics = summarize(results, duration)
    header = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai" if args.endpoint == "completions" else "openai-chat",
        "base_url": args.base_url,
        "model_id": model,
        "dataset_name": args.dataset,
        "num_prompts": len(requests),
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": 1.0,
        "max_concurrency": args.max_concurrency,
        "max_tokens": requests[0].max_tokens,
        "temperature": args.temperature,
        "prompts_as_token_ids": tokenizer is not None,
    }
    result = {**header, **metrics}
    if args.check_equivalence:
        result["equivalence"] = await asyncio.to_thread(check_outputs, args, requests, results)
    print(format_table(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"loadtest: wrote {args.output}", file=sys.stderr)
    eq = result.get("equivalence")
    return 1 if eq and eq["real"] else 0


if __name__ == "__main__":
    sys.exit(main())
