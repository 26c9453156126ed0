"""Speculative sampling preserves the target distribution (chi-square tests with fixed seeds)."""

from __future__ import annotations

import bisect
import itertools
import math
import random

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


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_rule_preserves_target_distribution_when_the_draft_gives_only_logits(temperature, top_p):
    """A draft distribution given as logits (a custom drafter's), at the step's temperature / top-p: the
    accept test and the residual must take the same q (the accept test took q = 1 before: 0.91 of the
    mass on the target's top token where p gives it 0.71)."""
    gen = torch.Generator().manual_seed(5)
    sampling = SamplingConfig(temperature, top_p)
    p_logits, q_logits = torch.randn(6, generator=gen) * 0.7, torch.randn(6, generator=gen) * 1.5
    q = sampling.probs(q_logits)
    assert int((sampling.probs(p_logits) > 0).sum()) >= 3  # a law with some spread to test
    rule, counts = StandardVerification(), torch.zeros(6)
    logits = torch.stack([p_logits, torch.zeros(6)])
    for _ in range(20000):
        x = sample_with_uniform(q, torch.rand((), generator=gen)).view(1)
        verdict = rule.verify(VerifyInput(x, None, logits, torch.zeros(2, 4), sampling, gen, q_logits.view(1, -1)))
        counts[int(x) if verdict.n_accepted == 1 else verdict.next_token] += 1
    p = sampling.probs(p_logits)
    assert counts[p == 0].sum() == 0
    assert chisquare(counts[p > 0], p[p > 0] * counts.sum()).pvalue > P_MIN


def test_a_tiny_temperature_is_a_one_hot_distribution_not_nan():
    logits = torch.tensor([1.0, 30.0, 2.0, -math.inf])
    for temperature in (1e-30, 1e-39, 1e-45):
        probs = SamplingConfig(temperature).probs(logits)
        assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0])), temperature


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


@pytest.mark.parametrize("drafter_kind", ["model", "model-stop", "ngram"])
def test_engine_preserves_target_distribution(drafter_kind):
    """Second and third tokens of full SD runs on a 10-token model (the first verify step's two draft
    positions, or later steps after a rejection) match plain sampling; "model-stop"
    drafts end after a sampled token of draft probability below 0.3 (both stopped and full proposals
    occur, and a stop that looked at anything but the draft would bias the counts)."""
    vocab = 10
    pair = make_tiny("llama", seed=5, draft_noise=0.5, vocab_size=vocab)
    sampling = SamplingConfig(1.0)
    prompt = torch.tensor([2, 3, 4, 3, 5, 3])
    expected = _exact_joint(pair.target, prompt, vocab, sampling).flatten()
    counts = torch.zeros(vocab * vocab)
    first_lengths = torch.zeros(3)
    new_drafter = {"model": lambda: ModelDrafter(pair.draft), "model-stop": lambda: ModelDrafter(pair.draft, 0.3),
                   "ngram": lambda: NgramDrafter(max_ngram=1)}[drafter_kind]
    for seed in range(4000):
        result = generate(pair.target, prompt, drafter=new_drafter(), draft_len=2, max_new_tokens=4, sampling=sampling,
                          seed=seed)  # 4: the first proposal has both draft positions (3 would leave it one)
        out = result.token_ids
        counts[out[1] * vocab + out[2]] += 1
        first_lengths[result.stats.drafted_per_step[0]] += 1
    if drafter_kind == "model-stop":
        assert first_lengths[1] > 100 and first_lengths[2] > 100, first_lengths
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


# --------------------------------------------------------------------------------------------
# Draft length >= 3: every draft position, the correction at each of them, and the bonus row



MARKOV_V, MARKOV_L, MARKOV_TOKENS = 4, 3, 4  # vocabulary, draft length, output tokens compared


