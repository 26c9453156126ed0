"""The LM head in int8 for oneDNN's int8 GEMM: 8-bit corrections of sparse dropout heads that drop many columns
(dropmatch.heads.int8_gemm)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dropmatch.heads import dropout
from dropmatch.heads.byte_columns import BYTE_ROWWISE, byte_bags_supported
from dropmatch.heads.dropout import DropoutHead
from dropmatch.heads.int8_gemm import (
    int8_gemm_supported,
    int8_product_bounds,
    int8_products,
    shared_int8_weight,
)

needs_int8_gemm = pytest.mark.skipif(not int8_gemm_supported(), reason="needs oneDNN's int8 GEMM (AMX / AVX512-VNNI)")


def _weight(vocab: int, d: int, seed: int, on_grid: bool = False) -> torch.Tensor:
    """A random weight; ``on_grid``: integers within +-127 with 127 in every row and column (times 2^-7), which
    int8 holds exactly, so the products err by the input's residual and roundings alone."""
    g = torch.Generator().manual_seed(seed)
    if on_grid:
        weight = torch.randint(-126, 127, (vocab, d), generator=g).float()
        weight[:, 0] = 127.0
        weight[0, :] = 127.0
        return weight / 128
    weight = torch.randn(vocab, d, generator=g) * 0.3
    weight[3, 5] = 4.0  # an outlier: its row and its column get coarse steps
    weight[:, 7] *= 20  # a wide column, as the embedded pair's hidden dimensions differ in range
    return weight


def _rows(d: int, seed: int) -> torch.Tensor:
    """Inputs with few and many nonzero entries, an outlier, a single entry and a zero row: (6, d)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, d, generator=g) * 3
    x[0] *= torch.rand(d, generator=g) < 0.05
    x[1, 9] = 60.0
    x[2] = 0.0
    x[2, 11] = 1.7
    x[3] = 0.0
    return x


@needs_int8_gemm
@pytest.mark.parametrize("vocab,d,on_grid", [(700, 48, False), (333, 640, False), (500, 64, True)],
                         ids=["small", "embedded-width", "int8-exact-weight"])
def test_int8_products_hold_their_bound_and_it_is_tight(vocab, d, on_grid):
    """Every product is within its row's bound of the float64 product, a zero row gives exact zeros with a zero
    bound, and the bound, measured rather than assumed, is nearly reached by a row with one entry (its error is
    that column's largest quantization error, up to the bound / 1.05). A weight int8 holds exactly errs by the
    input's two-level residual alone, which the bound must carry."""
    for seed in range(4):
        weight = _weight(vocab, d, seed, on_grid)
        x = _rows(d, seed)
        held = shared_int8_weight(weight)
        products = int8_products(held, x, scale=1.0 / 0.7)
        bounds = int8_product_bounds(held, x) / 0.7
        exact = F.linear(x.double(), weight.double()) / 0.7
        errors = (products.double() - exact).abs().amax(-1)
        assert products.dtype == torch.float32 and products.shape == (6, vocab)
        assert bool((errors <= bounds).all()), (seed, errors, bounds)
        assert bool((products[3] == 0).all()) and float(bounds[3]) == 0.0
        if on_grid:
            assert float(errors.max()) > 0  # the residual shows
        else:
            assert float(errors[2] / bounds[2]) > 0.5, seed


@needs_int8_gemm
def test_the_bound_needs_the_measured_quantization_error():
    """Negative control: without the measured weight error (the input's residual and the float32 roundings alone)
    the bound fails, so the test above could fail."""
    weight, x = _weight(700, 48, 0), _rows(48, 0)
    held = shared_int8_weight(weight)
    blind = dataclasses.replace(held, error=torch.zeros_like(held.error))
    errors = (int8_products(held, x).double() - F.linear(x.double(), weight.double())).abs().amax(-1)
    assert bool((errors > int8_product_bounds(blind, x)).any())


@needs_int8_gemm
@pytest.mark.skipif(not byte_bags_supported(), reason="8-bit corrections need fbgemm (x86)")
def test_heads_take_the_int8_gemm_past_the_crossover_and_agree_with_the_bags(monkeypatch):
    """8-bit corrections are bags while K p_drop is below INT8_GEMM_MIN_DROPPED and one int8 GEMM from there;
    both paths give every head within its own bound of the float64 heads."""
    weight = _weight(900, 64, 1)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * 3
    clean = F.linear(hidden, weight)
    logits, exact = {}, None
    for by_gemm, threshold in ((False, 1e9), (True, 0.0)):
        monkeypatch.setattr(dropout, "INT8_GEMM_MIN_DROPPED", threshold)
        head = DropoutHead(weight, k=5, p_drop=0.3, compute_dtype=torch.float32, sparse=True, sparse_dtype=BYTE_ROWWISE)
        assert head.corrections_by_gemm is by_gemm
        masks = head.draw_masks(3, torch.Generator().manual_seed(3))
        logits[by_gemm] = head.logits(hidden, clean, masks, sparse_dtype=BYTE_ROWWISE)
        bounds = head.error_scale(False) * head.product_bounds(hidden, masks, clean, logits[by_gemm], fused=False,
                                                              read_outputs=False, sparse_dtype=BYTE_ROWWISE)
        exact = F.linear(hidden.double().unsqueeze(1) * masks / 0.7, weight.double())
        assert bool(((logits[by_gemm].double() - exact).abs().amax(-1) <= bounds + 1e-5).all()), by_gemm
    assert not torch.equal(logits[True], logits[False])  # two computations, not one path twice
    monkeypatch.setattr(dropout, "int8_gemm_supported", lambda: False)  # a CPU without exact int8 sums: bags
    assert not DropoutHead(weight, k=5, p_drop=0.3, compute_dtype=torch.float32, sparse=True,
                           sparse_dtype=BYTE_ROWWISE).corrections_by_gemm
