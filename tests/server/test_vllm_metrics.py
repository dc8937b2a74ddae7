"""vLLM-compatible metric names on /metrics (issue 12): every `vllm:*` family vLLM documents for requests,
tokens, latencies and speculative decoding, with vLLM's types and labels (`model_name` = the served model
name, `engine`), fed by the same events as exspec's own `exspec_*` families.

The server tests scrape a real uvicorn over a tiny pair and parse with prometheus-client; the unit tests
feed `ServerMetrics` hand-written step stats and stream deltas (no model)."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exspec.scheduler.types import RequestOutput, StepStats
from exspec.server.metrics import METRIC_NAMES, VLLM_METRIC_NAMES, ServerMetrics
from tests.support.server_fixtures import running_server

SERVED = "exspec-test/llama"  # a served name with a slash, as Hugging Face ids have
K = 3  # speculative tokens per step (the largest k)

# vLLM's type of each family (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py). Written out here,
# not read from server/metrics.py, so that a wrong type there fails.
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:spec_decode_num_drafts_total": "counter",
    "vllm:spec_decode_num_draft_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_total": "counter",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": "counter",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}
# Sample names that vLLM's own Grafana dashboards query (examples/observability: prometheus_grafana/grafana.json
# and dashboards/grafana/vllm_speculative_decoding.json), besides vllm:request_max_num_generation_tokens,
# which exspec does not export (see docs/METRICS.md).
VLLM_DASHBOARD_SAMPLES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
)
# vllm:* family -> its exspec_* twin: the same quantity, so both move by the same amount.
TWINS = {
    "vllm:prompt_tokens_total": "exspec_prompt_tokens_total",
    "vllm:generation_tokens_total": "exspec_generation_tokens_total",
    "vllm:spec_decode_num_drafts_total": "exspec_spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total": "exspec_spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total": "exspec_spec_decode_num_accepted_tokens_total",
    "vllm:time_to_first_token_seconds_count": "exspec_time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum": "exspec_time_to_first_token_seconds_sum",
    "vllm:e2e_request_latency_seconds_count": "exspec_e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "exspec_e2e_request_latency_seconds_sum",
    "vllm:request_queue_time_seconds_count": "exspec_request_queue_time_seconds_count",
    "vllm:num_preemptions_total": "exspec_num_preemptions_total",
}
VLLM_LABELS = {"model_name": SERVED, "engine": "0"}


# ------------------------------------------------------------------------------------------ scraping


def families(base_url: str) -> dict:
    text = httpx.get(base_url + "/metrics").text
    return {f.name + "_total" if f.type == "counter" else f.name: f for f in text_string_to_metric_families(text)}


def totals(base_url: str) -> dict[str, float]:
    """Sample name -> its value summed over the series (the vllm:* ones: this model only) and, for labelled
    series, (sample name, label, value) -> value."""
    out: dict = {}
    for fam in families(base_url).values():
        for s in fam.samples:
            if s.name.startswith("vllm:") and s.labels.get("model_name") != SERVED:
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
            for label in ("finished_reason", "position"):
                if label in s.labels:
                    key = (s.name, label, s.labels[label])
                    out[key] = out.get(key, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def srv(models):
    target, draft = models.dirs("llama", "same")  # the draft is the target: greedy drafts are accepted
    with running_server(target, draft, max_model_len=128, max_batch_size=4, pool_size=8,
                        num_speculative_tokens=K, served_model_name=SERVED) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _complete(srv, client, count: int, seed: int, max_tokens: int = 12):
    rng = random.Random(seed)
    prompts = [[rng.randrange(8, 300) for _ in range(rng.randrange(3, 10))] for _ in range(count)]
    r = client.completions.create(model=srv.model_name, prompt=prompts, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert srv.wait_idle()
    return prompts, r


# ------------------------------------------------------------------------------------------ server


def test_every_vllm_family_is_exported_with_the_served_model_name(srv, client):
    assert set(VLLM_METRIC_NAMES) == set(VLLM_TYPES)
    _complete(srv, client, 2, seed=1)  # so that every labelled family has series
    fams = families(srv.base_url)
    assert set(fams) == set(METRIC_NAMES)
    for name, kind in VLLM_TYPES.items():
        fam = fams.get(name)
        assert fam is not None, f"{name} is not exported"
        assert fam.type == kind, f"{name} is a {fam.type}, vLLM's is a {kind}"
        assert fam.samples, f"{name} has no series"
        for s in fam.samples:
            assert {k: s.labels.get(k) for k in VLLM_LABELS} == VLLM_LABELS, f"{s.name} {s.labels}"
    names = {s.name for fam in fams.values() for s in fam.samples}
    assert not [n for n in VLLM_DASHBOARD_SAMPLES if n not in names]
    assert {s.labels["finished_reason"] for s in fams["vllm:request_success_total"].samples} >= {
        "stop", "length", "abort"}
    positions = {s.labels["position"] for s in fams["vllm:spec_decode_num_accepted_tokens_per_pos_total"].samples}
    assert positions == {str(i) for i in range(K)}


def test_vllm_counters_and_histograms_move_with_traffic(srv, client):
    assert srv.wait_idle()
    before = totals(srv.base_url)
    prompts, r = _complete(srv, client, 3, seed=2, max_tokens=12)
    after = totals(srv.base_url)

    def moved(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    n = len(prompts)
    prompt_tokens, completion_tokens = sum(map(len, prompts)), r.usage.completion_tokens
    assert completion_tokens == 12 * n
    assert moved("vllm:prompt_tokens_total") == prompt_tokens
    assert moved("vllm:generation_tokens_total") == completion_tokens
    assert moved(("vllm:request_success_total", "finished_reason", "length")) == n
    assert moved("vllm:request_success_total") == n
    assert moved("vllm:iteration_tokens_total_sum") == prompt_tokens + completion_tokens
    assert moved("vllm:iteration_tokens_total_count") >= 2  # a prefill step and decode steps
    assert moved("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert moved("vllm:request_generation_tokens_sum") == completion_tokens
    for family in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                   "request_prompt_tokens", "request_generation_tokens", "request_prefill_time_seconds",
                   "request_decode_time_seconds", "request_inference_time_seconds",
                   "request_time_per_output_token_seconds"):
        assert moved(f"vllm:{family}_count") == n, family
    # vLLM observes the inter-token latency once per step that brought a request tokens, not per token
    steps_with_tokens = moved("vllm:inter_token_latency_seconds_count")
    assert n <= steps_with_tokens <= completion_tokens - n
    assert moved("vllm:time_per_output_token_seconds_count") == steps_with_tokens
    assert moved("exspec_inter_token_latency_seconds_count") == completion_tokens - n
    assert moved("vllm:e2e_request_latency_seconds_sum") >= moved("vllm:request_decode_time_seconds_sum") > 0
    # speculative decoding, as `vllm bench serve` and vLLM's dashboard compute it
    drafts = moved("vllm:spec_decode_num_drafts_total")
    draft_tokens = moved("vllm:spec_decode_num_draft_tokens_total")
    accepted = moved("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [moved(("vllm:spec_decode_num_accepted_tokens_per_pos_total", "position", str(i))) for i in range(K)]
    assert drafts > 0 and drafts <= draft_tokens <= K * drafts
    assert 0 < accepted <= draft_tokens  # the draft is the target: its greedy drafts are accepted
    assert sum(per_pos) == accepted
    assert drafts >= per_pos[0] and all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepted as a prefix
    for vllm_name, own in TWINS.items():
        assert moved(vllm_name) == pytest.approx(moved(own)), vllm_name
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == after["exspec_kv_cache_usage_perc"] == 0
    assert after["vllm:num_preemptions_total"] == after["exspec_num_preemptions_total"] == 0  # blocks to spare


def test_vllm_bench_serve_reads_the_spec_decode_counters(srv, client):
    """`vllm bench serve` sums the values of every line starting with `vllm:spec_decode` whose text holds
    `num_drafts`, `num_draft_tokens`, ... (vllm/benchmarks/serve.py, fetch_spec_decode_metrics): stray
    series such as prometheus-client's `*_created` would be added in. Its line sums must be the counters."""
    _complete(srv, client, 1, seed=3)
    text = httpx.get(srv.base_url + "/metrics").text
    line_sums = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_pos": 0.0}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode"):
            continue
        value = float(line.split()[-1])
        if "num_drafts" in line:
            line_sums["num_drafts"] += value
        elif "num_draft_tokens" in line:
            line_sums["num_draft_tokens"] += value
        elif "num_accepted_tokens_per_pos" in line:
            line_sums["per_pos"] += value
        elif "num_accepted_tokens" in line:
            line_sums["num_accepted_tokens"] += value
    counters = totals(srv.base_url)
    assert "_created" not in text
    assert line_sums == {
        "num_drafts": counters["vllm:spec_decode_num_drafts_total"],
        "num_draft_tokens": counters["vllm:spec_decode_num_draft_tokens_total"],
        "num_accepted_tokens": counters["vllm:spec_decode_num_accepted_tokens_total"],
        "per_pos": counters["vllm:spec_decode_num_accepted_tokens_per_pos_total"],
    }
    assert line_sums["num_drafts"] > 0 and 1 < 1 + line_sums["num_accepted_tokens"] / line_sums["num_drafts"] <= K + 1


