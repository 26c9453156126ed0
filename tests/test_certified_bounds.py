"""Certified DropMatch decisions on logits with per-token error bounds: whenever ``certified_decide``
decides, it decides as ``decide`` does on the exact logits, for every error within the bounds."""

from __future__ import annotations

import math

import pytest
import torch

import dropmatch.rules.dropmatch as dropmatch_rules
from dropmatch import kernels
from dropmatch.rules.divergence import js_bounds, js_divergence
from dropmatch.rules.dropmatch import (
    CRITERIA,
    _normalizer_interval,
    _shift_sensitivity,
    certified_decide,
    decide,
    exact_argmaxes,
    js_error_bound,
    log_normalizer_bound,
    tail_certified_decide,
)
from dropmatch.sampling import SamplingConfig

from .test_kernels import BUILDS_HERE

GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=0.8)


def case(seed: int, vocab: int = 60, k: int = 5):
    """Exact head logits (K, V) near a shared base, per-token bounds (K, V), an exact-token mask (V,)
    and logits off by up to the bounds (the extremes, with random signs) elsewhere."""
    g = torch.Generator().manual_seed(seed)
    base = 3 * torch.randn(vocab, generator=g)
    exact_logits = base + 0.3 * torch.randn(k, vocab, generator=g)
    exact = base >= base.max() - float(torch.rand((), generator=g)) * 6  # tokens near the top made exact
    eps = 0.2 * torch.rand(k, vocab, generator=g)
    sign = torch.randint(0, 2, (k, vocab), generator=g) * 2 - 1
    approx = torch.where(exact, exact_logits, exact_logits + sign * eps)
    token = int(torch.randint(0, vocab, (), generator=g)) if seed % 2 else int(exact_logits[0].argmax())
    draft = torch.softmax(base + torch.randn(vocab, generator=g), -1)
    return exact_logits, approx, eps, exact, token, draft


@pytest.mark.parametrize("criterion", CRITERIA)
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_certified_decisions_equal_exact_ones(criterion, sampling):
    decided = 0
    for seed in range(300):
        exact_logits, approx, eps, exact, token, draft = case(seed)
        threshold = None if sampling.greedy else 0.5 * float(sampling.probs(exact_logits)[:, token].mean())
        verdict = certified_decide(criterion, approx, eps, exact, token, draft, sampling, vote_threshold=threshold)
        if verdict is not None:
            decided += 1
            assert verdict == decide(criterion, exact_logits, token, draft, sampling, vote_threshold=threshold), seed
    assert decided > 40  # not vacuous: the bounds certify a good share of the cases


def test_a_bound_smaller_than_the_error_certifies_a_wrong_vote():
    """Negative control: the exact logits make token 1 the argmax; its computed logit is 0.3 low. The
    true bound (0.3) refuses to certify token 0; a bound of 0.03 certifies it, wrongly."""
    exact_logits = torch.tensor([[1.0, 1.1, -2.0, -3.0]])
    approx = exact_logits - torch.tensor([[0.0, 0.3, 0.0, 0.0]])
    exact = torch.tensor([True, False, False, False])
    draft = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert decide("naive", exact_logits, 0, draft, GREEDY) is False
    assert certified_decide("naive", approx, torch.full((1, 4), 0.3), exact, 0, draft, GREEDY) is None
    assert certified_decide("naive", approx, torch.full((1, 4), 0.03), exact, 0, draft, GREEDY) is True


def test_per_head_bounds_equal_per_token_bounds_of_the_same_value():
    decided = dict.fromkeys(CRITERIA, 0)
    for seed in range(30):
        exact_logits, approx, eps, exact, token, draft = case(seed)
        per_head = eps.amax(-1)
        for criterion in CRITERIA:
            verdict = certified_decide(criterion, approx, per_head, exact, token, draft, GREEDY)
            assert verdict == certified_decide(criterion, approx, per_head[:, None].expand_as(eps), exact, token,
                                               draft, GREEDY)
            if verdict is not None:
                decided[criterion] += 1
                assert verdict == decide(criterion, exact_logits, token, draft, GREEDY)
    assert min(decided.values()) > 0, decided  # every criterion certified somewhere: the comparison has teeth


