"""Few-row linears (oneDNN, or the native kernel where preferred): the values of F.linear, only where they apply,
and copies of their own."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dropmatch import kernels, onednn_linear
from dropmatch.onednn_linear import (
    MAX_ROWS,
    NATIVE_MAX_ROWS,
    FewRowLinear,
    PackedForward,
    WeightWatch,
    bf16_matmul_supported,
    onednn_linear_supported,
    pack_linears,
    shared_few_row_linear,
    unpack_linears,
)

pytestmark = pytest.mark.skipif(not onednn_linear_supported(), reason="this torch has no oneDNN linear ops")


def _calls(monkeypatch) -> list[int]:
    """The rows of each oneDNN call from here on (the native kernel is kept out: these tests are oneDNN's)."""
    monkeypatch.setattr(onednn_linear, "native_few_rows_preferred", lambda: False)
    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.append(x.numel() // x.shape[-1])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return seen


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_on_few_rows_and_leaves_the_rest_to_it(bias, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=bias), nn.GELU(), nn.Linear(96, 32, bias=bias))
    want = {n: torch.randn(1, n, 64) for n in (1, 6, MAX_ROWS + 1)}
    expected = {n: model(x) for n, x in want.items()}
    assert pack_linears(model) == 2 and pack_linears(model) == 2  # idempotent
    seen = _calls(monkeypatch)
    with torch.inference_mode():
        for n, x in want.items():
            torch.testing.assert_close(model(x), expected[n], rtol=1e-5, atol=1e-5)
    assert seen == [1, 1, 6, 6]  # prefill-sized inputs (MAX_ROWS + 1 rows) stayed on F.linear
    with torch.enable_grad():
        x = torch.randn(2, 64, requires_grad=True)
        model(x).sum().backward()  # autograd takes torch's path
    assert x.grad is not None and seen == [1, 1, 6, 6]
    unpack_linears(model)
    assert not any(isinstance(getattr(m, "forward", None), PackedForward) for m in model.modules())


@pytest.mark.skipif(not bf16_matmul_supported(), reason="no native bfloat16 GEMMs on this CPU")
def test_bfloat16_linears_are_packed_where_the_cpu_runs_them_natively(monkeypatch):
    """A bfloat16 module (e.g. an EAGLE-3 head drafting in bfloat16) takes oneDNN's prepacked kernel on
    few rows, with F.linear's bfloat16 values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32)).to(torch.bfloat16)
    x = torch.randn(1, 6, 64, dtype=torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == 2
    seen = _calls(monkeypatch)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected)
    assert seen == [6, 6]


def test_a_copied_model_packs_its_own_weights():
    model = nn.Sequential(nn.Linear(16, 8))
    pack_linears(model)
    with torch.inference_mode():
        model(torch.randn(3, 16))  # packs the original
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone[0].weight.mul_(2)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        torch.testing.assert_close(clone(x), F.linear(x, clone[0].weight, clone[0].bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)


def test_dropout_heads_on_one_weight_share_its_reordered_copy():
    from dropmatch.heads.dropout import DropoutHead

    w, other = torch.randn(300, 64), torch.randn(300, 64)
    a, b = DropoutHead(w, k=5, p_drop=0.03), DropoutHead(w[:300], k=3, p_drop=0.3)  # the same memory, a new view
    assert a._exact_linear is b._exact_linear
    assert DropoutHead(w[:200], k=5, p_drop=0.03)._exact_linear is not a._exact_linear
    assert DropoutHead(other, k=5, p_drop=0.03)._exact_linear is not a._exact_linear
    x = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.allclose(a._exact_linear(x), x @ w.T, atol=1e-4)


@pytest.mark.skipif(not bf16_matmul_supported(), reason="this CPU has no native bfloat16 GEMMs")
def test_bfloat16_weight_takes_onednn_with_bfloat16_rounding_only(monkeypatch):
    """A bfloat16 weight (the dense dropout heads' perturbation GEMM) goes through oneDNN on few
    bfloat16 rows; its outputs are the exact product of the bfloat16 operands up to bfloat16 output
    rounding (2^-8 relative) and float32 accumulation."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 640, generator=g).to(torch.bfloat16)
    x = torch.randn(5, 640, generator=g).to(torch.bfloat16)
    kernel = shared_few_row_linear(weight)
    seen = _calls(monkeypatch)
    with torch.inference_mode():
        out = kernel(x)
        exact = x.double() @ weight.double().T
        assert out.dtype == torch.bfloat16 and seen == [5]
        err = (out.double() - exact).abs()
        assert bool((err <= 2.0**-8 * exact.abs() + 640 * 2.0**-23 * (x.double().abs() @ weight.double().abs().T)).all())


def test_packed_layers_follow_their_weights_after_they_change(monkeypatch):
    """A loaded checkpoint (in-place copy), a swapped ``.data`` and an assigned Parameter each reach the
    few-row path: no stale reordered copy answers for the old weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    pack_linears(model)
    x = torch.randn(1, 4, 32)
    seen = _calls(monkeypatch)

    def check():
        with torch.inference_mode():
            expected = F.linear(F.gelu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias)
            torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)

    check()  # packs
    model.load_state_dict(nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16)).state_dict())
    check()
    model[0].weight.data = torch.randn(48, 32)
    check()
    model[2].weight = nn.Parameter(torch.randn(16, 48))
    model[2].bias = nn.Parameter(torch.randn(16))
    check()
    assert seen == [4, 4] * 4  # every call stayed on oneDNN's path


def test_a_shared_kernel_repacks_a_weight_changed_in_place():
    weight = torch.randn(300, 64)
    kernel = shared_few_row_linear(weight[:200])
    x = torch.randn(3, 64)
    with torch.inference_mode():
        kernel(x)
        weight.mul_(-2)  # through the base tensor: the view's version moves with it
        torch.testing.assert_close(kernel(x), x @ weight[:200].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [72, 5])
def test_where_preferred_float32_few_rows_take_the_native_kernel_without_a_reordered_copy(bias, width, monkeypatch):
    """Up to NATIVE_MAX_ROWS float32 rows (batched, or columns of a transposed tensor): F.linear's values to
    float32 rounding, the native kernel's exactly, and no reordered copy of the weight; more rows: oneDNN,
    which reorders it then."""
    if not kernels.available():
        pytest.skip("the native kernels do not build here")
    monkeypatch.setattr(onednn_linear, "native_few_rows_preferred", lambda: True)
    g = torch.Generator().manual_seed(width)
    weight, b = torch.randn(300, width, generator=g), torch.randn(300, generator=g) if bias else None
    layer = FewRowLinear(weight, b)
    inputs = [torch.randn(1, width, generator=g), torch.randn(3, 3, width, generator=g),  # 9 rows, batched
              torch.randn(width, NATIVE_MAX_ROWS, generator=g).T]  # rows not contiguous
    with torch.inference_mode():
        for x in inputs:
            out = layer(x)
            assert out.shape == (*x.shape[:-1], 300) and layer.packed is None
            assert torch.equal(out.reshape(-1, 300), kernels.few_row_linear(x.reshape(-1, width), weight, b))
            torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        seen = _calls(monkeypatch)
        monkeypatch.setattr(onednn_linear, "native_few_rows_preferred", lambda: True)
        x = torch.randn(NATIVE_MAX_ROWS + 1, width, generator=g)
        torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        assert seen == [NATIVE_MAX_ROWS + 1] and layer.packed is not None


def test_weight_watch_sees_another_tensor_over_the_same_memory_and_in_place_writes():
    """An assigned Parameter may land at a freed weight's address with the same version: same stamp,
    another tensor, so the watch reports a change; so does an in-place write; looking again does not."""
    weight = torch.randn(4, 4)
    watch = WeightWatch(weight)
    assert not watch.changed(weight)
    alias = weight.detach()  # the same memory and version counter, another tensor
    assert watch.changed(alias) and not watch.changed(alias)
    with torch.no_grad():
        alias.mul_(2)
    assert watch.changed(alias) and not watch.changed(alias)
