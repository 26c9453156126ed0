"""8-bit row-wise columns for the sparse dropout heads' greedy corrections (dropmatch.heads.byte_columns)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dropmatch.errors import ConfigError
from dropmatch.heads import dropout
from dropmatch.heads.byte_columns import BYTE_ROWWISE, byte_bags_supported
from dropmatch.heads.dropout import DropoutHead
from dropmatch.rules.dropmatch import DropMatch
from dropmatch.sampling import SamplingConfig

needs_fbgemm = pytest.mark.skipif(not byte_bags_supported(), reason="needs fbgemm's 8-bit embedding bags (x86)")


@pytest.fixture(autouse=True)
def bags_at_every_p_drop(monkeypatch):
    """These tests are of the embedding bags: no int8 GEMM past the crossover (tests/test_int8_gemm.py)."""
    monkeypatch.setattr(dropout, "INT8_GEMM_MIN_DROPPED", float("inf"))


def _case(vocab: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, d, generator=g) * 0.3
    weight[3, 5] = 4.0  # an outlier: its column's blocks get coarse steps
    return weight, torch.randn(4, d, generator=g) * 3


def _errors_and_bounds(head: DropoutHead, weight: torch.Tensor, hidden: torch.Tensor, seed: int):
    """Each head's largest error over the vocabulary against float64 heads, and its bound, (n, K) each."""
    masks = head.draw_masks(hidden.shape[0], torch.Generator().manual_seed(seed))
    clean = F.linear(hidden, weight)
    logits = head.logits(hidden, clean, masks, sparse_dtype=BYTE_ROWWISE)
    exact = F.linear(hidden.double().unsqueeze(1) * masks / (1 - head.p_drop), weight.double())
    bounds = head.error_scale(False) * head.product_bounds(hidden, masks, clean, logits, fused=False,
                                                          read_outputs=False, sparse_dtype=BYTE_ROWWISE)
    return (logits.double() - exact).abs().amax(-1), bounds.double(), (~masks).any(-1)


@needs_fbgemm
@pytest.mark.parametrize("vocab,block", [(700, 256), (300, 1000), (1024, 128)], ids=["padded", "one-block", "exact"])
def test_8bit_corrections_hold_their_bound_and_it_is_tight(vocab, block):
    """Every head logit from 8-bit columns is within its head's bound of the float64 heads (+ float32 noise of
    the clean logits, the reference precision: about the size of the bound's arithmetic term, so the
    quantization term is what this checks), the bound is zero where no column drops and, since it is
    measured rather than assumed, nearly reached: a head that drops one column errs by up to its bound / 1.05."""
    ratios = []
    for p_drop in (0.03, 0.3):
        for seed in range(6):
            weight, hidden = _case(vocab, 48, seed)
            head = DropoutHead(weight, k=5, p_drop=p_drop, compute_dtype=torch.float32, sparse=True,
                               sparse_dtype=BYTE_ROWWISE, vocab_block=block)
            err, bound, dropped = _errors_and_bounds(head, weight, hidden, seed)
            assert bool((err <= bound + 1e-5).all()), (p_drop, seed)
            assert bool((bound[~dropped] == 0).all()) and bool((bound[dropped] > 0).all())
            ratios.append(float((err / bound.clamp(min=1e-30))[dropped].max()))
    assert max(ratios) > 0.5


@needs_fbgemm
def test_the_bound_needs_the_measured_quantization_error():
    """Negative control: without the measured dequantization error (float32 arithmetic alone) the bound fails,
    so the test above could fail."""
    weight, hidden = _case(700, 48, 0)
    head = DropoutHead(weight, k=5, p_drop=0.3, compute_dtype=torch.float32, sparse=True, sparse_dtype=BYTE_ROWWISE,
                       vocab_block=256)
    blocks = head.byte_blocks()
    head._byte_blocks = dataclasses.replace(blocks, error=torch.zeros_like(blocks.error))
    err, bound, _ = _errors_and_bounds(head, weight, hidden, 0)
    assert bool((err > bound + 1e-5).any())


def test_8bit_columns_are_refused_where_they_cannot_run(monkeypatch):
    """A clear error, not fbgemm's: 8-bit columns need fbgemm (x86) and a float32 CPU weight."""
    if byte_bags_supported():  # a bfloat16 weight: its exact heads are not the float32 products the bound is against
        with pytest.raises(ConfigError, match="float32 CPU weight"):
            DropoutHead(torch.randn(100, 16).bfloat16(), k=5, p_drop=0.03, sparse=True, sparse_dtype=BYTE_ROWWISE)
    monkeypatch.setattr(dropout, "byte_columns_supported", lambda weight: False)  # as without fbgemm
    with pytest.raises(ConfigError, match="fbgemm"):
        DropoutHead(torch.randn(100, 16), k=5, p_drop=0.03, sparse=True, sparse_dtype=BYTE_ROWWISE)
    default = DropoutHead(torch.randn(100, 16), k=5, p_drop=0.03, compute_dtype=torch.bfloat16)
    assert default.sparse_dtype != BYTE_ROWWISE  # the CPU default falls back to bfloat16 or float32


