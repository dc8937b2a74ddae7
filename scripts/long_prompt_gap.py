"""A long prompt arriving while streams run (issue 22): the longest gap between two chunks of a running stream
while the long prompt is prefilled, and the long prompt's time to first token. HTTP only.

    python scripts/long_prompt_gap.py --base-url http://127.0.0.1:8011/v1 --streams 8 --prompt-tokens 4000

The running streams are greedy completions of short token-id prompts with ignore_eos; once each has sent its
first chunk, the long prompt (random token ids below --vocab) is sent, streamed; the window measured runs from
its send to its first token; then every stream is closed (the server aborts them).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import httpx


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", default="http://127.0.0.1:8011/v1")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    model = httpx.get(args.base_url + "/models").json()["data"][0]["id"]
    rng = random.Random(args.seed)
    times: list[list[float]] = [[] for _ in range(args.streams)]
    started = threading.Barrier(args.streams + 1)
    stop = threading.Event()

    def stream(i: int) -> None:
        body = {"model": model, "prompt": [rng.randrange(10, args.vocab) for _ in range(16)], "max_tokens": 3000,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", args.base_url + "/completions", json=body, timeout=600) as r:
            first = True
            for line in r.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if json.loads(line[5:])["choices"][0].get("text") is None:
                    continue
                times[i].append(time.monotonic())
                if first:
                    first = False
                    started.wait(600)
                if stop.is_set():
                    return

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(args.streams)]
    for t in threads:
        t.start()
    started.wait(600)
    time.sleep(0.5)  # the streams settle into decoding
    long = {"model": model, "prompt": [rng.randrange(10, args.vocab) for _ in range(args.prompt_tokens)],
            "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    with httpx.stream("POST", args.base_url + "/completions", json=long, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    t1 = time.monotonic()
    stop.set()
    for t in threads:
        t.join(60)
    gaps = []
    for ts in times:
        inside = [x for x in ts if t0 <= x <= t1 + 0.5]
        before = [x for x in ts if x < t0][-1:]
        seq = before + inside
        gaps += [b - a for a, b in zip(seq, seq[1:])]
    print(json.dumps({"long_prompt_tokens": args.prompt_tokens, "long_ttft_s": round(t1 - t0, 3),
                      "max_gap_s": round(max(gaps), 3) if gaps else None, "chunks_in_window": len(gaps)}))


if __name__ == "__main__":
    main()
