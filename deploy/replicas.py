"""N `exspec serve` replicas on 127.0.0.1 behind HAProxy (least connections, health checks on /health).

    .venv/bin/python deploy/replicas.py --replicas 2 --port 8000 -- --model DIR --draft-model DIR2

Everything after `--` goes to every `exspec serve` (each gets its own --host 127.0.0.1 --port). Replica i
listens on --first-replica-port + i - 1; HAProxy on --bind:--port. The run directory (--run-dir, default a new
temporary one) holds the rendered haproxy.cfg, HAProxy's admin socket, one log per replica and state.json
(pids and ports, rewritten whenever a replica is started again). A replica that exits is started again after
--restart-delay seconds, as a Deployment would (--no-restart: left down).

Ctrl+C or SIGTERM: every replica gets SIGTERM and drains (new requests 503, running ones finish within its
--shutdown-timeout) while HAProxy keeps forwarding their streams; HAProxy stops once they have exited. A
second Ctrl+C passes a second SIGTERM on: the replicas end their open streams at once (error event + [DONE]).

Needs `haproxy` (Debian: apt-get install haproxy). Standard library only; see docs/DEPLOY.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "haproxy" / "haproxy.cfg.in"
BACKEND = "exspec_replicas"


@dataclass
class Replica:
    name: str  # replica-1 ...: the HAProxy server name, also sent back as X-Exspec-Replica
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exits: list[int] = field(default_factory=list)  # exit statuses seen so far
    down_since: float | None = None  # monotonic time it was seen exited (restart pending)


def render_config(ports: list[int], bind: str, port: int, stats_socket: Path, check_inter_ms: int = 1000) -> str:
    """haproxy.cfg for replicas on 127.0.0.1:`ports`, named replica-1 ... in order."""
    if not ports:
        raise ValueError("at least one replica port is needed")
    servers = "\n".join(f"    server replica-{i} 127.0.0.1:{p}" for i, p in enumerate(ports, 1))
    fields = {
        "@STATS_SOCKET@": str(stats_socket),
        "@BIND@": bind,
        "@PORT@": str(port),
        "@CHECK_INTER_MS@": str(check_inter_ms),
        "@FAST_INTER_MS@": str(max(100, check_inter_ms // 2)),
        "@SERVERS@": servers,
    }
    text = TEMPLATE.read_text(encoding="utf-8")
    for key, value in fields.items():
        text = text.replace(key, value)
    return text


def haproxy_command(socket_path: Path, command: str, timeout: float = 2.0) -> str:
    """Send one command to HAProxy's admin socket; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(socket_path))
        s.sendall(command.encode() + b"\n")
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode("utf-8", "replace")


def server_states(socket_path: Path) -> dict[str, str]:
    """Each replica's state as HAProxy sees it: 'UP', 'DOWN', 'UP 1/2' (going down), 'DOWN 1/2' (coming up)..."""
    lines = haproxy_command(socket_path, "show stat").splitlines()
    if not lines or not lines[0].startswith("# "):
        raise RuntimeError(f"unexpected `show stat` answer: {lines[:2]}")
    header = lines[0][2:].split(",")
    px, sv, st = header.index("pxname"), header.index("svname"), header.index("status")
    out = {}
    for line in lines[1:]:
        row = line.split(",")
        if len(row) > st and row[px] == BACKEND and row[sv] not in ("FRONTEND", "BACKEND"):
            out[row[sv]] = row[st]
    return out


