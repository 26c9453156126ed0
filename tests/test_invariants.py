"""Invariants the other tests lean on: literal mode, the greedy reference, SD = AR on the device check."""

from __future__ import annotations

import pytest
import torch

from dropmatch.benchmarks.gpu_check import sd_ar_mismatch
from dropmatch.drafters import ModelDrafter
from dropmatch.engine import generate
from dropmatch.methods import Decoder, MethodConfig, build_rule
from dropmatch.rules import RelaxedVerification, VerifyInput
from dropmatch.runner import GreedyReference
from dropmatch.sampling import SamplingConfig

from .conftest import random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (tests/conftest.py)


class FixedCriterion:
    """A criterion that answers ``answer`` everywhere and records the positions it is asked about."""

    name = "fixed"

    def __init__(self, answer: bool):
        self.answer, self.asked = answer, []

    def prepare(self, inp: VerifyInput):
        def test(j: int) -> bool:
            self.asked.append(j)
            return self.answer

        return test


def _greedy_input(wrong_at: int = 2, n: int = 4, vocab: int = 7) -> VerifyInput:
    """A greedy verify input whose draft is the target argmax except at ``wrong_at``."""
    logits = torch.randn(n + 1, vocab, generator=torch.Generator().manual_seed(0))
    draft = logits[:n].argmax(-1)
    draft[wrong_at] = (draft[wrong_at] + 1) % vocab
    return VerifyInput(draft, None, logits, torch.zeros(n + 1, 3), SamplingConfig(), torch.Generator())


def test_literal_mode_puts_standard_accepts_to_the_criterion():
    inp = _greedy_input()
    argmax = inp.target_logits.argmax(-1).tolist()
    default, literal = FixedCriterion(False), FixedCriterion(False)
    v = RelaxedVerification(default).verify(inp)
    assert default.asked == [2] and (v.n_accepted, v.next_token, v.criterion_evaluations) == (2, argmax[2], 1)
    v = RelaxedVerification(literal, keep_standard_accepts=False).verify(inp)
    assert literal.asked == [0, 1, 2]  # also asked where exact match accepts
    # greedy: rejecting a draft token equal to the argmax would emit that very token, so it is kept
    assert (v.n_accepted, v.next_token, v.criterion_evaluations, v.extra_accepts) == (2, argmax[2], 3, 0)
    accept_all = FixedCriterion(True)
    v = RelaxedVerification(accept_all, keep_standard_accepts=False).verify(inp)
    assert accept_all.asked == [0, 1, 2, 3]
    assert (v.n_accepted, v.next_token, v.criterion_evaluations, v.extra_accepts) == (4, argmax[4], 4, 1)


def test_literal_mode_under_sampling_rejects_what_the_standard_rule_accepts():
    """With q = p the standard rule accepts every position surely; a criterion that rejects all
    stops a literal step at position 0, while the default mode never asks it."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, generator=gen)
    sampling = SamplingConfig(1.0)
    probs = sampling.probs(logits)
    draft = torch.tensor([int(torch.multinomial(probs[j], 1, generator=gen)) for j in range(3)])
    inp = VerifyInput(draft, probs[:3], logits, torch.zeros(4, 3), sampling, gen)
    default, literal = FixedCriterion(False), FixedCriterion(False)
    assert RelaxedVerification(default).verify(inp).n_accepted == 3 and default.asked == []
    v = RelaxedVerification(literal, keep_standard_accepts=False).verify(inp)
    assert (v.n_accepted, v.criterion_evaluations) == (0, 1) and literal.asked == [0]


def test_literal_dropmatch_end_to_end(tiny):
    """Literal DropMatch on the tiny pair: the criterion is evaluated at every examined position
    (min(accepted + 1, drafted) per step); at p_drop = 0 (every head is the target) it equals AR."""
    for p_drop in (0.0, 0.5):
        config = MethodConfig("dropmatch", p_drop=p_drop, literal=True, head_dtype="float32", draft_len=4)
        rule = build_rule(tiny.target, config)
        assert rule.name.endswith("-literal")
        default_rule = build_rule(tiny.target, MethodConfig("dropmatch", p_drop=p_drop, head_dtype="float32"))
        for seed in range(2):
            prompt = random_prompt(seed)
            run = {name: generate(tiny.target, prompt, drafter=ModelDrafter(tiny.draft), rule=r, draft_len=4,
                                  max_new_tokens=24, seed=seed)
                   for name, r in (("literal", rule), ("default", default_rule))}
            s = run["literal"].stats
            assert sum(s.accepted_per_step) + s.target_tokens == s.new_tokens == 24
            assert s.criterion_evaluations == sum(min(a + 1, d) for a, d in
                                                  zip(s.accepted_per_step, s.drafted_per_step, strict=True))
            assert s.criterion_evaluations > run["default"].stats.criterion_evaluations
            if p_drop == 0.0:
                ar = generate(tiny.target, prompt, max_new_tokens=24).token_ids
                assert run["literal"].token_ids == run["default"].token_ids == ar and s.extra_accepts == 0


def test_greedy_reference_is_autoregressive_and_equals_sd(tiny, tmp_path):
    """Fidelity is measured against AR; on the tiny pair in float32, SD gives the same tokens."""
    reference = GreedyReference(tiny, stop=(), max_new_tokens=24, cache=tmp_path / "ref.jsonl")
    assert reference.decoder.config.method == "ar" and reference.decoder.drafter is None
    sd = Decoder(tiny, MethodConfig("sd"))
    for seed in range(2):
        prompt = random_prompt(seed).tolist()
        ar = generate(tiny.target, prompt, max_new_tokens=24, eos_token_ids=tiny.eos_token_ids).token_ids
        assert reference(prompt) == ar == sd.generate(prompt, max_new_tokens=24).token_ids
    cached = GreedyReference(tiny, stop=(), max_new_tokens=24, cache=tmp_path / "ref.jsonl")
    assert cached(random_prompt(0).tolist()) == reference(random_prompt(0).tolist())


def test_sd_ar_mismatch_is_zero_on_cpu_float32(tiny):
    prompts = [random_prompt(seed).tolist() for seed in range(3)]
    report = sd_ar_mismatch(tiny, prompts, max_new_tokens=24)
    assert report["prompts"] == 3 and report["tokens"] >= 4
    assert report["prompt_mismatch_rate"] == report["token_mismatch_rate"] == 0.0


def test_sd_ar_mismatch_counts_a_difference(tiny, monkeypatch):
    """The report can say "differ": a decoder whose SD output is off by one token at position 3."""
    real = Decoder.generate

    def skewed(self, prompt, max_new_tokens=64, seed=0, stop=()):
        result = real(self, prompt, max_new_tokens, seed, stop)
        if self.config.method == "sd":
            result.token_ids[3] = (result.token_ids[3] + 1) % 259
        return result

    monkeypatch.setattr(Decoder, "generate", skewed)
    report = sd_ar_mismatch(tiny, [random_prompt(0).tolist(), random_prompt(1).tolist()], max_new_tokens=10)
    assert report["prompts_differing"] == 2 and report["tokens_differing"] == 2 and report["tokens"] == 20
    assert report["mean_first_divergence"] == 3 and report["token_mismatch_rate"] == 0.1
