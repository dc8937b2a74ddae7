"""The one-file claim for attention backends (docs/ARCHITECTURE.md, "Adding an attention backend"): a backend
defined in this test module, registered by name, is accepted by EngineConfig, built by the runner from the
registry and gives the target's own greedy output; the built-in backends are one file each, listed without
importing them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.engine import test_attention_backends
from tests.engine.test_engine_equivalence import MIXED, MIXED_MAX, assert_matches_reference
from tests.support.driver import run_to_end

from exspec.engine import EngineConfig, SamplingParams, backends
from exspec.engine.backends import AttentionBackend, register
from exspec.engine.kv_cache import ForwardMeta, gather_kv
from exspec.errors import ConfigError
from exspec.registry import listed


class DenseBackend(AttentionBackend):  # as it would stand in engine/backends/dense.py
    """gathers each row's blocks, then one masked SDPA"""

    def forward(self, query, k_cache, v_cache, plan: ForwardMeta, scale):
        keys = gather_kv(k_cache, plan)  # [B, kv_heads, kv_len, head_dim]
        values = gather_kv(v_cache, plan)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=plan.mask[..., : plan.kv_len], scale=scale, enable_gqa=True
        )  # [B, heads, Q, head_dim]
        return out.transpose(1, 2)  # [B, Q, heads, head_dim]


@pytest.fixture
def dense():
    register("dense")(DenseBackend)  # the line the backend's file holds as its decorator
    yield "dense"
    backends.BACKENDS.unregister("dense")


def test_the_builtin_backends_are_one_file_each():
    assert listed("exspec.engine.backends") == tuple(sorted(backends.names()))  # the CLI's list
    for name, cls in backends.BACKENDS.items():
        assert cls.__module__ == f"exspec.engine.backends.{name}"


@pytest.mark.parametrize("q_len, window", [(1, None), (3, None), (4, 6)])
@pytest.mark.parametrize("layout", list(test_attention_backends.LAYOUTS))
def test_a_registered_backend_matches_sdpa_over_dense_kv(dense, q_len, window, layout):
    test_attention_backends.test_backend_forward_matches_sdpa_over_dense_kv(dense, q_len, window, layout)


def test_a_registered_backend_runs_in_the_engine(models, dense):
    engine = models.engine("llama", "noisy", attention=dense)
    assert engine.target.attention == engine.draft.attention == dense
    params = [SamplingParams(max_tokens=m) for m in MIXED_MAX[:6]]
    seqs, outs = run_to_end(engine, MIXED[:6], params, 3)
    assert_matches_reference(models, "llama", MIXED[:6], seqs, MIXED_MAX[:6])
    assert outs[1].kind == "mixed"
    backends.BACKENDS.unregister("dense")
    with pytest.raises(ConfigError, match="attention must be auto or one of"):
        EngineConfig(model=Path("t"), attention="dense")
