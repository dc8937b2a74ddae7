"""exspec's HTTP path over a model-free engine (tests/support/fake_engine.py: every step instant, every draft
accepted): what the server itself can deliver, tokens/s and per-chunk latency, with no model in the way. Serve, then
load it with the load test, e.g.

    python scripts/serve_fake_engine.py --port 8811 --k 0 &
    python -m exspec.loadtest --base-url http://127.0.0.1:8811/v1 --dataset random --random-input-len 32 \\
        --random-output-len 64 --num-prompts 64 --request-rate inf --tokenizer /tmp/exspec-fake-tok --no-progress

The tokenizer is the tests' tiny BPE tokenizer, written to --tokenizer-dir. docs/BENCHMARKS.md section 7 has the
figures. A development tool: it imports the tests' fake engine, so it runs from a source checkout only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # `tests`, after PYTHONPATH (a shim may give exspec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8811)
    p.add_argument("--k", type=int, default=0, help="draft tokens per step, every one accepted: k + 1 tokens a step")
    p.add_argument("--slots", type=int, default=64, help="max batch size and pool size")
    p.add_argument("--tokenizer-dir", type=Path, default=Path("/tmp/exspec-fake-tok"))
    args = p.parse_args(argv)

    from tests.support.fake_engine import FakeEngine
    from tests.support.tiny_models import build_tokenizer

    from exspec.scheduler import AsyncScheduler, SchedulerConfig
    from exspec.server.app import build_app
    from exspec.server.config import ServerConfig
    from exspec.server.lifecycle import make_server

    tok = build_tokenizer(args.tokenizer_dir)
    engine = FakeEngine(num_slots=args.slots, max_model_len=4096, tokenizer=tok, has_draft=args.k > 0,
                        accept=(lambda seq, k: k) if args.k else None)
    engine.vocab_size, engine.model_name = len(tok), "fake"
    scheduler = AsyncScheduler(engine, SchedulerConfig(max_batch_size=args.slots, pool_size=args.slots, max_waiting=4096,
                                                       num_speculative_tokens=args.k, speculation="fixed"))
    make_server(build_app(scheduler, ServerConfig()), "127.0.0.1", args.port, log_level="warning").run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
