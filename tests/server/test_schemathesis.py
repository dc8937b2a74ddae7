"""Property-based fuzzing of every route from the server's own /openapi.json (schemathesis, valid and
invalid bodies, loopback only): no request, however odd, gets a 5xx. Bounded: a fixed number of examples
per route, so the run stays well under a minute."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.support.server_fixtures import running_server
from tests.support.tiny_models import build_pair

EXAMPLES = 75  # per route and generation mode


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    target, draft = build_pair(tmp_path_factory.mktemp("fuzz-models"), "llama")
    # A short context keeps each generated request cheap; small limits make the fuzzer hit them.
    with running_server(target, draft, max_model_len=24, max_batch_size=4, pool_size=8, max_waiting=64,
                        num_speculative_tokens=2, max_n=2, max_prompts=2, max_stop=2, max_stop_token_ids=4) as s:
        yield s


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_gets_a_server_error(fuzz_server, mode):
    """Each route of /openapi.json, EXAMPLES generated requests (driven through hypothesis directly: the
    schemathesis pytest plugin does not load under this pytest)."""
    schema = schemathesis.openapi.from_url(fuzz_server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                               "/v1/models/{model_id}", "/health", "/metrics"}
    calls: list[int] = []
    errors: list[str] = []
    for op in operations:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:
            response = case.call(base_url=fuzz_server.base_url, timeout=60)
            calls.append(response.status_code)
            if response.status_code >= 500:
                errors.append(f"{op.method.upper()} {op.path} {case.body!r:.300} -> {response.status_code} "
                              f"{response.text[:300]}")

        try:
            run()
        except Unsatisfiable:  # a route with no parameters has no invalid input
            assert mode == GenerationMode.NEGATIVE and op.method.upper() == "GET", op.path
    print(f"{mode}: {len(calls)} requests, status codes {sorted(Counter(calls).items())}")
    assert not errors, "\n".join(errors[:10])
    assert len(calls) >= len(operations) * 5


def test_the_fuzzed_server_is_healthy_and_idle(fuzz_server):
    assert httpx.get(fuzz_server.base_url + "/health").status_code == 200
    assert fuzz_server.wait_idle(30)
    assert fuzz_server.engine.allocator.num_used == 0