# ------------------------------------------------------------------------------------------ no model


def _samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _step(**fields) -> StepStats:
    base = dict(kind="grouped", batch_size=4, num_draft_tokens=3, num_proposed_tokens=9, num_drafts=3,
                accepted_per_position=(3, 2, 0), num_tokens=9, num_prompt_tokens=0, schedule_s=0.001,
                draft_s=0.002, verify_s=0.003)
    return StepStats(**{**base, **fields})


def test_one_step_moves_both_families_alike():
    m = ServerMetrics(model_name="m")
    m.observe_step(_step(kind="prefill", batch_size=2, num_draft_tokens=0, num_proposed_tokens=0, num_drafts=0,
                         accepted_per_position=(), num_tokens=2, num_prompt_tokens=11))
    m.observe_step(_step(num_preemptions=2))  # 4 rows, k = 3, one row opted out: 3 drafts of 3 tokens
    s = _samples(m)
    v = (("engine", "0"), ("model_name", "m"))
    assert s[("vllm:spec_decode_num_drafts_total", v)] == s[("exspec_spec_decode_num_drafts_total", ())] == 3
    assert s[("vllm:spec_decode_num_draft_tokens_total", v)] == 9
    assert s[("vllm:spec_decode_num_accepted_tokens_total", v)] == 5
    for pos, count in enumerate((3, 2, 0)):
        labels = tuple(sorted(v + (("position", str(pos)),)))
        assert s[("vllm:spec_decode_num_accepted_tokens_per_pos_total", labels)] == count
    assert s[("vllm:prompt_tokens_total", v)] == s[("exspec_prompt_tokens_total", ())] == 11
    assert s[("vllm:generation_tokens_total", v)] == s[("exspec_generation_tokens_total", ())] == 11
    assert s[("vllm:iteration_tokens_total_count", v)] == 2 and s[("vllm:iteration_tokens_total_sum", v)] == 22
    assert s[("vllm:num_preemptions_total", v)] == s[("exspec_num_preemptions_total", ())] == 2


