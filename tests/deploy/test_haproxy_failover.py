"""Two `exspec serve` replicas behind HAProxy, started by deploy/replicas.py (tiny llama pair, loopback only):

1. the project's load test through the proxy gets outputs identical to the target alone (an `exspec bench`
   target-ar reference), and both replicas served;
2. SIGTERM to a replica mid-run: its in-flight streams drain to the end, every request sent meanwhile gets
   200 (503s from the draining replica are retried on the other), HAProxy takes it out of rotation and
   sends it nothing more; it exits 0 and the script starts it again;
3. SIGKILL to a replica mid-run: its in-flight streams fail visibly at the client (a transport error, never
   a clean end without [DONE]); every request sent after the kill succeeds;
4. Ctrl+C to the script drains and stops every process it started.

Every wait is bounded. Each scenario prints its figures (docs/DEPLOY.md records them): run with -s.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.deploy.tools import require_tool
from tests.support.tiny_models import build_pair

pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "replicas.py"
STREAMS = 8  # concurrent streams per scenario: about 4 on each replica (least connections)
STREAM_TOKENS = 200  # long enough to be mid-run when the signal comes (a few seconds on the tiny pair)
SERVE = ["--speculation", "fixed", "--num-speculative-tokens", "3", "--max-model-len", "256",
         "--max-batch-size", "4", "--pool-size", "8", "--shutdown-timeout", "30", "--log-level", "warning"]


def _load_script():
    spec = importlib.util.spec_from_file_location("exspec_deploy_replicas", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


replicas = _load_script()


def _free_consecutive_ports(n: int) -> int:
    """A first port p with p .. p + n - 1 all free on 127.0.0.1 (asked of the OS, then checked)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free consecutive ports")


def _wait(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


@dataclass
class Topology:
    proc: subprocess.Popen
    run_dir: Path
    url: str  # http://127.0.0.1:PORT (HAProxy)
    log: Path
    hold: Path  # while this file exists, no replica runs a decode step (tests/support/hold_hook)

    def state(self) -> dict:
        return json.loads((self.run_dir / "state.json").read_text())

    def states(self) -> dict[str, str]:
        return replicas.server_states(Path(self.state()["stats_socket"]))

    def pid(self, name: str) -> int:
        return next(r["pid"] for r in self.state()["replicas"] if r["name"] == name)

    def all_up(self, timeout: float = 90.0) -> None:
        def up():
            try:
                return all(s == "UP" for s in self.states().values())
            except OSError:
                return False
        _wait(up, timeout, "both replicas UP in HAProxy", 0.1)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("deploy-models"), "llama")


@pytest.fixture(scope="module")
def reference(pair, tmp_path_factory) -> Path:
    """The target alone (target-ar, B = 1, greedy): `exspec bench --write-reference`."""
    from exspec.cli.main import main as exspec_main

    out = tmp_path_factory.mktemp("deploy-ref")
    rc = exspec_main(["bench", "--model", str(pair[0]), "--methods", "target-ar", "--batch-sizes", "1",
                      "--num-prompts", "8", "--max-tokens", "16", "--max-prompt-len", "64", "--repeats", "1",
                      "--no-warmup", "--no-progress", "--output", str(out), "--write-reference", str(out / "ref.jsonl")])
    assert rc == 0
    return out / "ref.jsonl"


