"""The native kernels against torch (head statistics, with their in-place subtraction; the 8-bit column sums,
against float64 and their error bound), and their fallbacks."""

from __future__ import annotations

import logging
import platform
import shutil
import sys

import pytest
import torch

from dropmatch import kernels
from dropmatch.cpuinfo import cpu_fields
from dropmatch.heads.byte_columns import (
    BYTE_ROWWISE,
    byte_bags_supported,
    byte_correction_bounds,
    shared_byte_blocks,
)
from dropmatch.heads.dropout import DropoutHead
from dropmatch.sampling import indices_at_least

BUILDS_HERE = sys.platform == "linux" and platform.machine() == "x86_64" and shutil.which("cc") is not None


@pytest.fixture
def native():
    """The kernels, which must build wherever a C compiler runs on x86-64 Linux (as on CI)."""
    if not BUILDS_HERE:
        pytest.skip("native kernels build on x86-64 Linux with a C compiler")
    assert kernels.available()


def torch_statistics(logits: torch.Tensor, draft: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    centroid = logits.sum(0) / logits.shape[0]
    sums = [logits.double().exp().sum(-1), centroid.double().exp().sum().reshape(1)]
    if draft is not None:
        sums.append(draft.double().exp().sum().reshape(1))
    return centroid, logits.amax(0), torch.cat(sums)


@pytest.mark.parametrize("k, vocab", [(5, 262144), (5, 3001), (1, 1000), (7, 3)])
@pytest.mark.parametrize("with_draft", [True, False])
def test_statistics_equal_torch_s(native, k, vocab, with_draft):
    g = torch.Generator().manual_seed(k * vocab)
    logits = 6 * torch.randn(k, vocab, generator=g)
    draft = 4 * torch.randn(vocab, generator=g) if with_draft else None
    stats = kernels.head_statistics(logits, draft)
    centroid, head_max, sums = torch_statistics(logits, draft)
    assert torch.equal(stats.head_max, head_max)
    torch.testing.assert_close(stats.centroid, centroid, rtol=0, atol=1e-6 * float(logits.abs().max()))
    assert stats.sums.dtype == torch.float64 and stats.sums.shape == sums.shape
    assert ((stats.sums - sums).abs() / sums).max() < 1e-6  # the decision allows 1e-5 (NORMALIZER_NOISE)


def test_each_exponential_is_within_its_bound(native):
    """The statistics' exponentials one at a time (a row of one finite logit, the rest -inf), through the vector
    loop (rows of 8) and the padded end of a block (rows of 1 and 3): within 1.5e-7 of e^x, relative, over the
    range where e^x is a normal float32 (the inline AVX2 + FMA exponential; elsewhere libmvec's expf, <= 4 ulp);
    0 at -inf and far below, inf above the range, NaN kept."""
    bound = 1.5e-7 if {"avx2", "fma"} <= set(cpu_fields().get("flags", "").split()) else 4 * 2.0**-23
    g = torch.Generator().manual_seed(0)
    x = torch.empty(1 << 18).uniform_(-87.3, 88.7, generator=g)
    x[:6] = torch.tensor([0.0, -1e-8, 0.34657, -0.34657, 88.72, -87.33])  # the reduction's edges and the range's
    exact = x.double().exp()
    for width in (8, 1, 3):
        rows = torch.full((x.numel(), width), float("-inf"))
        rows[:, 0] = x
        sums = kernels.head_statistics(rows).sums[: x.numel()]
        assert float(((sums - exact).abs() / exact).max()) <= bound
    special = torch.full((5, 8), float("-inf"))
    special[:, 0] = torch.tensor([float("nan"), float("inf"), 89.0, -104.5, float("-inf")])
    sums = kernels.head_statistics(special).sums[:5]
    assert torch.isnan(sums[0]) and sums[1] == sums[2] == float("inf") and sums[3] == sums[4] == 0


@pytest.mark.skipif(not byte_bags_supported(), reason="8-bit columns need fbgemm")
@pytest.mark.parametrize("vocab, block", [(70001, 32768), (3000, 1024), (700, 1024), (5000, 2048), (20000, 32768)])
@pytest.mark.parametrize("with_draft", [True, False])
def test_column_heads_are_the_column_sums_then_their_statistics(native, vocab, block, with_draft):
    """The heads and statistics taken in the column sums' pass: bit for bit the column sums, then
    head_statistics on them (the padded end of the last block left as the sums), for one block (of whole
    statistics tiles or not, narrower or wider than the kernel's tile), several, and a padded last one."""
    g = torch.Generator().manual_seed(vocab)
    d, k, keep = 40, 5, 1.0 - 0.1
    weight = 0.05 * torch.randn(vocab, d, generator=g)
    blocks = shared_byte_blocks(weight, block)
    weights, dropped = 20 * torch.randn(d, generator=g) / keep, torch.rand(k, d, generator=g) < 0.1
    clean, draft = 8 * torch.randn(vocab, generator=g), (4 * torch.randn(vocab, generator=g) if with_draft else None)
    heads, stats = kernels.byte_column_heads(blocks.packed, blocks.width, weights, dropped, clean, keep, draft)
    sums = kernels.byte_column_sums(blocks.packed, blocks.width, weights, dropped)
    expected = kernels.head_statistics(sums[:, :vocab], draft, clean, keep)  # sums become the heads in place
    assert torch.equal(heads, sums)
    assert torch.equal(stats.centroid, expected.centroid) and torch.equal(stats.head_max, expected.head_max)
    assert torch.equal(stats.sums, expected.sums)


def test_column_heads_refuse_what_they_do_not_take(native):
    blocks = shared_byte_blocks(torch.randn(3000, 8), 1000)  # three blocks of 1000: not whole statistics tiles
    dropped, weights, clean = torch.rand(5, 8) < 0.3, torch.randn(8), torch.randn(3000)
    assert kernels.byte_column_heads(blocks.packed, blocks.width, weights, dropped, clean, 0.9) is None
    blocks = shared_byte_blocks(torch.randn(3000, 8), 1024)
    assert kernels.byte_column_heads(blocks.packed, blocks.width, weights, dropped, clean, 0.9) is not None
    assert kernels.byte_column_heads(blocks.packed, blocks.width, weights, dropped, clean.double(), 0.9) is None
    assert kernels.byte_column_heads(blocks.packed, blocks.width, weights, dropped, clean, 0.9, clean[:-1]) is None
    assert kernels.byte_column_heads(blocks.packed, blocks.width, weights, dropped, torch.randn(4000), 0.9) is None


def test_kept_tokens_are_torchs(native):
    """The tokens where the heads' maximum or the shifted draft reaches a threshold: torch's float32 comparison bit
    for bit (values on the threshold, a shift and a threshold that round in float32, NaN on either side), without
    a draft too; past the capacity, its first capacity + 1 tokens."""
    g = torch.Generator().manual_seed(3)
    vocab, shift, threshold = 5003, -3.3000000001, -7.1000000001  # 8 tokens a vector, then 3
    head_max, draft = 4 * torch.randn(vocab, generator=g) - 8, 4 * torch.randn(vocab, generator=g) - 4
    head_max[:3] = torch.tensor(threshold, dtype=torch.float64).float()  # on the threshold as float32 rounds it
    draft[3:6] = torch.tensor(threshold - shift).float()
    for nan, other in ((6, 7), (vocab - 2, vocab - 1)):  # a NaN beside a value far above the threshold, either side
        head_max[nan], draft[nan], head_max[other], draft[other] = float("nan"), 100.0, 100.0, float("nan")
    expected = indices_at_least(torch.maximum(head_max, draft + shift), threshold)
    assert 100 < expected.numel() < vocab and torch.equal(kernels.kept_tokens(head_max, draft, shift, threshold, vocab),
                                                          expected)
    assert torch.equal(kernels.kept_tokens(head_max, None, shift, threshold, vocab), indices_at_least(head_max, threshold))
    assert torch.equal(kernels.kept_tokens(head_max, draft, shift, threshold, 10), expected[:11])
    assert kernels.kept_tokens(head_max, draft.double(), shift, threshold, vocab) is None
    assert kernels.kept_tokens(head_max, draft[1:], shift, threshold, vocab) is None


def test_corrections_become_the_heads_in_place_as_torch_computes_them(native):
    """With the clean logits, rows of corrections (here a slice of wider rows, as padded vocabulary blocks
    give) become clean / keep - corrections bit for bit, and the statistics are those of the heads."""
    g = torch.Generator().manual_seed(0)
    vocab, keep = 5000, 1.0 - 0.032
    clean = 8 * torch.randn(vocab, generator=g)
    padded = torch.randn(5, 5120, generator=g)
    corrections = padded[:, :vocab]
    heads = clean / keep - corrections
    stats = kernels.head_statistics(corrections, clean=clean, keep=keep)
    assert torch.equal(padded[:, :vocab], heads)
    assert torch.equal(stats.head_max, heads.amax(0))
    assert ((stats.sums - torch_statistics(heads, None)[2]).abs() / stats.sums).max() < 1e-6


@pytest.mark.skipif(not byte_bags_supported(), reason="8-bit columns need fbgemm")
def test_sparse_heads_come_with_their_statistics(native):
    """The sparse 8-bit heads of one position: the same logits as without statistics, and statistics of them."""
    g = torch.Generator().manual_seed(1)
    weight, hidden = torch.randn(3000, 32, generator=g), 3 * torch.randn(1, 32, generator=g)
    head = DropoutHead(weight, k=5, p_drop=0.06, compute_dtype=torch.float32, sparse=True, sparse_dtype=BYTE_ROWWISE,
                       vocab_block=1024)  # three blocks and a padded one
    masks = head.draw_masks(1, torch.Generator().manual_seed(2))
    clean, draft = weight @ hidden[0], torch.randn(3000, generator=g)
    logits, stats = head.summarized_logits(hidden, clean.unsqueeze(0), masks, BYTE_ROWWISE, draft)
    assert torch.equal(logits, head.logits(hidden, clean.unsqueeze(0), masks, sparse_dtype=BYTE_ROWWISE))
    centroid, head_max, sums = torch_statistics(logits[0], draft)
    assert torch.equal(stats.head_max, head_max)
    torch.testing.assert_close(stats.centroid, centroid, rtol=0, atol=1e-6 * float(logits.abs().max()))
    assert ((stats.sums - sums).abs() / sums).max() < 1e-6
    rows = DropoutHead(weight, k=5, p_drop=0.06, exact_rows=True, rows_dtype=torch.float32)
    assert rows.summarized_logits(hidden, clean.unsqueeze(0), masks)[1] is None  # the rows path computes none


def nan_outputs(monkeypatch) -> None:
    """Make ``torch.empty`` return NaN-filled tensors (a kernel's output it leaves unwritten then shows)."""
    full = torch.full
    monkeypatch.setattr(torch, "empty", lambda *size, **kwargs: full(size, float("nan"), **kwargs))


def dequantized_sums(blocks, weights: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """sum_{j in D_k} w_j (scale q + offset)_j over every block, in float64: (K, n_blocks * width)."""
    d, width = weights.numel(), blocks.width
    rows = blocks.packed.view(-1, d, width + 8)  # (n_blocks, d, width + 8)
    scale, offset = (rows[..., width + 4 * i : width + 4 * i + 4].contiguous().view(torch.float32).double()
                     for i in (0, 1))
    columns = rows[..., :width].double() * scale + offset  # (n_blocks, d, width)
    coef = dropped.double() * weights.double()  # (K, d)
    return torch.einsum("kd,bdw->kbw", coef, columns).reshape(dropped.shape[0], -1)


@pytest.mark.skipif(not byte_bags_supported(), reason="8-bit columns need fbgemm")
@pytest.mark.parametrize("k, p_drop, vocab, block", [(5, 0.032, 70001, 32768), (5, 0.3, 20000, 4096),
                                                     (3, 0.9, 3000, 1001), (1, 0.5, 513, 512), (8, 0.3, 5000, 2048)])
def test_column_sums_stay_within_the_bags_bound(native, monkeypatch, k, p_drop, vocab, block):
    """The grouped 8-bit column sums (a column that several heads drop read once) against their float64 value:
    within the bound derived for fbgemm's bags, which the kernel's rounding must stay inside, at every token,
    the zero-padded end of the last block included, and summing what fbgemm's bags sum."""
    g = torch.Generator().manual_seed(k * vocab)
    d = 48
    weight = 0.05 * torch.randn(vocab, d, generator=g)
    blocks = shared_byte_blocks(weight, block)
    hidden = 30 * torch.randn(1, d, generator=g)
    dropped = torch.rand(1, k, d, generator=g) < p_drop
    dropped[0, 0, :3] = True  # head 0 drops a column no other head drops, and one all heads drop
    dropped[:, :, 5] = True
    weights = hidden[0] / (1.0 - p_drop)
    with monkeypatch.context() as patch:  # every entry of the output must be written
        nan_outputs(patch)
        sums = kernels.byte_column_sums(blocks.packed, blocks.width, weights, dropped[0])
    # against the float32 weight's products (what the bound is for), and against the dequantized columns' (the
    # rounding alone, which the bound's term for it must hold: 1.05 (|D| + 6) 2^-23 sum_j |w_j| magnitude_j)
    products = (dropped[0].double() * weights.double()) @ weight.double().T  # (K, vocab)
    bound = byte_correction_bounds(blocks, hidden, dropped)[0] / (1.0 - p_drop)  # (K,)
    assert bool(((sums[:, :vocab].double() - products).abs().amax(-1) <= bound).all())
    exact = dequantized_sums(blocks, weights, dropped[0])
    rounding = 1.05 * (dropped[0].sum(-1) + 6) * 2.0**-23 * ((dropped[0] * weights.abs()) @ blocks.magnitude)
    error = (sums.double() - exact).abs().amax(-1)
    assert sums.shape == exact.shape and bool((error <= rounding).all()), (error, rounding)
    assert float(exact.abs().amax()) > 1e4 * float(rounding.max())  # that term is not vacuous here
    head = DropoutHead(weight, k=k, p_drop=p_drop, compute_dtype=torch.float32, sparse=True, sparse_dtype=BYTE_ROWWISE,
                       vocab_block=block)
    assert torch.equal(head._bag_sums(hidden, dropped, BYTE_ROWWISE)[0], sums)  # the sparse heads take these sums
    monkeypatch.setattr(kernels, "_library", lambda: None)  # without the kernels: fbgemm's bags, one a head and block
    with_bags = head._bag_sums(hidden, dropped, BYTE_ROWWISE)[0]
    assert bool(((with_bags.double() - exact).abs().amax(-1) <= rounding).all())


def test_column_sums_refuse_what_they_do_not_take(native, monkeypatch):
    blocks = shared_byte_blocks(torch.randn(100, 8), 64)
    dropped = torch.zeros(5, 8, dtype=torch.bool)
    assert kernels.byte_column_sums(blocks.packed, blocks.width, torch.randn(8).double(), dropped) is None
    assert kernels.byte_column_sums(blocks.packed, blocks.width, torch.randn(7), dropped[:, :7]) is None  # not a block
    assert kernels.byte_column_sums(blocks.packed, blocks.width + 1, torch.randn(8), dropped) is None
    assert kernels.byte_column_sums(blocks.packed, blocks.width, torch.randn(8), dropped.float()) is None
    nothing = kernels.byte_column_sums(blocks.packed, blocks.width, torch.randn(8), dropped)  # no column dropped
    assert nothing is not None and not bool(nothing.any())
    dropped[3, 2] = True  # one head drops one column: the others' sums are zero
    nan_outputs(monkeypatch)
    one = kernels.byte_column_sums(blocks.packed, blocks.width, torch.ones(8), dropped)
    assert not bool(one[[0, 1, 2, 4]].any()) and bool(one[3].any())


def test_what_it_does_not_take_goes_back_untouched(native):
    logits = torch.randn(5, 100)
    before = logits.clone()
    assert kernels.head_statistics(logits.double()) is None
    assert kernels.head_statistics(logits.T) is None  # columns, not rows
    assert kernels.head_statistics(logits, torch.randn(99)) is None
    assert kernels.head_statistics(logits, clean=torch.randn(100).double()) is None
    assert kernels.head_statistics(torch.randn(0, 100)) is None
    assert torch.equal(logits, before)


@pytest.mark.parametrize("k", [640, 21, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_few_row_linear_is_within_its_bound_and_each_row_its_own(native, k, bias):
    """Against float64 products: within (ceil(k / 8) + 3 + k % 8 + 1) roundings of sum_j |x_j w_j| (and the
    bias's); and any rows together give, bit for bit, what each gives alone (a verify step's rows are the
    decode step's), for row counts across the kernel's passes (12 rows a pass) and weights of any row count."""
    g = torch.Generator().manual_seed(k)
    wide = torch.randn(37, k + 3, generator=g)
    for weight in (torch.randn(1003, k, generator=g), wide[:, :k]):  # the second with a row stride above k
        b = torch.randn(weight.shape[0], generator=g) if bias else None
        x = torch.randn(20, k, generator=g)
        out = kernels.few_row_linear(x, weight, b)
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        terms = x.double().abs() @ weight.double().abs().T
        roundings = -(-k // 8) + 3 + k % 8 + 1
        bound = 1.01 * roundings * 2.0**-24 * (terms + (0 if b is None else b.double().abs())) + 2.0**-24 * exact.abs()
        assert bool(((out.double() - exact).abs() <= bound).all())
        assert float(bound.max()) < 1e-3 * float(exact.abs().max())  # not vacuous
        for rows in (1, 2, 5, 6, 7, 9, 12, 13):
            assert torch.equal(kernels.few_row_linear(x[:rows], weight, b), out[:rows])
            assert torch.equal(kernels.few_row_linear(x[rows - 1 : rows + 3], weight, b), out[rows - 1 : rows + 3])


@pytest.mark.parametrize("bias", [False, True])
def test_few_row_linear_on_rows_equals_those_columns_of_the_whole_product(native, bias):
    """On a subset of W's rows (any order, repeated, none), for row counts across the kernel's passes and a
    strided weight: the whole product's columns, bit for bit; indices outside W are refused."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(500, 75, generator=g)[:, :67]  # a row stride above k
    b = torch.randn(500, generator=g) if bias else None
    for m in (1, 5, 13):
        x = torch.randn(m, 67, generator=g)
        whole = kernels.few_row_linear(x, weight, b)
        for rows in (torch.tensor([499, 3, 3, 0, 250]), torch.randperm(500, generator=g)[:123],
                     torch.empty(0, dtype=torch.long)):
            assert torch.equal(kernels.few_row_linear(x, weight, b, rows=rows), whole[:, rows])
    with pytest.raises(IndexError, match="rows must lie in"):
        kernels.few_row_linear(x, weight, b, rows=torch.tensor([0, 500]))
    with pytest.raises(IndexError, match="rows must lie in"):
        kernels.few_row_linear(x, weight, b, rows=torch.tensor([-1]))
    assert kernels.few_row_linear(x, weight, b, rows=torch.tensor([1, 2], dtype=torch.int32)) is None


def test_few_row_linear_refuses_what_it_does_not_take(native):
    x, weight = torch.randn(3, 16), torch.randn(10, 16)
    assert kernels.few_row_linear(x, weight) is not None
    assert kernels.few_row_linear(x.double(), weight) is None
    assert kernels.few_row_linear(x, weight.T.contiguous().T) is None  # columns contiguous, not rows
    assert kernels.few_row_linear(x, weight[:, :15]) is None  # k differs
    assert kernels.few_row_linear(x, weight, torch.randn(9)) is None
    assert kernels.few_row_linear(x.unsqueeze(0), weight) is None
    assert kernels.few_row_linear(x[:0], weight) is None


def test_loading_leaves_the_floating_point_mode_alone(native):
    """No -ffast-math: loading the library must not flush subnormal floats to zero for the whole process."""
    tiny = torch.tensor([1e-38])
    assert float(tiny / 1000) > 0


def test_without_a_compiler_callers_get_none(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DROPMATCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    kernels._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="dropmatch.kernels"):
            assert kernels.head_statistics(torch.randn(5, 100)) is None
            assert not kernels.available()
        if BUILDS_HERE:
            assert "native kernels unavailable" in caplog.text
        monkeypatch.setenv("DROPMATCH_NATIVE", "0")
        monkeypatch.delenv("CC")
        kernels._library.cache_clear()
        assert not kernels.available()
    finally:
        kernels._library.cache_clear()
