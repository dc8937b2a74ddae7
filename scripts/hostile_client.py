"""Hostile-client run (issue 11) against a real `exspec serve` (tiny llama pair) while 4 streams run.

Run from the repository root: `.venv/bin/python scripts/hostile_client.py`. Prints /health, every stream's finish
reason and longest gap, each hostile request's status, and RSS; loopback only, bounded in time."""
import json, os, signal, subprocess, sys, tempfile, threading, time
from pathlib import Path
import httpx
sys.path.insert(0, ".")
from tests.support.tiny_models import build_pair
from tests.support.server_fixtures import free_port, wait_healthy

root = Path(tempfile.mkdtemp()); target, draft = build_pair(root, "llama")
port = free_port(); base = f"http://127.0.0.1:{port}"
proc = subprocess.Popen([sys.executable, "-m", "exspec", "serve", "--model", str(target), "--draft-model", str(draft),
    "--port", str(port), "--max-model-len", "512", "--log-level", "warning"], env={**os.environ, "OMP_NUM_THREADS": "1"})
def rss():
    return int(next(l for l in open(f"/proc/{proc.pid}/status") if l.startswith("VmRSS")).split()[1]) // 1024
try:
    wait_healthy(base, proc=proc)
    print("RSS at start", rss(), "MB")
    results = {}; gaps = {}; allgaps = []; windows = {}
    def stream(i):
        body = {"prompt": [5, 6, 7 + i], "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True, "use_speculation": i % 2 == 0}
        last = None; g = 0; fin = None
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if not line.startswith("data:"): continue
                now = time.monotonic(); g = max(g, now - last) if last else 0; allgaps.append((now - last, now)) if last else None; last = now
                if line != "data: [DONE]":
                    fin = json.loads(line[5:])["choices"][0]["finish_reason"] or fin
        results[i] = fin; gaps[i] = g
    ts = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in ts: t.start()
    time.sleep(0.5)
    words = "hello world " * (10 * 2**20 // 12)
    cases = {
        "top_k 2**63": {"prompt": "hi", "top_k": 2**63, "temperature": 1},
        "seed -1": {"prompt": "hi", "seed": -1, "max_tokens": 4},
        "seed 2**80": {"prompt": "hi", "seed": 2**80, "max_tokens": 4},
        "1M stop_token_ids": {"prompt": "hi", "stop_token_ids": list(range(300)) * 3333, "min_tokens": 2},
        "100k stop strings": {"prompt": "hi", "stop": ["xy"] * 100_000},
        "echo id -1": {"prompt": [5, -1], "echo": True},
        "echo id 10**20": {"prompt": [5, 10**20], "echo": True},
        "temperature 1e-40": {"prompt": "hi", "temperature": 1e-40, "max_tokens": 4},
        "10 MB prompt": {"prompt": words},
        "n 10**6": {"prompt": "hi", "n": 10**6},
    }
    raw = {k: json.dumps(v).encode() for k, v in cases.items()}
    raw["surrogate prompt"] = b'{"prompt": "\\ud800"}'
    raw["surrogate model"] = b'{"prompt": "hi", "model": "\\ud800"}'
    raw["surrogate chat"] = b'{"messages": [{"role": "user", "content": "\\ud800"}]}'
    statuses = {}
    for name, body in raw.items():
        path = "/v1/chat/completions" if "chat" in name else "/v1/completions"
        t0 = time.monotonic()
        r = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=120)
        windows[name] = (t0, time.monotonic())
        statuses[name] = (r.status_code, round(time.monotonic() - t0, 3), r.json()["error"]["param"] if r.status_code >= 400 else "")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 52428800\r\n\r\n"
    import socket
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.monotonic(); s.sendall(head); ans = s.recv(200); statuses["50 MB Content-Length"] = (ans.split(b" ")[1].decode(), round(time.monotonic() - t0, 3), "")
    statuses["GET /v1/completions"] = (httpx.get(base + "/v1/completions").status_code, 0, httpx.get(base + "/v1/completions").headers.get("allow"))
    h = httpx.get(base + "/health").status_code
    for t in ts: t.join()
    for k, v in statuses.items(): print(f"  {k:24s} -> {v}")
    print("health during:", h, "after:", httpx.get(base + "/health").status_code)
    print("streams:", results, "max gap per stream (s):", {k: round(v, 3) for k, v in gaps.items()})
    for gap, at in sorted(allgaps)[-6:]:
        print("  gap", round(gap, 3), "during", [k for k, (a, b) in windows.items() if a <= at <= b + 0.05] or "no case")
    print("5xx:", sum(1 for v in statuses.values() if str(v[0]).startswith("5")))
    print("RSS at end", rss(), "MB")
finally:
    proc.send_signal(signal.SIGTERM); print("exit", proc.wait(60))