def healthy(port: int, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class Topology:
    """The replicas and HAProxy: start, watch (restart exited replicas), stop."""

    def __init__(self, args: argparse.Namespace, serve_args: list[str]) -> None:
        self.args = args
        self.serve_args = serve_args
        self.run_dir: Path = args.run_dir
        self.stats_socket = self.run_dir / "haproxy.sock"
        self.replicas = [Replica(f"replica-{i}", args.first_replica_port + i - 1, self.run_dir / f"replica-{i}.log")
                         for i in range(1, args.replicas + 1)]
        self.haproxy: subprocess.Popen | None = None
        self.signals = 0  # SIGINT/SIGTERM received

    # ------------------------------------------------------------------ start

    def start_replica(self, r: Replica) -> None:
        cmd = [sys.executable, "-m", "exspec", "serve", *self.serve_args, "--host", "127.0.0.1", "--port", str(r.port)]
        # Own session: a Ctrl+C in the terminal reaches this script only, which then drains the replicas once.
        with r.log.open("ab") as log:
            r.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        r.down_since = None
        self.write_state()

    def start(self) -> None:
        haproxy = shutil.which(self.args.haproxy) or shutil.which(self.args.haproxy, path="/usr/sbin:/usr/local/sbin")
        if haproxy is None:
            raise SystemExit(f"replicas: {self.args.haproxy!r} not found (Debian: apt-get install haproxy)")
        cfg = self.run_dir / "haproxy.cfg"
        cfg.write_text(render_config([r.port for r in self.replicas], self.args.bind, self.args.port,
                                     self.stats_socket, self.args.check_inter_ms), encoding="utf-8")
        check = subprocess.run([haproxy, "-c", "-q", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise SystemExit(f"replicas: haproxy rejected {cfg}:\n{check.stdout}{check.stderr}")
        for r in self.replicas:
            self.start_replica(r)
        deadline = time.monotonic() + self.args.startup_timeout
        pending = list(self.replicas)
        while pending:
            for r in list(pending):
                if r.proc.poll() is not None:
                    raise SystemExit(f"replicas: {r.name} exited with {r.proc.returncode} while starting; see {r.log}")
                if healthy(r.port):
                    pending.remove(r)
            if time.monotonic() > deadline:
                raise SystemExit(f"replicas: {[r.name for r in pending]} not healthy within {self.args.startup_timeout:g} s")
            if self.signals:
                raise SystemExit(130)
            time.sleep(0.2)
        with (self.run_dir / "haproxy.log").open("ab") as log:
            self.haproxy = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            if self.haproxy.poll() is not None:
                raise SystemExit(f"replicas: haproxy exited with {self.haproxy.returncode}; see {self.run_dir / 'haproxy.log'}")
            try:
                states = server_states(self.stats_socket)
                if len(states) == len(self.replicas) and all(s == "UP" for s in states.values()):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("replicas: haproxy did not see every replica UP within 30 s")
            time.sleep(0.1)
        self.write_state(ready=True)
        print(f"replicas: ready: http://{self.args.bind}:{self.args.port}/v1 -> "
              f"{', '.join(f'{r.name} :{r.port}' for r in self.replicas)} (run dir {self.run_dir})", flush=True)

    # ------------------------------------------------------------------ watch

    def watch(self) -> None:
        """Until a signal: start again every replica that exited (after --restart-delay); stop if HAProxy dies."""
        while not self.signals:
            if self.haproxy.poll() is not None:
                raise SystemExit(f"replicas: haproxy exited with {self.haproxy.returncode}")
            for r in self.replicas:
                if r.proc.poll() is None:
                    continue
                if r.down_since is None:
                    r.down_since = time.monotonic()
                    r.exits.append(r.proc.returncode)
                    print(f"replicas: {r.name} exited with {r.proc.returncode}"
                          + ("" if self.args.restart else " (not restarted: --no-restart)"), flush=True)
                    self.write_state()
                elif self.args.restart and time.monotonic() - r.down_since >= self.args.restart_delay:
                    r.restarts += 1
                    print(f"replicas: starting {r.name} again (restart {r.restarts})", flush=True)
                    self.start_replica(r)
            time.sleep(0.1)

    # ------------------------------------------------------------------ stop

    def on_signal(self, sig: int, frame) -> None:
        self.signals += 1
        if self.signals >= 2:  # the second one: passed on, the replicas end their streams at once
            for r in self.replicas:
                if r.proc is not None and r.proc.poll() is None:
                    r.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        """Drain every replica (SIGTERM), wait for them (SIGKILL after --stop-timeout), then stop HAProxy."""
        running = [r for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        for r in running:
            r.proc.send_signal(signal.SIGTERM)
        if running:
            print(f"replicas: draining {len(running)} replica(s); Ctrl+C again ends their streams now", flush=True)
        deadline = time.monotonic() + self.args.stop_timeout
        status = 0
        for r in running:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"replicas: {r.name} still running after {self.args.stop_timeout:g} s: SIGKILL", flush=True)
                r.proc.kill()
                r.proc.wait(10)
                status = 1
        if self.haproxy is not None and self.haproxy.poll() is None:
            self.haproxy.send_signal(signal.SIGUSR1)  # soft stop: finishes what it is still forwarding
            try:
                self.haproxy.wait(10)
            except subprocess.TimeoutExpired:
                self.haproxy.kill()
                self.haproxy.wait(10)
        self.write_state(stopped=True)
        print("replicas: stopped", flush=True)
        return status

    def write_state(self, ready: bool = False, stopped: bool = False) -> None:
        state = {
            "ready": ready,
            "stopped": stopped,
            "url": f"http://{self.args.bind}:{self.args.port}",
            "stats_socket": str(self.stats_socket),
            "haproxy_pid": self.haproxy.pid if self.haproxy is not None else None,
            "replicas": [{"name": r.name, "port": r.port, "pid": r.proc.pid if r.proc else None,
                          "restarts": r.restarts, "exits": r.exits, "log": str(r.log)} for r in self.replicas],
        }
        tmp = self.run_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, self.run_dir / "state.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deploy/replicas.py", description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [options] -- [exspec serve options]")
    p.add_argument("--replicas", type=int, default=2, help="exspec serve processes (default 2)")
    p.add_argument("--bind", default="127.0.0.1", help="HAProxy's address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HAProxy's port (default 8000)")
    p.add_argument("--first-replica-port", type=int, default=8001, help="replica i listens on this + i - 1 (default 8001)")
    p.add_argument("--run-dir", type=Path, default=None, help="config, logs, state.json, admin socket (default: a new temp dir)")
    p.add_argument("--haproxy", default="haproxy", help="the haproxy binary (default: haproxy on PATH)")
    p.add_argument("--check-inter-ms", type=int, default=1000, help="health check interval, ms (default 1000)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for every replica to load (default 600)")
    p.add_argument("--stop-timeout", type=float, default=60.0,
                   help="seconds the replicas get to drain on Ctrl+C before SIGKILL (default 60; keep it above "
                        "their --shutdown-timeout)")
    p.add_argument("--no-restart", dest="restart", action="store_false", help="leave a replica that exits down")
    p.add_argument("--restart-delay", type=float, default=1.0, help="seconds before an exited replica starts again")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    else:
        serve_args = []
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replicas < 1:
        parser.error(f"--replicas must be >= 1, got {args.replicas}")
    if not 100 <= args.check_inter_ms <= 60_000:
        parser.error(f"--check-inter-ms must be in [100, 60000], got {args.check_inter_ms}")
    bad = [a for a in serve_args if a in ("--host", "--port") or a.startswith(("--host=", "--port="))]
    if bad:
        parser.error(f"{bad[0]} is set per replica by this script; leave it out of the exspec serve options")
    args.run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="exspec-replicas-")).resolve()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    topo = Topology(args, serve_args)
    signal.signal(signal.SIGINT, topo.on_signal)
    signal.signal(signal.SIGTERM, topo.on_signal)
    try:
        topo.start()
        topo.watch()
    except SystemExit as e:
        if e.code not in (None, 0):
            print(e.code if isinstance(e.code, str) else f"replicas: stopping ({e.code})", file=sys.stderr, flush=True)
        topo.stop()
        return e.code if isinstance(e.code, int) else 1
    return topo.stop()


if __name__ == "__main__":
    sys.exit(main())
