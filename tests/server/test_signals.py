"""Signals on a real `exspec serve` process (tiny pair, loopback): the first SIGTERM/SIGINT drains, a second
one ends every open stream at once with a final error event and `data: [DONE]`, answers a waiting
non-streamed request with 503, and exits 128 + the signal's number."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.gates import wait_until
from tests.support.server_fixtures import free_port, wait_healthy
from tests.support.tiny_models import build_pair

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("signal-models"), "llama")


def test_second_signal_ends_every_stream_cleanly(pair, tmp_path):
    """SIGTERM then SIGINT (Ctrl+C after a `kill`): both signals are handled, in one process start.

    The server's steps are held (tests.support.gated_serve) from before the requests until every stream has
    ended, so the second signal always finds all of them open, however fast the machine is."""
    target, draft = pair
    port = free_port()
    hold = tmp_path / "hold-steps"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXSPEC_") or k == "EXSPEC_CACHE"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "tests.support.gated_serve", str(hold), "serve", "--model", str(target),
           "--draft-model", str(draft), "--port", str(port), "--max-model-len", "160", "--max-batch-size", "1",
           "--pool-size", "1", "--shutdown-timeout", "60", "--log-level", "info"]
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": [5, 6, 7], "max_tokens": 150, "temperature": 0, "ignore_eos": True,
            "use_speculation": False}
    streams: list[list[str]] = [[] for _ in range(3)]
    answered: list[httpx.Response] = []
    started = threading.Barrier(len(streams) + 1)

    def stream(i: int) -> None:
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            started.wait(30)
            streams[i].extend(line for line in r.iter_lines() if line.startswith("data:"))

    def plain() -> None:
        answered.append(httpx.post(base + "/v1/completions", json=body, timeout=60))

    def logged(text: str) -> bool:
        log.flush()
        return text in Path(log.name).read_text()

    try:
        wait_healthy(base, timeout=600, proc=proc)  # a loaded machine starts slowly
        hold.touch()  # from here on no decode step runs: no stream can finish
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(streams))]
        threads.append(threading.Thread(target=plain))
        for t in threads:
            t.start()
        started.wait(30)  # 1 running (one slot), 2 streams waiting; the plain request waits or is refused
        proc.send_signal(signal.SIGTERM)  # drain: all four would be served to the end (60 s allowed)
        wait_until(lambda: logged("draining (a second signal"), what="the first signal to be handled")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(30)
        hold.unlink()  # every request has its answer; let the step loop reach its abort and stop
        status = proc.wait(30)
        stopped_in = time.monotonic() - t0
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    out = log.read()
    assert status == 128 + signal.SIGINT, out
    print(f"stopped {stopped_in:.2f} s after the second signal")
    assert stopped_in < 10, out
    cut = 0
    for events in streams:
        assert events[-1] == "data: [DONE]", (events[-3:], out)
        last = json.loads(events[-2][5:])
        if "error" in last:
            assert "shutting down" in last["error"]["message"], out
            assert last["error"]["type"] == "service_unavailable"
            cut += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert cut == len(streams), out  # steps were held: every stream was still open at the second signal
    assert len(answered) == 1 and answered[0].status_code == 503, out
    assert answered[0].headers["retry-after"]
    assert "ending every open request now" in out
