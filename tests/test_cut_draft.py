"""Cutting a greedy draft at a position the target certainly rejects (``exact_match_prefix``, ``cut_draft``):
the rule's verdict is that of the whole draft, the head runs on fewer rows, and nothing is cut where
rounding could decide, under sampling, or for a rule that may keep what exact matching rejects."""

from __future__ import annotations

import pytest
import torch

from dropmatch.drafters import Draft, ModelDrafter, NgramDrafter
from dropmatch.engine import cut_draft, generate
from dropmatch.methods import MethodConfig, build_rule
from dropmatch.rules import (
    RelaxedVerification,
    StandardVerification,
    exact_match_prefix,
    exact_match_when_greedy,
)
from dropmatch.sampling import SamplingConfig

from .conftest import random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (tests/conftest.py)


def _prefix(draft: list[int], candidates: list[int], logits: list[list[float]], bound: float = 0.0) -> int:
    logits_t = torch.tensor(logits)
    return exact_match_prefix(torch.tensor(draft), torch.tensor(candidates), logits_t,
                              torch.full_like(logits_t, bound))


def test_prefix_stops_at_the_first_row_a_candidate_outscores():
    # candidates 2, 5, 9 (columns 0, 1, 2); draft 5, 9, 2, 5
    top5, top9, top2 = [0.0, 3.0, 1.0], [0.0, 1.0, 3.0], [4.0, 3.0, 1.0]
    assert _prefix([5, 9, 2, 5], [2, 5, 9], [top5, top5, top2, top9]) == 1  # row 1: 5 beats 9
    assert _prefix([5, 9, 2, 5], [2, 5, 9], [top5, top9, top2, top9]) == 3  # row 3: 9 beats 5
    assert _prefix([5, 9, 2, 5], [2, 5, 9], [top2, top9, top2, top9]) == 0  # the first of two
    assert _prefix([5, 2], [2, 5, 9], [top5, top2]) == 2  # no row beaten: the whole draft
    assert _prefix([], [2, 5, 9], torch.zeros(0, 3).tolist()) == 0


def test_a_draft_token_never_outscores_itself():
    """Equal logits are no certain rejection (the draft token's own column, or a tie that the argmax's
    first-index rule might settle either way)."""
    assert _prefix([5, 9], [2, 5, 9], [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]) == 2


@pytest.mark.parametrize("gap, cut", [(0.39, False), (0.41, True)])
def test_a_gap_within_the_rounding_bounds_cuts_nothing(gap, cut):
    """A candidate counts only where its logit minus twice its bound exceeds the draft token's plus
    twice its bound: with bounds of 0.1 each, a gap above 0.4."""
    assert _prefix([5, 2], [2, 5], [[gap, 0.0], [1.0, 0.0]], bound=0.1) == (0 if cut else 2)


def test_token_logits_bound_the_head_and_the_exact_products(tiny):
    """Both the token logits and the head's own float32 logits lie within the bound of the float64 products."""
    target = tiny.target
    assert target.bounds_token_logits
    hidden = torch.randn(5, target.head_weight.shape[1], generator=torch.Generator().manual_seed(0)) * 30
    ids = torch.tensor([0, 7, 100, 258])
    logits, bounds = target.token_logits(hidden, ids)
    exact = hidden.double() @ target.head_weight[ids].double().T
    head = target.head(hidden)[:, ids]
    assert ((logits.double() - exact).abs() <= bounds).all()
    assert ((head.double() - exact).abs() <= bounds).all()
    assert (bounds > 0).all() and (bounds < 1e-3 * exact.abs().max()).all()  # a bound, not a blanket