def test_normalizer_and_js_bounds_hold():
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        logits_a, logits_b = 2 * torch.randn(2, 40, generator=g)
        err = 0.3 * torch.rand(40, generator=g)
        shift = (2 * torch.rand(40, generator=g) - 1) * err
        a, a_exact = torch.softmax(logits_a + shift, -1), torch.softmax(logits_a, -1)
        z_gap = torch.logsumexp(logits_a, -1) - torch.logsumexp(logits_a + shift, -1)
        assert abs(float(z_gap)) <= float(log_normalizer_bound(a, err))
        b = torch.softmax(logits_b, -1)
        eta = log_normalizer_bound(a, err) + err
        assert abs(float(js_divergence(a, b) - js_divergence(a_exact, b))) <= float(js_error_bound(a, b, eta))


def test_bounds_hold_for_errors_of_tens_of_nats():
    """Errors far past the usual margins (a token 40-60 nats off): the bounds still hold (or are infinite,
    certifying nothing); they never understate."""
    g = torch.Generator().manual_seed(2)
    for big in (35.0, 40.0, 45.0, 60.0):
        for _ in range(20):
            logits_a, logits_b = 2 * torch.randn(2, 40, generator=g)
            err = 0.3 * torch.rand(40, generator=g)
            err[int(torch.randint(40, (1,), generator=g))] = big
            shift = err * torch.where(torch.rand(40, generator=g) < 0.5, -1.0, 1.0)
            a, a_exact = torch.softmax(logits_a + shift, -1), torch.softmax(logits_a, -1)
            z_gap = torch.logsumexp(logits_a.double(), -1) - torch.logsumexp((logits_a + shift).double(), -1)
            assert abs(float(z_gap)) <= float(log_normalizer_bound(a, err)) + 1e-5
            b = torch.softmax(logits_b, -1)
            eta = log_normalizer_bound(a, err) + err
            gap = abs(float(js_divergence(a.double(), b.double()) - js_divergence(a_exact.double(), b.double())))
            assert gap <= float(js_error_bound(a, b, eta)) + 1e-6


# ---------------------------------------------------------------------------------------------
# tail_certified_decide: exact kept tokens, a bounded normalizer, the tail's mass


def tail_case(seed: int, vocab: int = 3000, k: int = 5):
    """Exact head logits (K, V) over a long tail, per-head error bounds (K,), computed logits off by up
    to them at every token (random signs), a draft token, and draft logits from far off the heads to
    almost on their centroid (so both verdicts occur, some near the boundary)."""
    g = torch.Generator().manual_seed(seed)
    base = 4 * torch.randn(vocab, generator=g)
    base[: 1 + seed % 3] += 12  # a few likely tokens, a long tail of small mass
    exact_logits = base + 0.15 * torch.randn(k, vocab, generator=g)
    err = 0.5 * torch.rand(k, generator=g)
    sign = torch.randint(0, 2, (k, vocab), generator=g) * 2 - 1
    approx = exact_logits + sign * err[:, None] * torch.rand(k, vocab, generator=g)
    closeness = float(torch.rand((), generator=g)) ** 3
    draft_logits = exact_logits.mean(0) + closeness * 3 * torch.randn(vocab, generator=g)
    token = int(exact_logits[int(seed % k)].argmax()) if seed % 2 else int(torch.randint(0, 4, (), generator=g))
    return exact_logits, approx, err, token, draft_logits