@pytest.fixture(scope="module")
def topo(pair, tmp_path_factory):
    haproxy = require_tool("haproxy")
    target, draft = pair
    run_dir = tmp_path_factory.mktemp("deploy-run")
    log = run_dir / "script.log"
    proxy_port = _free_consecutive_ports(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXSPEC_")}
    env["OMP_NUM_THREADS"] = "1"
    # No replica runs a decode step while this file exists (tests/support/hold_hook, test-only).
    hold = run_dir / "hold-steps"
    env["EXSPEC_TEST_HOLD_FILE"] = str(hold)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "support" / "hold_hook"), str(ROOT),
                                         *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, str(SCRIPT), "--replicas", "2", "--port", str(proxy_port), "--haproxy", haproxy,
           "--first-replica-port", str(proxy_port + 1), "--run-dir", str(run_dir), "--startup-timeout", "120",
           "--stop-timeout", "45", "--", "--model", str(target), "--draft-model", str(draft), *SERVE]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    t = Topology(proc, run_dir, f"http://127.0.0.1:{proxy_port}", log, hold)
    try:
        _wait(lambda: "replicas: ready" in t.output() or proc.poll() is not None, 150, "the topology to start", 0.2)
        assert proc.poll() is None, t.output()
        yield t
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for r in json.loads((run_dir / "state.json").read_text())["replicas"] if (run_dir / "state.json").exists() else []:
            try:
                os.kill(r["pid"], signal.SIGKILL)  # only if a failed test left one behind
            except (ProcessLookupError, TypeError):
                pass


# ------------------------------------------------------------------------------------- a client's view


@dataclass
class Outcome:
    sent_at: float  # monotonic
    status: int | None = None
    replica: str | None = None  # X-Exspec-Replica: who answered
    events: list[dict] = field(default_factory=list)  # parsed `data:` events before [DONE]
    done: bool = False  # saw data: [DONE]
    transport_error: str | None = None
    first_event: threading.Event = field(default_factory=threading.Event)

    @property
    def kind(self) -> str:
        """completed | error_event | http_error | transport_error | silent (ended without [DONE] or error)."""
        if self.transport_error is not None:
            return "transport_error"
        if self.status != 200:
            return "http_error"
        if self.events and "error" in self.events[-1]:
            return "error_event"
        if self.done and self.events and self.events[-1]["choices"][0].get("finish_reason"):
            return "completed"
        return "silent"


def stream(url: str, prompt: list[int], max_tokens: int, out: Outcome) -> Outcome:
    # return_token_ids: the prefill's token is an event of its own, even while steps are held
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out.status = r.status_code
            out.replica = r.headers.get("x-exspec-replica")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.done = True
                    break
                out.events.append(json.loads(data))
                out.first_event.set()
    except httpx.HTTPError as e:
        out.transport_error = f"{type(e).__name__}: {e}"
    finally:
        out.first_event.set()
    return out


def start_streams(url: str, n: int, hold: Path | None = None) -> tuple[list[Outcome], list[threading.Thread]]:
    """`n` streams, each with its first event; with `hold`, the replicas run no decode step from before the
    streams start until the caller removes the file (tests/support/hold_hook: prompts are still prefilled), so
    every stream is in flight when the test acts, whatever the machine's speed."""
    if hold is not None:
        hold.touch()
    outs = [Outcome(time.monotonic()) for _ in range(n)]
    threads = [threading.Thread(target=stream, args=(url, [5, 6, 7, 10 + i], STREAM_TOKENS, o), daemon=True)
               for i, o in enumerate(outs)]
    for t in threads:
        t.start()
    for o in outs:
        assert o.first_event.wait(60), "a stream got no event within 60 s"
    assert all(o.kind != "completed" and o.transport_error is None for o in outs), \
        "a stream had already ended before the signal: nothing would be tested"
    return outs, threads