@needs_fbgemm
def test_the_package_default_takes_8bit_columns_unless_float32_is_asked_for(monkeypatch):
    """On an x86 CPU the sparse heads' greedy corrections are 8-bit by default, also where the CPU lacks native
    bfloat16 (there the default head dtype is float32, which asks for nothing); --head-dtype float32 keeps
    them exact."""
    from dropmatch import methods
    from dropmatch.models import load_pair

    target = load_pair("tiny").target
    assert methods.dropout_head(target, 5, 0.032).sparse_dtype == BYTE_ROWWISE
    assert methods.dropout_head(target, 5, 0.032, "bfloat16").sparse_dtype == BYTE_ROWWISE
    assert methods.dropout_head(target, 5, 0.032, "float32").sparse_dtype == torch.float32
    monkeypatch.setattr(methods, "default_head_dtype", lambda weight: torch.float32)  # an AVX2-only CPU
    assert methods.dropout_head(target, 5, 0.032).sparse_dtype == BYTE_ROWWISE


@needs_fbgemm
def test_greedy_js_criteria_on_a_rows_head_take_8bit_sparse_heads():
    """On the CPU default's rows head (large K p_drop), greedy JS criteria compute the heads of positions whose rows
    did not ride in the verification GEMM as sparse heads with 8-bit corrections while K p_drop <= 2, and take the
    decisions of exact float32 rows; sampled steps keep the rows (argmax votes: the next test)."""
    from dropmatch.heads.screened import ScreenedHead
    from dropmatch.rules import RelaxedVerification

    from .test_sparse_heads import _with, random_case

    greedy, sampled = SamplingConfig(), SamplingConfig(0.8, 1.0)
    refined = 0
    for seed in range(20):
        weight, inp = random_case(seed, greedy, vocab=400, d=32)
        head = DropoutHead(weight, k=5, p_drop=0.3, compute_dtype=torch.bfloat16)
        if not head.exact_rows:
            pytest.skip("the CPU default's rows head needs oneDNN")
        rule = DropMatch(head, "js+majority")
        twin = rule.heads_for(greedy)
        assert twin.sparse and twin.sparse_dtype == BYTE_ROWWISE  # here no rows ride in a verification GEMM
        assert DropMatch(head, "js+majority", screened_clean_logits=False).heads_dtype(greedy) == BYTE_ROWWISE
        assert rule.heads_for(sampled) is head
        exact = DropMatch(DropoutHead(weight, k=5, p_drop=0.3, exact_rows=True, rows_dtype=torch.float32),
                          "js+majority")
        screened = ScreenedHead(weight, refine_margin=0.5)(inp.hidden)
        verdict = RelaxedVerification(rule).verify(_with(inp, seed, screened))
        expected = RelaxedVerification(exact).verify(_with(inp, seed))
        assert (verdict.n_accepted, verdict.extra_accepts) == (expected.n_accepted, expected.extra_accepts), seed
        refined += rule.counters.refined_tokens  # certified on the 8-bit heads (exact rows refine nothing)
    assert refined > 0
    wide = DropMatch(DropoutHead(weight, k=5, p_drop=0.5, compute_dtype=torch.bfloat16), "js")
    assert wide.heads_for(greedy) is wide.head  # K p_drop = 2.5: the bags would read more than the rows


@needs_fbgemm
@pytest.mark.parametrize("criterion", ["naive", "majority"])
def test_argmax_votes_on_float32_rows_take_8bit_sparse_heads_where_corrections_are_fast(monkeypatch, criterion):
    """Where a rows head's rows are float32 (no native bfloat16) and the 8-bit corrections are fast (the native
    kernel), greedy argmax votes take the sparse twin too, with the decisions of exact float32 rows; without fast
    corrections, or on bfloat16 rows, they keep the rows."""
    from dropmatch.rules import RelaxedVerification
    from dropmatch.rules import dropmatch as rules

    from .test_sparse_heads import _with, random_case

    greedy = SamplingConfig()
    twins = 0
    for seed in range(16):
        weight, inp = random_case(seed, greedy, vocab=400, d=32)
        head = DropoutHead(weight, k=5, p_drop=0.3, compute_dtype=torch.bfloat16, rows_dtype=torch.float32)
        if not head.exact_rows:
            pytest.skip("the CPU default's rows head needs oneDNN")
        monkeypatch.setattr(rules, "native_kernels_available", lambda: False)
        assert DropMatch(head, criterion).heads_for(greedy) is head or head.corrections_by_gemm
        bf16_rows = DropoutHead(weight, k=5, p_drop=0.3, exact_rows=True, rows_dtype=torch.bfloat16)
        monkeypatch.setattr(rules, "native_kernels_available", lambda: True)
        assert DropMatch(bf16_rows, criterion).heads_for(greedy) is bf16_rows  # they certify at a glance
        rule = DropMatch(head, criterion)
        twin = rule.heads_for(greedy)
        assert twin.sparse and twin.sparse_dtype == BYTE_ROWWISE
        exact = DropMatch(DropoutHead(weight, k=5, p_drop=0.3, exact_rows=True, rows_dtype=torch.float32), criterion)
        verdict = RelaxedVerification(rule).verify(_with(inp, seed))
        expected = RelaxedVerification(exact).verify(_with(inp, seed))
        assert (verdict.n_accepted, verdict.extra_accepts) == (expected.n_accepted, expected.extra_accepts), seed
        twins += rule._sparse_twin is not None  # built: some position's heads came from it
    assert twins > 0