@pytest.mark.parametrize("criterion", CRITERIA)
@pytest.mark.parametrize("q_is_logits", [True, False], ids=["draft-logits", "draft-probs"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared-cut", "per-head-cut"])
@pytest.mark.parametrize("statistics", ["native", "torch"])
def test_tail_certified_decisions_equal_exact_ones(criterion, q_is_logits, per_head, statistics, monkeypatch):
    """Per-head cuts (taken past SHARED_CUT_MAX_KEPT kept tokens) run on heads whose ln Z lie apart: each head's
    logits scaled by its own factor (as heads spread apart at a large p_drop). The heads' normalizers, centroid
    and maximum, and the kept tokens, come from the native kernels (which must run wherever they build) or from
    torch."""
    if statistics == "torch":
        monkeypatch.setattr(dropmatch_rules, "head_statistics", lambda *args: None)
        monkeypatch.setattr(dropmatch_rules, "kept_tokens", lambda *args: None)
    elif BUILDS_HERE:
        assert kernels.available()
    if per_head:
        monkeypatch.setattr(dropmatch_rules, "SHARED_CUT_MAX_KEPT", 0)
    verdicts = []
    for seed in range(120):
        exact_logits, approx, err, token, draft_logits = tail_case(seed)
        if per_head:
            spread = torch.linspace(0.5, 1.5, exact_logits.shape[0]).unsqueeze(-1)
            exact_logits, approx = spread * exact_logits, spread * exact_logits + (approx - exact_logits)
            token = int(exact_logits[int(seed % exact_logits.shape[0])].argmax()) if seed % 2 else token
        draft = draft_logits if q_is_logits else torch.softmax(draft_logits, -1)
        gathered = []

        def exact_on(tokens, exact_logits=exact_logits, gathered=gathered):
            gathered.append(tokens.numel())
            return exact_logits[:, tokens]

        verdict = tail_certified_decide(criterion, approx, err, exact_on, token, draft, q_is_logits)
        if verdict is not None:
            expected = decide(criterion, exact_logits, token, torch.softmax(draft_logits, -1), GREEDY,
                              draft_logits=draft_logits if q_is_logits else None)
            assert verdict == expected, seed
            assert max(gathered) < exact_logits.shape[-1]  # decided from a kept subset, not the whole vocabulary
        verdicts.append(verdict)
    decided = [v for v in verdicts if v is not None]
    assert len(decided) > 0.8 * len(verdicts)  # the bounds settle most cases
    assert any(decided) and not all(decided)  # both verdicts occur: the comparison has teeth
    if criterion == "js+majority":  # bounds of ~10 nats: the JS gather cannot hold the votes, found apart
        apart = []

        def counted(*args):
            apart.append(args)
            return exact_argmaxes(*args)

        monkeypatch.setattr(dropmatch_rules, "exact_argmaxes", counted)
        for seed in range(20):
            exact_logits, approx, err, token, draft_logits = tail_case(seed)
            approx = exact_logits + 20 * (approx - exact_logits)
            verdict = tail_certified_decide(criterion, approx, 20 * err, lambda t, e=exact_logits: e[:, t], token,
                                            draft_logits, True)
            if verdict is not None:
                assert verdict == decide(criterion, exact_logits, token, torch.softmax(draft_logits, -1), GREEDY,
                                         draft_logits=draft_logits), seed
        assert apart


def test_tail_certified_decisions_on_a_vocabulary_whose_gather_limit_is_fractional():
    """V / 8 is not a whole number of kept tokens here (40004 / 8 = 5000.5): the kept-token limit is whole."""
    for seed in range(6):
        exact_logits, approx, err, token, draft_logits = tail_case(seed, vocab=40004)
        verdict = tail_certified_decide("js+majority", approx, err, lambda tokens, e=exact_logits: e[:, tokens], token,
                                        draft_logits, True)
        if verdict is not None:
            assert verdict == decide("js+majority", exact_logits, token, torch.softmax(draft_logits, -1), GREEDY,
                                     draft_logits=draft_logits)


def test_tail_certified_understated_error_certifies_a_wrong_vote():
    """Negative control: every head's true argmax computed 6 nats low. With the true bound it is made
    exact and the vote is right; with a bound of 0 the draft token is taken for the heads' token, wrongly."""
    exact_logits = torch.zeros(3, 200)
    exact_logits[:, 0], exact_logits[:, 1] = 10.0, 10.5
    approx = exact_logits.clone()
    approx[:, 1] -= 6.0
    exact_on = lambda tokens: exact_logits[:, tokens]  # noqa: E731
    draft = torch.zeros(200)
    assert decide("naive", exact_logits, 0, torch.softmax(draft, -1), GREEDY) is False
    assert tail_certified_decide("naive", approx, torch.full((3,), 6.0), exact_on, 0, draft, True) is False
    assert tail_certified_decide("naive", approx, torch.zeros(3), exact_on, 0, draft, True) is True


def test_per_head_cut_keeps_a_head_s_argmax_or_finds_it_apart(monkeypatch):
    """A head whose ln Z lies 30 nats above the others' has its true argmax computed 5 nats low, out of its own
    cut: the gather does not hold it, and its vote must come from :func:`exact_argmaxes`. A threshold taken at
    the lowest ln Z instead of the head's own would take the gather's best token for its argmax and accept."""
    monkeypatch.setattr(dropmatch_rules, "SHARED_CUT_MAX_KEPT", 0)
    base = torch.full((1000,), -20.0)
    base[0], base[100:200] = 5.0, 4.0
    exact_logits = base.repeat(3, 1)
    exact_logits[0] += 30.0
    exact_logits[0, 1] = 35.5  # head 0's argmax; heads 1 and 2 vote 0 and 100
    exact_logits[2, 100] = 5.5
    approx = exact_logits.clone()
    approx[0, 1] -= 5.0
    draft_logits = torch.full((1000,), -20.0)
    draft_logits[0] = 20.0  # far from the centroid: the JS test rejects
    assert decide("js+majority", exact_logits, 0, torch.softmax(draft_logits, -1), GREEDY,
                  draft_logits=draft_logits) is False
    assert tail_certified_decide("js+majority", approx, torch.tensor([5.0, 0.0, 0.0]),
                                 lambda tokens: exact_logits[:, tokens], 0, draft_logits, True) is False


def test_flat_heads_below_the_first_cut_go_on_to_the_next():
    """Every distribution below 1e-3 everywhere (3000 logits within ~+-0.7): the first cut keeps nothing, and the
    decision comes from the next one, equal to the exact decision (a rejection)."""
    g = torch.Generator().manual_seed(0)
    exact_logits = 0.2 * torch.randn(3000, generator=g) + 0.02 * torch.randn(3, 3000, generator=g)
    approx, draft_logits = exact_logits + 0.005, 0.2 * torch.randn(3000, generator=g)  # a draft far off the heads
    verdict = tail_certified_decide("js+majority", approx, torch.full((3,), 0.005),
                                    lambda tokens: exact_logits[:, tokens], 7, draft_logits, True)
    assert float(torch.softmax(exact_logits, -1).max()) < 1e-3
    assert verdict is False and decide("js+majority", exact_logits, 7, torch.softmax(draft_logits, -1), GREEDY,
                                       draft_logits=draft_logits) is False


def test_normalizer_interval_and_shift_sensitivity_hold():
    """ln Z of logits exact on a kept subset and off by up to err elsewhere lies in the interval, the
    tail mass below its bound; and the kept JS part moves by at most the shift sensitivity when each
    side's log-probabilities all shift by one amount within its eta, far less than the per-token bound
    charges when the distributions are close."""
    g = torch.Generator().manual_seed(4)
    ratios, missed = [], 0
    for _ in range(100):
        exact = 3 * torch.randn(2, 500, generator=g)
        err = 0.6 * torch.rand(2, generator=g)
        approx = exact + (2 * torch.rand(2, 500, generator=g) - 1) * err[:, None]
        kept = torch.randperm(500, generator=g)[:50]
        lo, hi, tail = _normalizer_interval(exact[:, kept], approx[:, kept], torch.logsumexp(approx.double(), -1), err)
        true_log_z = torch.logsumexp(exact.double(), -1)
        assert bool(((lo <= true_log_z + 1e-9) & (true_log_z <= hi + 1e-9)).all())
        lo, hi, _ = _normalizer_interval(exact[:, kept], approx[:, kept], torch.logsumexp(approx.double(), -1), err / 4)
        missed += int(((true_log_z < lo) | (true_log_z > hi)).sum())  # an understated error: the interval can miss
        off = torch.ones(500, dtype=torch.bool)
        off[kept] = False
        assert bool((torch.softmax(exact.double(), -1)[:, off].sum(-1) <= tail + 1e-9).all())

        logits = torch.randn(500, generator=g)
        a = torch.softmax(logits + 0.05 * torch.randn(3, 500, generator=g), -1).double()[:, kept]
        b = torch.softmax(logits, -1).double()[kept]
        eta_a, eta_b = 0.01 * torch.rand(3, generator=g).double(), 0.01 * float(torch.rand((), generator=g))
        bound = _shift_sensitivity(a, b, eta_a, torch.tensor(eta_b))
        for sign_a, sign_b in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
            moved = js_bounds(a * (sign_a * eta_a[:, None]).exp(), b * math.exp(sign_b * eta_b), torch.zeros(3), 0.0)[0]
            assert bool(((moved - js_bounds(a, b, torch.zeros(3), 0.0)[0]).abs() <= bound + 1e-12).all())
        per_token = js_error_bound(a, b.expand_as(a), torch.maximum(eta_a, torch.tensor(eta_b))[:, None].expand_as(a))
        ratios.append(float((bound / per_token).max()))
    assert missed > 0  # the interval is no wider than it must be for the stated error
    assert max(ratios) < 0.2  # close distributions: the normalizer's shift moves JS far less than ~3 eta per unit mass
