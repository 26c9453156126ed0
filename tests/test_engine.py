"""Invariants of the decoding engine on tiny random models (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from dropmatch.drafters import ModelDrafter, NgramDrafter, lookup
from dropmatch.engine import generate
from dropmatch.errors import ConfigError, PromptTooLongError
from dropmatch.models import CausalLM, rollback
from dropmatch.rules import StandardVerification
from dropmatch.sampling import SamplingConfig

from .conftest import random_prompt


@pytest.mark.parametrize("arch", ["tiny", "tiny_gemma"])
def test_greedy_sd_equals_greedy_ar(arch, request):
    """Token for token, for a model drafter at several draft lengths and for n-gram lookup."""
    pair = request.getfixturevalue(arch)
    for seed in range(12):
        prompt = random_prompt(seed)
        ar = generate(pair.target, prompt, max_new_tokens=48).token_ids
        for draft_len in (1, 3, 6):
            sd = generate(pair.target, prompt, drafter=ModelDrafter(pair.draft), draft_len=draft_len,
                          max_new_tokens=48)
            assert sd.token_ids == ar, (seed, draft_len)
        ngram = generate(pair.target, prompt, drafter=NgramDrafter(), draft_len=4, max_new_tokens=48)
        assert ngram.token_ids == ar, seed


@pytest.mark.parametrize("arch", ["tiny", "tiny_gemma"])
def test_greedy_sd_with_a_confidence_stop_equals_greedy_ar(arch, request):
    """A model drafter that ends its proposals after an unconfident token (a dynamic draft length) still
    gives greedy AR's tokens; the stop threshold sits inside the tiny drafts' range of top probabilities,
    so proposals both stop early and run to the full length."""
    pair = request.getfixturevalue(arch)
    lengths: list[int] = []
    for seed in range(8):
        prompt = random_prompt(seed)
        ar = generate(pair.target, prompt, max_new_tokens=40).token_ids
        sd = generate(pair.target, prompt, drafter=ModelDrafter(pair.draft, stop_below=0.08), draft_len=6,
                      max_new_tokens=40)
        assert sd.token_ids == ar, seed
        lengths += sd.stats.drafted_per_step[:-2]  # the last steps are cut by the token budget
    assert 6 in lengths and min(lengths) < 6


def test_sd_actually_speculates(tiny):
    """The equality test above means something only if drafts are accepted and rejected."""
    result = generate(tiny.target, random_prompt(1), drafter=ModelDrafter(tiny.draft), draft_len=4,
                      max_new_tokens=64)
    accepted = result.stats.accepted_per_step
    assert result.stats.tau > 1.3
    assert any(a == 4 for a in accepted) and any(a < 4 for a in accepted)


def test_cache_rollback_exact(tiny_gemma):
    """After rejections, every verify row equals a fresh full forward over the same prefix.

    Run on the sliding-window model with sequences far past its window (8 tokens).
    """
    pair = tiny_gemma
    recorded: list[torch.Tensor] = []

    class Recording(StandardVerification):
        def verify(self, inp):
            recorded.append(inp.target_logits.clone())
            return super().verify(inp)

    prompt = random_prompt(3, max_len=12)
    result = generate(pair.target, prompt, drafter=ModelDrafter(pair.draft), rule=Recording(), draft_len=5,
                      max_new_tokens=60)
    stats = result.stats
    assert any(a < d for a, d in zip(stats.accepted_per_step, stats.drafted_per_step, strict=True))
    sequence = torch.cat([prompt, torch.tensor(result.token_ids)])
    with torch.no_grad():
        full = pair.target.model(sequence.view(1, -1)).logits[0].float()
    emitted = 1  # the prefill emitted one token
    for logits, accepted in zip(recorded, stats.accepted_per_step, strict=True):
        # row j predicts the token after prompt + output[:emitted + j], for the kept rows j <= accepted
        for j in range(accepted + 1):
            position = len(prompt) - 1 + emitted + j
            if position + 1 < len(sequence):
                torch.testing.assert_close(logits[j], full[position], atol=2e-4, rtol=1e-4)
        emitted += accepted + 1


def test_rollback_then_continue_matches_fresh_forward(tiny_gemma):
    target = tiny_gemma.target
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, 259, (n,), generator=g) for n in (20, 6, 7))
    with torch.no_grad():
        cache, _ = target.new_cache(rollback=True, prompt_ids=a)
        target.hidden(b, cache)
        rollback(cache, 4)  # keep b[:2]
        cached = target.head(target.hidden(c, cache))
        fresh = target.model(torch.cat([a, b[:2], c]).view(1, -1)).logits[0, -len(c):].float()
    torch.testing.assert_close(cached, fresh, atol=2e-4, rtol=1e-4)


def test_statistics_add_up(tiny):
    prompt = random_prompt(5)
    ar = generate(tiny.target, prompt, max_new_tokens=30).stats
    assert ar.tau == 1.0 and ar.target_calls == ar.new_tokens == 30
    for drafter in (ModelDrafter(tiny.draft), NgramDrafter()):
        s = generate(tiny.target, prompt, drafter=drafter, draft_len=4, max_new_tokens=30).stats
        assert sum(s.accepted_per_step) + s.target_tokens == s.new_tokens == 30
        assert s.target_calls == 1 + s.verify_steps
        assert s.tau == pytest.approx(s.new_tokens / s.target_calls)
        assert all(0 <= a <= d <= 4 for a, d in zip(s.accepted_per_step, s.drafted_per_step, strict=True))
        rates = s.acceptance_rate_per_position
        assert all(0 <= r <= 1 for r in rates)
        assert rates == sorted(rates, reverse=True)  # reaching position k needs all before it
        assert s.wall_s >= s.draft_s + s.verify_s - 1e-3


def test_stops_at_eos_and_never_past_it(tiny):
    prompt = random_prompt(7)
    free = generate(tiny.target, prompt, max_new_tokens=40).token_ids
    eos = free[17]  # a token the model does emit
    cut = free[: free.index(eos) + 1]
    for drafter in (None, ModelDrafter(tiny.draft), NgramDrafter()):
        result = generate(tiny.target, prompt, drafter=drafter, draft_len=5, max_new_tokens=40,
                          eos_token_ids=[eos])
        assert result.token_ids == cut
        s = result.stats
        assert sum(s.accepted_per_step) + s.target_tokens == s.new_tokens == len(cut)


def test_stop_strings_cut_to_what_plain_decoding_emits(tiny):
    """A speculative step that overshoots a stop string is cut back, statistics included."""
    from dropmatch.methods import Decoder, MethodConfig

    prompt = random_prompt(6)
    free = tiny.decode(generate(tiny.target, prompt, max_new_tokens=60).token_ids)
    stop = next(c for c in free[10:] if c.isascii() and c.isprintable())
    plain = Decoder(tiny, MethodConfig("ar")).generate(prompt, max_new_tokens=60, stop=[stop]).token_ids
    assert stop in tiny.decode(plain) and stop not in tiny.decode(plain[:-1])
    for config in (MethodConfig("sd", draft_len=3), MethodConfig("sd", draft_len=7), MethodConfig("sd", draft="ngram")):
        result = Decoder(tiny, config).generate(prompt, max_new_tokens=60, stop=[stop])
        assert result.token_ids == plain
        s = result.stats
        assert sum(s.accepted_per_step) + s.target_tokens == s.new_tokens == len(plain)


def test_same_seed_same_output_different_seeds_differ(tiny):
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    prompt = random_prompt(2)

    def run(seed):
        return generate(tiny.target, prompt, drafter=ModelDrafter(tiny.draft), draft_len=4, max_new_tokens=32,
                        sampling=sampling, seed=seed).token_ids

    assert run(0) == run(0)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_bad_lengths(tiny):
    with pytest.raises(PromptTooLongError, match="context"):
        generate(tiny.target, torch.full((8190,), 5), max_new_tokens=10)
    with pytest.raises(ConfigError, match="empty"):
        generate(tiny.target, [], max_new_tokens=10)
    with pytest.raises(ConfigError, match="draft length"):
        generate(tiny.target, [2, 5], drafter=NgramDrafter(), draft_len=0)
    vocab = tiny.target.model.get_input_embeddings().num_embeddings
    for prompt, match in (([2, vocab], "token ids"), ([-1, 5], "token ids"), (torch.tensor([[2, 5], [3, 4]]), "one"),
                          (torch.tensor([2.0, 5.0]), "integer")):
        with pytest.raises(ConfigError, match=match):
            generate(tiny.target, prompt, max_new_tokens=4)
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer"):
        generate(tiny.target, [2, 5], max_new_tokens=4.5)
    with pytest.raises(ConfigError, match="draft length must be an integer"):
        generate(tiny.target, [2, 5], drafter=NgramDrafter(), draft_len=2.5)


def test_a_single_eos_id_and_a_one_row_batch_are_accepted(tiny):
    plain = generate(tiny.target, [2, 5, 7], max_new_tokens=6, eos_token_ids=[1]).token_ids
    assert generate(tiny.target, torch.tensor([[2, 5, 7]]), max_new_tokens=6, eos_token_ids=1).token_ids == plain


def test_ngram_lookup():
    assert lookup([1, 2, 3, 9, 1, 2], 3, max_ngram=2) == [3, 9, 1]
    assert lookup([5, 6, 7], 2, max_ngram=3) == []
    # the most recent match wins, and the longest n-gram is tried first
    assert lookup([1, 2, 8, 3, 2, 9, 1, 2], 1, max_ngram=2) == [8]
    assert lookup([4, 2, 8, 3, 2, 9, 1, 2], 1, max_ngram=2) == [9]
    # vLLM's rule: the first occurrence of the longest match
    assert lookup([4, 2, 8, 3, 2, 9, 1, 2], 1, max_ngram=2, earliest=True) == [8]
    assert lookup([1, 2, 8, 3, 1, 2, 9, 1, 2], 2, max_ngram=2, earliest=True) == [8, 3]


@pytest.mark.parametrize("keep", [0, 3])
def test_stop_before_the_last_step_is_cut_at_keep(tiny, keep):
    """``should_stop`` may ask to keep fewer tokens than were out before the last step: every step
    past ``keep`` is cut, not only the last one, and the statistics still add up."""
    prompt = random_prompt(5)
    ar = generate(tiny.target, prompt, max_new_tokens=40).token_ids
    seen: list[int] = []

    def should_stop(output: list[int]) -> int | None:
        seen.append(len(output))
        return keep if len(output) >= 14 else None

    for drafter in (None, ModelDrafter(tiny.draft), NgramDrafter()):
        seen.clear()
        result = generate(tiny.target, prompt, drafter=drafter, draft_len=5, max_new_tokens=40,
                          should_stop=should_stop)
        assert seen[-2] > keep + 1  # the output before the last step already ran past keep
        assert result.token_ids == ar[:keep]
        s = result.stats
        assert sum(s.accepted_per_step) + s.target_tokens == s.new_tokens == keep
        assert all(0 <= a <= d for a, d in zip(s.accepted_per_step, s.drafted_per_step, strict=True))
        assert s.target_calls == 1 + s.verify_steps if drafter is not None else s.target_calls == seen[-1]


def test_draft_model_never_runs_past_its_context(tiny):
    """A draft whose context ends before the target's proposes fewer tokens, then none; greedy SD
    still equals AR, and a prompt longer than the draft's context is a clear error."""
    limit = 24
    draft = CausalLM(tiny.draft.model)
    draft.max_positions = limit
    used: list[int] = []

    def hidden(ids: torch.Tensor, cache) -> torch.Tensor:
        used.append(cache.get_seq_length() + ids.numel())
        return CausalLM.hidden(draft, ids, cache)

    draft.hidden = hidden
    prompt = random_prompt(4, max_len=12)
    ar = generate(tiny.target, prompt, max_new_tokens=40).token_ids
    result = generate(tiny.target, prompt, drafter=ModelDrafter(draft), draft_len=5, max_new_tokens=40)
    assert result.token_ids == ar
    assert max(used) == limit  # up to the end of the draft's context, never past it
    drafted = result.stats.drafted_per_step
    assert drafted[0] == 5 and drafted[-1] == 0 and 0 < min(d for d in drafted if d) < 5, drafted
    sampled = generate(tiny.target, prompt, drafter=ModelDrafter(draft), draft_len=5, max_new_tokens=40,
                       sampling=SamplingConfig(1.0), seed=1)
    assert len(sampled.token_ids) == 40 and max(used) == limit
    with pytest.raises(PromptTooLongError, match="draft model's context of 24"):
        generate(tiny.target, torch.full((limit + 1,), 5), drafter=ModelDrafter(draft), max_new_tokens=4)