def _markov_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft next-token logits (V, V), row = previous token; far apart."""
    gen = torch.Generator().manual_seed(0)
    target, draft = (torch.randn(MARKOV_V, MARKOV_V, generator=gen) * 1.5 for _ in range(2))
    return target, draft


def _markov_law(p: torch.Tensor, first: int, n_tokens: int) -> torch.Tensor:
    """Exact law (V ** n_tokens,) of n_tokens steps of the chain ``p`` from ``first``, by enumeration."""
    law = []
    for seq in itertools.product(range(p.shape[0]), repeat=n_tokens):
        prob, last = 1.0, first
        for t in seq:
            prob, last = prob * float(p[last, t]), t
        law.append(prob)
    return torch.tensor(law, dtype=torch.float64)


def _pooled_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    """Chi-square p-value of ``counts`` against ``law``, cells with fewer than 5 expected pooled (into
    one cell, if there are any)."""
    assert counts[law == 0].sum() == 0, "a token of probability zero was emitted"
    expected = law * counts.sum()
    keep = expected >= 5
    observed, wanted = [counts[keep]], [expected[keep]]
    if (~keep).any():  # no empty pooled cell: it would put 0 / 0 in the statistic
        observed.append(counts[~keep].sum().view(1))
        wanted.append(expected[~keep].sum().view(1))
    observed, wanted = torch.cat(observed).double(), torch.cat(wanted)
    return float(chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue)


class _ResidualOfPreviousPosition(VerifyInput):
    """A bug to catch: the correction at position j uses the draft distribution of position j - 1
    (of position 1 at j = 0)."""

    def draft_distribution(self, j: int) -> torch.Tensor:
        return super().draft_distribution(j - 1 if j else 1)


def _markov_sd_counts(sampling: SamplingConfig, n: int, seed: int, input_type: type = VerifyInput,
                      bonus_row: int = MARKOV_L) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts (V ** 4,) of the first 4 tokens of a full SD loop (draft length 3) on the two chains,
    verified by :class:`StandardVerification`, and the histogram (L + 1,) of the first step's n_accepted.

    ``bonus_row`` != L copies another row into the bonus row (a bug to catch)."""
    logits, draft_logits = _markov_logits()
    q = sampling.probs(draft_logits)  # what a model drafter samples from and reports
    q_cdf = [list(itertools.accumulate(row)) for row in q.tolist()]
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rule = StandardVerification()
    hidden = torch.zeros(MARKOV_L + 1, 1)
    counts = torch.zeros(MARKOV_V**MARKOV_TOKENS)
    first_step = torch.zeros(MARKOV_L + 1)
    for _ in range(n):
        out = [0]
        while len(out) <= MARKOV_TOKENS:
            context = [out[-1]]
            for _ in range(MARKOV_L):  # the draft samples its own chain
                cdf = q_cdf[context[-1]]
                context.append(min(bisect.bisect_right(cdf, rnd.random() * cdf[-1]), MARKOV_V - 1))
            rows = logits[context].clone()
            rows[MARKOV_L] = rows[bonus_row]
            inp = input_type(torch.tensor(context[1:]), q[context[:-1]], rows, hidden, sampling, gen)
            verdict = rule.verify(inp)
            if len(out) == 1:
                first_step[verdict.n_accepted] += 1
            out += context[1 : 1 + verdict.n_accepted] + [verdict.next_token]
        counts[int("".join(map(str, out[1 : MARKOV_TOKENS + 1])), MARKOV_V)] += 1
    return counts, first_step


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_rule_preserves_target_law_at_every_draft_position(temperature, top_p, one_thread):
    """A full SD loop with 3 draft tokens per step on a 4-token Markov chain: the joint law of the
    first 4 emitted tokens (draft positions 1-3 and the bonus of the first step) is the target chain's."""
    sampling = SamplingConfig(temperature, top_p)
    counts, first_step = _markov_sd_counts(sampling, 6000, seed=5)
    assert (first_step > 200).all(), first_step  # rejections at every position, and full accepts
    law = _markov_law(sampling.probs(_markov_logits()[0]), 0, MARKOV_TOKENS)
    assert _pooled_pvalue(counts, law) > P_MIN


@pytest.mark.parametrize("bug", ["residual of the previous position", "bonus from the last draft row"])
def test_position_bugs_are_caught(bug, one_thread):
    """The test above can fail: a correction or a bonus drawn from the wrong row is rejected."""
    sampling = SamplingConfig(1.0)
    if bug.startswith("residual"):
        counts, _ = _markov_sd_counts(sampling, 2000, seed=2, input_type=_ResidualOfPreviousPosition)
    else:
        counts, _ = _markov_sd_counts(sampling, 2000, seed=2, bonus_row=MARKOV_L - 1)
    law = _markov_law(sampling.probs(_markov_logits()[0]), 0, MARKOV_TOKENS)
    assert _pooled_pvalue(counts, law) < 1e-6


def _exact_law_after_first(model: torch.nn.Module, prompt: torch.Tensor, vocab: int, n_tokens: int,
                           sampling: SamplingConfig) -> torch.Tensor:
    """Exact law (V ** n_tokens,) of generated tokens 1..n_tokens (token 0 summed out) under plain
    sampling from ``model``, by enumerating every continuation in one batched forward."""
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=n_tokens)))  # tokens 0..n-1
    with torch.no_grad():
        logits = model(torch.cat([prompt.expand(len(seqs), -1), seqs], 1)).logits[:, len(prompt) - 1 :]
    p = sampling.probs(logits.double())  # (V ** n, n + 1, V): p[s, i] is the law of token i after s[:i]
    rows = torch.arange(len(seqs))
    prefix = torch.ones(len(seqs), dtype=torch.float64)
    for i in range(n_tokens):
        prefix = prefix * p[rows, i, seqs[:, i]]
    joint = prefix.unsqueeze(-1) * p[:, n_tokens]  # (tokens 0..n-1, token n)
    return joint.reshape(vocab, -1).sum(0)  # token 0 is the leading digit