def test_cut_draft_keeps_rows_up_to_the_rejected_one(tiny):
    """Where the argmax of row 1 is among the seen tokens and is not the draft token, the cut keeps
    rows 0 and 1 and the first draft token (with its rows of draft distributions)."""
    target = tiny.target
    hidden = torch.randn(4, target.head_weight.shape[1], generator=torch.Generator().manual_seed(1))
    argmax = target.head(hidden).argmax(-1)
    tokens = argmax[:3].clone()
    tokens[1] = (tokens[1] + 1) % target.vocab_size
    probs = torch.rand(3, target.vocab_size)
    cut_hidden, cut = cut_draft(target, hidden, Draft(tokens, probs), seen=argmax[1:2])
    assert cut.tokens.tolist() == tokens[:1].tolist() and torch.equal(cut_hidden, hidden[:2])
    assert torch.equal(cut.probs, probs[:1]) and cut.logits is None
    outside = Draft(torch.tensor([0, target.vocab_size]))  # left whole, for check_draft's clear error
    assert cut_draft(target, hidden[:3], outside, seen=argmax)[1] is outside


def _runs(pair, prompt, drafter_factory, **kwargs):
    return [generate(pair.target, prompt, drafter=drafter_factory(), max_new_tokens=40, cut_drafts=cut, **kwargs)
            for cut in (True, False)]


@pytest.mark.parametrize("arch", ["tiny", "tiny_gemma"])
def test_cut_drafts_give_the_same_steps_on_fewer_head_rows(arch, request):
    """Greedy SD with cut drafts equals AR, and step for step the uncut run (a cut too early would keep
    fewer tokens a step); the prompt holds every token id, so every rejection can be seen."""
    pair = request.getfixturevalue(arch)
    cut_rows = full_rows = 0
    for seed in range(6):
        prompt = torch.cat([torch.arange(pair.target.vocab_size), random_prompt(seed)])
        ar = generate(pair.target, prompt, max_new_tokens=40).token_ids
        for factory, draft_len in ((lambda: ModelDrafter(pair.draft), 6), (NgramDrafter, 5)):
            cut, whole = _runs(pair, prompt, factory, draft_len=draft_len)
            assert cut.token_ids == whole.token_ids == ar, seed
            assert cut.stats.accepted_per_step == whole.stats.accepted_per_step
            assert whole.stats.head_rows_per_step == [d + 1 for d in whole.stats.drafted_per_step]
            cut_rows += sum(cut.stats.head_rows_per_step)
            full_rows += sum(whole.stats.head_rows_per_step)
    assert cut_rows < 0.8 * full_rows


class _Repeat:
    """A drafter that proposes ``token`` again and again, so that only the context can show a rejection."""

    name = "repeat"

    def __init__(self, token: int):
        self.token = token

    def start(self, prompt_ids, features=None) -> None:
        pass

    def propose(self, last_token, n, sampling, generator) -> Draft:
        return Draft(torch.full((n,), self.token))

    def commit(self, n_accepted, features=None) -> None:
        pass


def test_the_emitted_tokens_join_the_seen_ones(tiny):
    """A prompt of one token and a draft of one repeated token: the rejections that the cut sees are
    those of tokens emitted since the prompt."""
    ar = generate(tiny.target, torch.tensor([5]), max_new_tokens=40).token_ids
    token = next(t for t in range(tiny.target.vocab_size) if t not in ar)
    cut, whole = _runs(tiny, torch.tensor([5]), lambda: _Repeat(token), draft_len=4)
    assert cut.token_ids == whole.token_ids == ar
    assert sum(cut.stats.head_rows_per_step) < 0.5 * sum(whole.stats.head_rows_per_step)


def test_nothing_is_cut_under_sampling_or_for_relaxed_rules(tiny):
    prompt = torch.cat([torch.arange(tiny.target.vocab_size), random_prompt(0)])
    sampling = SamplingConfig(temperature=1.0)
    dropmatch = build_rule(tiny.target, MethodConfig("dropmatch", k=3, p_drop=0.3, criterion="js+majority"))
    assert isinstance(dropmatch, RelaxedVerification)
    assert exact_match_when_greedy(StandardVerification()) and not exact_match_when_greedy(dropmatch)
    for kwargs in (dict(sampling=sampling), dict(rule=dropmatch)):
        stats = generate(tiny.target, prompt, drafter=ModelDrafter(tiny.draft), draft_len=6, max_new_tokens=40,
                         **kwargs).stats
        assert stats.head_rows_per_step == [d + 1 for d in stats.drafted_per_step], kwargs
