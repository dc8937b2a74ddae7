"""oneDNN-prepacked linears (engine/packed_linear.py): same numbers as `F.linear` up to float rounding, the
same parameters (tied embeddings stay tied), repacked when a weight changes in place, off on request."""

from __future__ import annotations

import copy

import pytest
import torch

from exspec.engine.packed_linear import PackedLinear, gemm_mode, prepack_linears
from exspec.errors import ExspecError


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (5, 64), (3, 4, 64), (1, 1, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_linear(shape, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=bias)
    packed = PackedLinear(lin)
    x = torch.randn(shape)
    with torch.inference_mode():
        out = packed(x)
    assert out.shape == (*shape[:-1], 48)
    torch.testing.assert_close(out, lin(x).detach(), rtol=1e-5, atol=1e-5)


def test_in_place_weight_change_repacks_and_copies_repack():
    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(32, 16))
    x = torch.randn(4, 32)
    packed(x)  # packs
    twin = copy.deepcopy(packed)
    with torch.no_grad():
        twin.weight.mul_(2.0)
    torch.testing.assert_close(twin(x), torch.nn.functional.linear(x, twin.weight, twin.bias))
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, packed.weight, packed.bias))  # untouched


def test_prepack_keeps_parameters_and_ties():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    before = {id(p) for p in model.parameters()}
    assert prepack_linears(model) == 1
    assert isinstance(model[1], PackedLinear) and model[1].weight is model[0].weight
    assert {id(p) for p in model.parameters()} == before
    assert prepack_linears(model) == 0  # idempotent


def test_gemm_mode():
    model = torch.nn.Linear(4, 4)
    assert gemm_mode(model, "default") == "default" and prepack_linears(model, "default") == 0
    with pytest.raises(ExspecError, match="gemm must be one of"):
        gemm_mode(model, "fast")
    assert gemm_mode(model) == "packed"
    assert gemm_mode(model.to(torch.bfloat16)) == "default"  # packing only for float32


@pytest.mark.parametrize("one_row_min", [1, 10**9])  # every weight "large" / none
def test_one_row_forward_takes_the_prepacked_weight_only_for_large_weights(monkeypatch, one_row_min):
    import exspec.engine.packed_linear as pl

    monkeypatch.setattr(pl, "ONE_ROW_PACKED_MIN_ELEMENTS", one_row_min)
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    packed = PackedLinear(lin)
    x = torch.randn(1, 1, 64)
    with torch.inference_mode():
        out = packed(x)
    torch.testing.assert_close(out, lin(x).detach(), rtol=1e-5, atol=1e-5)
    assert (packed._packed.tensor is not None) == (one_row_min == 1)  # a small weight's one row: sgemm, never packed
    with torch.inference_mode():
        packed(torch.randn(3, 64))  # several rows: always the prepacked weight
    assert packed._packed.tensor is not None