def test_engine_preserves_target_law_with_three_token_drafts(one_thread):
    """Full SD runs with draft length 3 on a 4-token model (rejections and cache rollback at every
    position): the joint law of generated tokens 1-4 (the first verify step's three draft positions
    and its bonus, or the later steps after a rejection) is plain sampling's."""
    vocab, n = 4, 600
    pair = make_tiny("llama", seed=5, draft_noise=0.5, vocab_size=vocab)
    sampling = SamplingConfig(1.0)
    prompt = torch.tensor([2, 3, 0, 3, 1, 3])
    counts = torch.zeros(vocab**4)
    first_step = torch.zeros(4)
    for seed in range(n):
        result = generate(pair.target, prompt, drafter=ModelDrafter(pair.draft), draft_len=3, max_new_tokens=5,
                          sampling=sampling, seed=seed)
        counts[int("".join(map(str, result.token_ids[1:5])), vocab)] += 1
        assert result.stats.drafted_per_step[0] == 3
        first_step[result.stats.accepted_per_step[0]] += 1
    assert (first_step > 30).all(), first_step  # the first step stops at every position, or accepts all
    law = _exact_law_after_first(pair.target.model, prompt, vocab, 4, sampling)
    assert _pooled_pvalue(counts, law) > P_MIN
    # ... and this sample size would catch emitting the draft's own law
    draft_law = _exact_law_after_first(pair.draft.model, prompt, vocab, 4, sampling)
    assert _pooled_pvalue((draft_law * n).round(), law) < 1e-6


def test_cpu_argmax_is_torch_argmax_with_ties_infinities_and_nans():
    """The amax-based CPU argmax returns torch's first maximum on every row: ties (rounded values),
    all -inf rows, +inf, NaN rows (torch's NaN-is-max), and any leading shape."""
    from dropmatch.sampling import argmax

    g = torch.Generator().manual_seed(0)
    vocab = 16 * 1024 + 64 * 3  # blocks of 64
    x = (torch.randn(7, 3, vocab, generator=g) * 2).round()  # many tied maxima per row
    x[0, 0] = -math.inf
    x[1, 1, 17] = math.inf
    x[1, 1, 3000] = math.inf
    x[4, 0, vocab - 1] = 99.0  # the last entry
    with_nan = x.clone()
    with_nan[2, 2, 40] = math.nan  # a NaN row sends the whole call to torch's argmax
    for logits in (x, x[3, 0], x.reshape(21, vocab), x[..., : 16 * 1024], x.double(), torch.zeros(2, 16 * 1024),
                   torch.zeros(4, 9), with_nan):
        assert torch.equal(argmax(logits), logits.argmax(-1))
    assert bool((x == x.amax(-1, keepdim=True)).sum(-1).gt(1).any())  # ties really occur


@pytest.mark.parametrize("length", [64 * 64 * 4, 64 * 64 * 4 + 3, 100])  # two levels; not whole blocks; short
def test_indices_at_least_equal_nonzero_of_the_comparison(length):
    """The index pick (and the pick of a mask's set entries) returns the ascending indices ``nonzero`` gives,
    wherever the entries that reach the threshold lie: none, one, clustered, spread, all; NaN entries and
    infinities."""
    from dropmatch.sampling import indices_at_least, true_indices
    g = torch.Generator().manual_seed(3)
    values = torch.randn(length, generator=g)
    values[:length // 8] += 4.0  # a cluster of high entries in the low indices
    values[length // 2] = math.nan
    values[length - 1] = math.inf
    values[length // 3] = -math.inf
    for threshold in (math.inf, 1e39, 10.0, 4.0, 2.5, 0.0, -1e39, -math.inf):  # +-1e39: beyond float32's range
        expected = (values >= threshold).nonzero().flatten()
        assert torch.equal(indices_at_least(values, threshold), expected), threshold
        assert torch.equal(true_indices(values >= threshold), expected), threshold


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["numpy", "blocked"])
@pytest.mark.parametrize("length", [64 * 64 * 4, 64 * 64 * 4 + 3, 100])
def test_rows_at_least_equal_nonzero_of_the_rowwise_comparison(length, dtype):
    """Every row against its own threshold, in one call: the (row, column) pairs ``nonzero`` gives, in
    row-major order, for rows where no entry, some entries or every entry reaches it, with NaN entries,
    infinities and a NaN threshold; by NumPy (float32) and by the blocked search (bfloat16, which NumPy lacks)."""
    from dropmatch.sampling import rows_at_least
    g = torch.Generator().manual_seed(4)
    values = torch.randn(5, length, generator=g).to(dtype)
    values[1, : length // 8] += 4.0
    values[2, length // 2] = math.nan
    values[3, length - 1] = math.inf
    values[4, length // 3] = -math.inf
    thresholds = torch.tensor([math.inf, 2.5, 0.0, -math.inf, math.nan]).to(dtype)
    rows, cols = rows_at_least(values, thresholds)
    want_rows, want_cols = (values >= thresholds[:, None]).nonzero(as_tuple=True)
    assert torch.equal(rows, want_rows) and torch.equal(cols, want_cols)
    assert set(rows.tolist()) == {1, 2, 3}  # row 0 (inf) and row 4 (NaN threshold) have none
