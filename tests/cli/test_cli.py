"""`exspec serve`: settings from flags and EXSPEC_* variables, clear errors, the demo default, and a real
process that drains on SIGTERM and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from exspec.cli.main import build_parser, main
from exspec.cli.flags import settings_from_args
from tests.support.gates import wait_until
from tests.support.server_fixtures import free_port, serve_in_thread, wait_healthy
from tests.support.tiny_models import build_pair

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("EXSPEC_") and key != "EXSPEC_CACHE":
            monkeypatch.delenv(key)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("cli-models"), "llama")


def _settings(*argv: str):
    return settings_from_args(build_parser("serve").parse_args(["serve", *argv]))


def test_defaults():
    s = _settings()
    assert (s.model, s.host, s.port, s.api_key) == (None, "127.0.0.1", 8000, None)
    assert s.resolved_pool_size == 4 * s.max_batch_size


@pytest.mark.parametrize("batch, pool", [(1, 1), (2, 8), (3, 12)])
def test_the_default_pool_holds_four_batches_but_one_sequence_at_batch_size_one(batch, pool):
    """W = 4 x B gives a step same-length groups to find; at B = 1 there are none to find, and taking turns between
    sequences only costs (docs/BENCHMARKS.md section 2). A W given is kept."""
    assert _settings("--max-batch-size", str(batch)).resolved_pool_size == pool
    assert _settings("--max-batch-size", "1", "--pool-size", "4").resolved_pool_size == 4


def test_env_then_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("EXSPEC_PORT", "9000")
    monkeypatch.setenv("EXSPEC_MAX_BATCH_SIZE", "2")
    monkeypatch.setenv("EXSPEC_API_KEY", "from-env")
    monkeypatch.setenv("EXSPEC_MODEL", str(tmp_path))
    s = _settings("--port", "9001", "--served-model-name", "m")
    assert (s.port, s.max_batch_size, s.api_key, s.model, s.served_model_name) == (9001, 2, "from-env", tmp_path, "m")


def test_compile_flag_and_variable(monkeypatch):
    assert _settings().compile is False  # off by default on every device until measured
    monkeypatch.setenv("EXSPEC_COMPILE", "1")
    assert _settings().compile is True
    assert _settings("--no-compile").compile is False  # a flag wins over the variable
    monkeypatch.delenv("EXSPEC_COMPILE")
    assert _settings("--compile").compile is True


@pytest.mark.parametrize(
    "argv, env, needle",
    [
        (["--port", "abc"], {}, "--port / EXSPEC_PORT"),
        (["--port", "70000"], {}, "--port / EXSPEC_PORT"),
        ([], {"EXSPEC_MAX_BATCH_SIZE": "0"}, "--max-batch-size / EXSPEC_MAX_BATCH_SIZE"),
        (["--max-batch-size", "8", "--pool-size", "4"], {}, "pool_size must be >= max_batch_size"),
        (["--max-batch-size", "2", "--pool-size", "17"], {}, "pool_size must be <= max_batch_size x 8 = 16"),
        (["--dtype", "int3"], {}, "--dtype / EXSPEC_DTYPE: dtype must be one of"),
        (["--speculation", "psychic"], {}, "--speculation / EXSPEC_SPECULATION: speculation must be one of"),
        ([], {"EXSPEC_GEMM": "fast"}, "--gemm / EXSPEC_GEMM: gemm must be one of auto, packed, unpadded, default"),
        (["--device", "tpu"], {}, "--device / EXSPEC_DEVICE: device must be auto, cpu, cuda or cuda:N"),
        (["--log-level", "loud"], {}, "--log-level / EXSPEC_LOG_LEVEL"),
        (["--demo", "huge"], {}, "--demo / EXSPEC_DEMO: demo must be one of smollm2, tiny"),
        (["--draft-model", "/d"], {}, "draft_model needs model"),
    ],
)
def test_invalid_settings_exit_2(monkeypatch, capsys, argv, env, needle):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("exspec serve: error: invalid settings") and needle in err


def test_missing_model_dir_is_a_clear_error(capsys, tmp_path):
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_max_model_len_beyond_the_model_is_refused(capsys, pair):
    assert main(["serve", "--model", str(pair[0]), "--max-model-len", "4096"]) == 2
    assert "exceeds the models' position limit 1024" in capsys.readouterr().err


def test_no_model_serves_the_demo_pair_and_the_docs_example_runs(monkeypatch, pair, capsys):
    """Without --model: the demo pair (a tiny stand-in here), named exspec-demo; docs/SERVER.md's client
    example then runs against it as written, but for the port."""
    import exspec.demo
    from exspec.cli.serve import build_server

    asked = []
    monkeypatch.setattr(exspec.demo, "ensure_demo_pair", lambda progress=True, scale="?": asked.append(scale) or pair)
    monkeypatch.setattr(exspec.demo, "demo_target",
                        lambda progress=True, scale="?": asked.append(f"{scale} target") or pair[0])
    server = build_server(_settings("--max-model-len", "160"))
    # the real pair by default, served with n-gram lookup: its target alone, no draft built or loaded
    assert asked == ["smollm2 target"]
    engine = server.config.app.state.scheduler.engine
    assert engine.draft is None and engine.lookup and engine.max_k == 4
    # its trained draft when asked; --demo tiny (EXSPEC_DEMO=tiny) picks the toy pair, with its draft
    assert build_server(_settings("--max-model-len", "160", "--speculative-method", "draft")).config.app.state.scheduler.engine.draft is not None
    build_server(_settings("--max-model-len", "160", "--demo", "tiny"))
    assert asked == ["smollm2 target", "smollm2", "tiny"]
    app = server.config.app
    assert app.state.model_name == "exspec-demo"
    assert (server.config.host, server.config.port) == ("127.0.0.1", 8000)
    assert app.state.scheduler.engine.max_model_len == 160

    doc = (REPO / "docs" / "SERVER.md").read_text()
    example = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'base_url="http://127.0.0.1:8000/v1"' in example
    with serve_in_thread(app) as (base, _, _):
        exec(compile(example.replace("http://127.0.0.1:8000", base), "SERVER.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def test_serve_process_drains_on_sigterm_and_exits_0(pair, tmp_path):
    """Steps are held (tests.support.gated_serve) from before the request until the drain has refused a late
    one: the stream is always mid-run at SIGTERM and the server always still draining, however fast."""
    target, draft = pair
    port = free_port()
    hold = tmp_path / "hold-steps"
    env = {**os.environ, "EXSPEC_SERVED_MODEL_NAME": "tiny-env", "EXSPEC_PORT": "1", "EXSPEC_SHUTDOWN_TIMEOUT": "30",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tests.support.gated_serve", str(hold), "serve", "--model", str(target),
           "--draft-model", str(draft), "--port", str(port), "--max-model-len", "160", "--max-batch-size", "2",
           "--pool-size", "2"]
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, timeout=600, proc=proc)  # a loaded machine starts slowly
        hold.touch()
        lines: list[str] = []
        first = threading.Event()
        # return_token_ids: the prefill's token is an event of its own, while steps are held
        body = {"model": "tiny-env", "prompt": [5, 6, 7], "max_tokens": 150, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}

        def stream() -> None:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "draining: no new requests" in Path(log.name).read_text(), what="the drain to begin")
        late = httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=10)
        assert late.status_code == 503, late.text  # while draining, new requests are refused
        hold.unlink()
        t.join(60)
        assert proc.wait(60) == 0
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    out = log.read()
    assert lines[-1] == "data: [DONE]", out
    assert '"finish_reason":"length"' in lines[-2]  # the running request finished despite SIGTERM
    assert "serving 'tiny-env'" in out and f"http://127.0.0.1:{port}/v1" in out
    assert "draining" in out
