"""Certified DropMatch decisions on logits with per-token error bounds: whenever ``certified_decide``
decides, it decides as ``decide`` does on the exact logits, for every error within the bounds."""

from __future__ import annotations

import pytest
import torch

from dropmatch.rules.divergence import js_divergence
from dropmatch.rules.dropmatch import CRITERIA, certified_decide, decide, js_error_bound, log_normalizer_bound
from dropmatch.sampling import SamplingConfig

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
