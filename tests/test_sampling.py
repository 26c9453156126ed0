"""Speculative sampling preserves the target distribution (chi-square tests with fixed seeds)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from dropmatch.drafters import ModelDrafter, NgramDrafter
from dropmatch.engine import generate
from dropmatch.rules import StandardVerification, VerifyInput
from dropmatch.sampling import SamplingConfig, sample_with_uniform, top_p_filter

from .conftest import make_tiny

P_MIN = 1e-3  # the tests fail only if the sampler is wrong or with probability 1e-3 per check


def _first_token_counts(p_logits, q, sampling, n, seed, deterministic=False):
    gen = torch.Generator().manual_seed(seed)
    rule = StandardVerification()
    vocab = p_logits.shape[-1]
    counts = torch.zeros(vocab)
    logits = torch.stack([p_logits, torch.zeros(vocab)])  # row 1 only feeds the bonus
    for _ in range(n):
        x = sample_with_uniform(q, torch.rand((), generator=gen)).view(1)
        inp = VerifyInput(x, None if deterministic else q.view(1, -1), logits, torch.zeros(2, 4), sampling, gen)
        verdict = rule.verify(inp)
        counts[int(x) if verdict.n_accepted == 1 else verdict.next_token] += 1
    return counts


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_rule_preserves_target_distribution(temperature, top_p):
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingConfig(temperature, top_p)
    p_logits = torch.randn(6, generator=gen) * 1.5
    q = sampling.probs(torch.randn(6, generator=gen) * 1.5)  # a draft that is far from p
    p = sampling.probs(p_logits)
    counts = _first_token_counts(p_logits, q, sampling, 20000, seed=1)
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], p[support] * counts.sum()).pvalue > P_MIN


def test_rule_with_deterministic_draft_preserves_target_distribution():
    gen = torch.Generator().manual_seed(3)
    sampling = SamplingConfig(1.0)
    p_logits = torch.randn(5, generator=gen)
    one_hot = torch.zeros(5)
    one_hot[2] = 1.0
    counts = _first_token_counts(p_logits, one_hot, sampling, 20000, seed=4, deterministic=True)
    p = sampling.probs(p_logits)
    assert chisquare(counts, p * counts.sum()).pvalue > P_MIN


def test_a_wrong_sampler_is_caught():
    """The test above can fail: always accepting the draft gives the draft's distribution."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(6, generator=gen) * 1.5, -1)
    draws = torch.stack([sample_with_uniform(q, torch.rand((), generator=gen)) for _ in range(20000)])
    counts = torch.bincount(draws, minlength=6).float()
    assert chisquare(counts, p * counts.sum()).pvalue < P_MIN


def _exact_joint(target, prompt, vocab, sampling):
    """P(t2, t3) of plain sampling, by enumerating t1 and t2."""
    joint = torch.zeros(vocab, vocab)
    with torch.no_grad():
        p1 = sampling.probs(target.model(prompt.view(1, -1)).logits[0, -1])
        for t1 in range(vocab):
            seqs = torch.stack([torch.cat([prompt, torch.tensor([t1, t2])]) for t2 in range(vocab)])
            logits = target.model(seqs).logits
            p2 = sampling.probs(logits[0, -2])
            p3 = sampling.probs(logits[:, -1])  # (t2, V)
            joint += p1[t1] * p2.unsqueeze(1) * p3
    return joint


@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_engine_preserves_target_distribution(drafter_kind):
    """Second and third tokens of full SD runs on a 10-token model match plain sampling."""
    vocab = 10
    pair = make_tiny("llama", seed=5, draft_noise=0.5, vocab_size=vocab)
    sampling = SamplingConfig(1.0)
    prompt = torch.tensor([2, 3, 4, 3, 5, 3])
    expected = _exact_joint(pair.target, prompt, vocab, sampling).flatten()
    counts = torch.zeros(vocab * vocab)
    for seed in range(4000):
        drafter = ModelDrafter(pair.draft) if drafter_kind == "model" else NgramDrafter(max_ngram=1)
        out = generate(pair.target, prompt, drafter=drafter, draft_len=2, max_new_tokens=3, sampling=sampling,
                       seed=seed).token_ids
        counts[out[1] * vocab + out[2]] += 1
    keep = expected * counts.sum() >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    wanted = torch.cat([expected[keep], expected[~keep].sum().view(1)]) * counts.sum()
    assert chisquare(observed, wanted).pvalue > P_MIN


def test_top_p_filter_keeps_smallest_nucleus():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert torch.allclose(top_p_filter(p, 0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert torch.allclose(top_p_filter(p, 0.81), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    assert torch.allclose(top_p_filter(p, 1.0), p)


def test_sample_with_uniform_skips_zero_mass():
    p = torch.tensor([0.0, 0.5, 0.0, 0.5])
    picks = {int(sample_with_uniform(p, u)) for u in torch.linspace(0, 0.999, 50)}
    assert picks == {1, 3}