def join(threads: list[threading.Thread], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a stream did not end within its bound"


def figures(label: str, outs: list[Outcome]) -> dict[str, int]:
    kinds = [o.kind for o in outs]
    counts = {k: kinds.count(k) for k in ("completed", "error_event", "http_error", "transport_error", "silent")}
    print(f"\n{label}: sent {len(outs)}, completed {counts['completed']}, failed visibly "
          f"{counts['error_event'] + counts['http_error'] + counts['transport_error']} "
          f"({counts['error_event']} error event, {counts['http_error']} HTTP error, "
          f"{counts['transport_error']} transport error), lost silently {counts['silent']}")
    return counts


def victim_of(outs: list[Outcome], exclude: str | None = None) -> str:
    """The replica with the most of these streams in flight (never `exclude`)."""
    names = [o.replica for o in outs if o.replica and o.replica != exclude]
    assert names, "no stream was answered by a replica that may be stopped"
    return max(sorted(set(names)), key=names.count)


# --------------------------------------------------------------------------------------------- tests


def test_the_rendered_config_passes_haproxy_check(tmp_path):
    haproxy = require_tool("haproxy")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(replicas.render_config([9101, 9102, 9103], "127.0.0.1", 9100, tmp_path / "s.sock"))
    text = cfg.read_text()
    assert [line.split()[1] for line in text.splitlines() if line.strip().startswith("server ")] == \
        ["replica-1", "replica-2", "replica-3"]
    assert not re.search(r"@[A-Z_]+@", text), "a template field was left unfilled"
    for needed in ("balance leastconn", "option httpchk GET /health", "http-check expect status 200",
                   "retry-on conn-failure empty-response 503", "option redispatch", "timeout server 10m"):
        assert needed in text
    directives = [line.split("#")[0].split() for line in text.splitlines()]
    assert not any(d and d[0] in ("compression", "filter") for d in directives), "SSE must not be compressed"
    assert not any(d[:2] == ["option", "httpclose"] for d in directives)
    out = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_script_rejects_per_replica_flags_and_a_bad_count():
    for bad in (["--", "--port", "9000"], ["--", "--host=0.0.0.0"], ["--replicas", "0"]):
        out = subprocess.run([sys.executable, str(SCRIPT), *bad], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and ("must be" in out.stderr or "per replica" in out.stderr), (bad, out.stderr)


def test_load_test_through_the_proxy_equals_the_target_alone(topo, reference, tmp_path):
    from exspec.loadtest.__main__ import main as loadtest

    before = topo.states()
    assert before == {"replica-1": "UP", "replica-2": "UP"}
    out = tmp_path / "result.json"
    rc = loadtest(["--base-url", topo.url + "/v1", "--reference", str(reference), "--no-progress",
                   "--output", str(out), "--request-timeout", "60", "--timeout", "120"])
    r = json.loads(out.read_text())
    eq = r["equivalence"]
    print(f"\nload test through HAProxy: {r['completed']} completed, {r['failed']} failed, "
          f"{eq['matched']}/{eq['checked']} identical to the target alone")
    assert rc == 0, r["errors"]
    assert r["completed"] == 8 and r["failed"] == 0, r["errors"]
    assert eq["checked"] == eq["matched"] == 8 and eq["mismatches"] == []
    # Both replicas served (sessions per server, from HAProxy's counters).
    stat = replicas.haproxy_command(Path(topo.state()["stats_socket"]), "show stat").splitlines()
    header = stat[0][2:].split(",")
    served = {row.split(",")[1]: int(row.split(",")[header.index("stot")]) for row in stat[1:]
              if row.startswith("exspec_replicas,replica-")}
    assert served["replica-1"] > 0 and served["replica-2"] > 0, served


def test_sigterm_drains_in_flight_streams_and_leaves_rotation(topo):
    topo.all_up()
    outs, threads = start_streams(topo.url, STREAMS, topo.hold)
    victim = victim_of(outs)
    survivor = "replica-2" if victim == "replica-1" else "replica-1"
    on_victim = [o for o in outs if o.replica == victim]
    pid = topo.pid(victim)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)  # its streams are in flight: steps are held
    topo.hold.unlink()  # the drain lets them run to their end

    # Meanwhile: new requests, one every 0.1 s, and HAProxy's view of the victim.
    down_at: list[float] = []

    def watch() -> None:
        while not down_at and time.monotonic() - t0 < 30:
            try:
                if not topo.states()[victim].startswith("UP"):
                    down_at.append(time.monotonic())
            except OSError:
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    later: list[Outcome] = []
    # At least 5 (a count, not a time: a loaded machine answers fewer per second), and on until 1.5 s after
    # HAProxy took the victim out.
    while time.monotonic() - t0 < 60 and (len(later) < 5 or not down_at or time.monotonic() - down_at[0] < 1.5):
        later.append(stream(topo.url, [9, len(later) % 50], 4, Outcome(time.monotonic())))
        time.sleep(0.1)
    watcher.join(5)
    join(threads)

    counts = figures(f"SIGTERM to {victim}, in-flight streams", outs)
    late = figures("requests sent during and after its drain", later)
    assert down_at, f"HAProxy never took {victim} out of rotation"
    left_after = down_at[0] - t0
    print(f"HAProxy took {victim} out of rotation {left_after:.2f} s after SIGTERM "
          f"({sum(o.replica == victim for o in later)} later request(s) answered by it before that)")
    assert counts["silent"] == 0 and late["silent"] == 0
    # Drain through the proxy: every stream the victim had in flight ran to its end.
    assert len(on_victim) >= 1
    assert all(o.kind == "completed" for o in on_victim), [(o.kind, o.events[-1:]) for o in on_victim]
    assert all(len(o.events) >= STREAM_TOKENS // 4 for o in on_victim)
    assert counts["completed"] == STREAMS
    # Nothing failed meanwhile: the draining replica's 503s were retried on the survivor.
    assert late["completed"] == len(later) >= 5, [(o.kind, o.status, o.replica) for o in later]
    # Out of rotation within a few seconds (checks every 1 s, fall 2), and nothing sent to it after that.
    assert left_after < 15
    assert all(o.replica == survivor for o in later if o.sent_at > down_at[0] + 0.2)
    # It exits 0 once drained; the script starts it again (as a Deployment would).
    _wait(lambda: next(r for r in topo.state()["replicas"] if r["name"] == victim)["exits"], 60,
          f"{victim} to exit", 0.1)
    assert next(r for r in topo.state()["replicas"] if r["name"] == victim)["exits"] == [0], topo.output()
    topo.all_up()
    assert topo.pid(victim) != pid


def test_sigkill_fails_in_flight_streams_visibly_and_later_requests_succeed(topo):
    topo.all_up()
    outs, threads = start_streams(topo.url, STREAMS, topo.hold)
    victim = victim_of(outs)
    on_victim = [o for o in outs if o.replica == victim]
    os.kill(topo.pid(victim), signal.SIGKILL)  # its streams are in flight: steps are held
    topo.hold.unlink()  # the survivor's streams and later requests go on
    t0 = time.monotonic()
    later = [stream(topo.url, [9, i], 4, Outcome(time.monotonic())) for i in range(6)]
    join(threads)

    counts = figures(f"SIGKILL to {victim}, in-flight streams", outs)
    late = figures("requests sent after the kill", later)
    print(f"the 6 later requests took {time.monotonic() - t0:.2f} s in all")
    assert counts["silent"] == 0 and late["silent"] == 0
    assert len(on_victim) >= 1
    # Its streams were cut: each one fails at the client (HAProxy aborts the chunked response).
    assert all(o.kind == "transport_error" for o in on_victim), [(o.kind, o.events[-1:]) for o in on_victim]
    assert all(o.kind == "completed" for o in outs if o.replica != victim)
    assert late["completed"] == len(later), [(o.kind, o.status, o.replica, o.transport_error) for o in later]
    assert all(o.replica != victim for o in later)
    _wait(lambda: next(r for r in topo.state()["replicas"] if r["name"] == victim)["exits"], 30,
          f"the script to see {victim} exit", 0.1)
    assert next(r for r in topo.state()["replicas"] if r["name"] == victim)["exits"][-1] == -signal.SIGKILL


def test_ctrl_c_drains_and_stops_every_process(topo):
    topo.all_up()
    state = topo.state()
    pids = [r["pid"] for r in state["replicas"]] + [state["haproxy_pid"]]
    outs, threads = start_streams(topo.url, 2)
    topo.proc.send_signal(signal.SIGINT)
    assert topo.proc.wait(60) == 0, topo.output()
    join(threads)
    assert all(o.kind == "completed" for o in outs), [o.kind for o in outs]
    assert topo.state()["stopped"] is True
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