def test_a_fused_prefill_counts_its_drafts_but_is_no_decode_step():
    """A prefill step whose forward verified drafts (the engine's fused prefill): its drafts and accepted tokens are
    in the spec-decode counters, as a decode step's are; the batch-size and acceptance-length histograms stay per
    decode step."""
    m = ServerMetrics(model_name="m")
    m.observe_step(_step(kind="prefill", batch_size=2, num_draft_tokens=3, num_proposed_tokens=6, num_drafts=2,
                         accepted_per_position=(2, 1, 1), num_tokens=6, num_prompt_tokens=40))
    s = _samples(m)
    v = (("engine", "0"), ("model_name", "m"))
    assert s[("vllm:spec_decode_num_drafts_total", v)] == s[("exspec_spec_decode_num_drafts_total", ())] == 2
    assert s[("exspec_spec_decode_num_draft_tokens_total", ())] == 6
    assert s[("vllm:spec_decode_num_accepted_tokens_total", v)] == 4
    assert s[("exspec_spec_decode_num_accepted_tokens_per_pos_total", (("position", "2"),))] == 1
    assert s[("exspec_acceptance_length_count", ())] == 0 and s[("exspec_batch_size_count", ())] == 0


def _delta(n: int, finished: bool = False, done: int = 0, queue: float | None = None) -> RequestOutput:
    return RequestOutput(request_id="r", token_ids=tuple(range(n)), text="", finished=finished,
                         finish_reason="length" if finished else None, prompt_tokens=5, completion_tokens=done,
                         queue_time_s=queue)


def test_request_timer_counts_per_step_for_vllm_and_per_token_for_exspec():
    m = ServerMetrics(model_name="m")
    timer = m.request_timer(arrival=0.0)  # an arrival long ago: every interval is positive
    timer.observe(_delta(1, done=1, queue=0.5))  # the prefill step's token
    timer.observe(_delta(3, done=4))  # a speculative step: 2 accepted + 1
    timer.observe(_delta(2, finished=True, done=6))
    s = _samples(m)
    v = (("engine", "0"), ("model_name", "m"))
    assert s[("vllm:inter_token_latency_seconds_count", v)] == 2  # two steps after the first token
    assert s[("vllm:time_per_output_token_seconds_count", v)] == 2
    assert s[("exspec_inter_token_latency_seconds_count", ())] == 5  # five tokens after the first
    assert s[("vllm:request_time_per_output_token_seconds_count", v)] == 1
    assert s[("vllm:request_queue_time_seconds_sum", v)] == s[("exspec_request_queue_time_seconds_sum", ())] == 0.5
    assert s[("vllm:request_generation_tokens_sum", v)] == 6 and s[("vllm:request_prompt_tokens_sum", v)] == 5
    success = tuple(sorted(v + (("finished_reason", "length"),)))
    assert s[("vllm:request_success_total", success)] == 1
    prefill, decode, inference, e2e = (s[(f"vllm:{name}_sum", v)] for name in (
        "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
        "e2e_request_latency_seconds"))
    assert inference == pytest.approx(prefill + decode) and e2e == pytest.approx(0.5 + inference)


def test_a_request_finished_before_its_first_token_has_no_phases():
    m = ServerMetrics(model_name="m")
    m.request_timer(arrival=0.0).observe(RequestOutput(
        request_id="r", token_ids=(), text="", finished=True, finish_reason="abort", prompt_tokens=5,
        completion_tokens=0))
    s = _samples(m)
    v = (("engine", "0"), ("model_name", "m"))
    assert s[("vllm:e2e_request_latency_seconds_count", v)] == 1
    assert s[("vllm:request_success_total", tuple(sorted(v + (("finished_reason", "abort"),))))] == 1
    for family in ("prefill", "decode", "inference"):
        assert s[(f"vllm:request_{family}_time_seconds_count", v)] == 0
    assert s[("vllm:time_to_first_token_seconds_count", v)] == 0
