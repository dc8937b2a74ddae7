"""scripts/serve_fake_engine.py (the HTTP path over the model-free engine, docs/BENCHMARKS.md section 7) serves: a
streamed completion through it carries every token the fake engine emits, with k = 4 as with k = 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tests.support.fake_engine import FakeEngine
from tests.support.server_fixtures import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("k", [0, 4])
def test_the_fake_engine_server_streams_every_token(tmp_path, k):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "serve_fake_engine.py"), "--port", str(port),
                             "--k", str(k), "--slots", "4", "--tokenizer-dir", str(tmp_path / "tok")],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc=proc)
        body = {"model": "fake", "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True,
                "return_token_ids": True}
        ids, finish = [], None
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    ids += choice.get("token_ids") or []
                    finish = choice.get("finish_reason") or finish
        assert ids == [FakeEngine.token_at(position) for position in range(3, 15)] and finish == "length"
    finally:
        proc.terminate()
        proc.wait(30)
