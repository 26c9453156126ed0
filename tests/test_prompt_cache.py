"""A cached prompt prefix (``CausalLM.cache_prefix``, ``generate(prefix=...)``): the cache it starts is the one a
whole-prompt prefill builds, decoding from it gives the same tokens and drafts, and a prefix from another
model or with other feature layers is refused."""

from __future__ import annotations

import pytest
import torch

from dropmatch.drafters import LookupFirstDrafter, ModelDrafter, NgramDrafter
from dropmatch.drafters.eagle3 import Eagle3Drafter
from dropmatch.engine import generate
from dropmatch.errors import ConfigError
from dropmatch.kv_cache import filled_states
from dropmatch.prompt_cache import shared_prefix
from dropmatch.sampling import SamplingConfig

from .test_eagle3 import random_head

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread (tests/conftest.py)


def _prompts(shared: int, tails: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    """Prompts of ``shared`` common tokens, then tails of the given lengths (first tail tokens differ)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 259, (shared,), generator=g)
    return [torch.cat([head, torch.tensor([10 + i]), torch.randint(3, 259, (n - 1,), generator=g)])
            for i, n in enumerate(tails)]


def test_shared_prefix_is_the_longest_common_one():
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7]]) == [1, 2]
    assert shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == [1, 2, 3]
    assert shared_prefix([[5, 2], [1, 2]]) == []
    assert shared_prefix([[1, 2, 3]]) == []  # shared with nothing: nothing to save


def test_usable_length_is_the_shared_part_short_of_the_last_prompt_token(tiny):
    prefix = tiny.target.cache_prefix([4, 5, 6, 7])
    assert prefix.usable_length(torch.tensor([4, 5, 6, 7, 8, 9])) == 4
    assert prefix.usable_length(torch.tensor([4, 5, 9, 7, 8])) == 2  # diverges at position 2
    assert prefix.usable_length(torch.tensor([4, 5, 6, 7])) == 3  # the last position must run
    assert prefix.usable_length(torch.tensor([4, 5])) == 1
    assert prefix.usable_length(torch.tensor([9, 5, 6, 7, 8])) == 0
    assert prefix.usable_length(torch.tensor([4])) == 0


@pytest.mark.parametrize("arch", ["tiny", "tiny_gemma"])
def test_a_started_cache_holds_the_states_of_a_whole_prompt_prefill(arch, request):
    """Keys, values, the last hidden state and the features after prefix + rest match a cold prefill (the
    gemma3 pair's sliding window of 8 is shorter than the prefix)."""
    target = request.getfixturevalue(arch).target
    prompt = _prompts(20, (9,))[0]
    layers = (1, 2)
    prefix = target.cache_prefix(prompt[:20], layers)
    with torch.inference_mode():
        cold, cold_hidden, cold_features = target.new_cache_with_features(prompt, layers)
        warm, warm_hidden, warm_features = target.new_cache_with_features(prompt, layers, prefix=prefix)
    assert warm_hidden.shape[0] == prompt.numel() - 20 and warm_features.shape == cold_features.shape
    torch.testing.assert_close(warm_hidden, cold_hidden[20:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(warm_features, cold_features, rtol=1e-4, atol=1e-5)
    assert warm.get_seq_length() == cold.get_seq_length() == prompt.numel()
    for a, b in zip(filled_states(warm), filled_states(cold), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.inference_mode():  # the next steps attend alike (the window's mask included)
        for ids in ([7], [8, 9, 10]):
            torch.testing.assert_close(target.hidden(torch.tensor(ids), warm), target.hidden(torch.tensor(ids), cold),
                                       rtol=1e-4, atol=1e-5)


def _drafters(pair, head, prefix_of_draft):
    return {"ar": lambda: None,
            "n-gram": NgramDrafter,
            "model": lambda: ModelDrafter(pair.draft, stop_below=0.3, prefix=prefix_of_draft),
            "eagle3": lambda: LookupFirstDrafter(Eagle3Drafter(head, pair.target, 0.3), guide_at=0.5)}


@pytest.mark.parametrize("arch", ["tiny", "tiny_gemma"])
def test_decoding_from_a_prefix_repeats_a_cold_generation(arch, request):
    """Greedy AR and SD started from a cached prefix emit the cold run's tokens, with the same steps and
    acceptances: the drafters (the draft model from its own prefix, EAGLE-3 from the prefix's features)
    proposed the same drafts."""
    pair = request.getfixturevalue(arch)
    prompts = _prompts(30, (6, 11))
    head = random_head(pair.target, draft_vocab=64, seed=3)
    shared = shared_prefix([p.tolist() for p in prompts])
    prefix = pair.target.cache_prefix(shared, Eagle3Drafter(head, pair.target).feature_layers)
    drafters = _drafters(pair, head, pair.draft.cache_prefix(shared))
    for prompt in prompts:
        outputs = set()
        for name, make in drafters.items():
            cold = generate(pair.target, prompt, drafter=make(), draft_len=4, max_new_tokens=40, cut_drafts=False)
            warm = generate(pair.target, prompt, drafter=make(), draft_len=4, max_new_tokens=40, cut_drafts=False,
                            prefix=prefix)
            assert warm.token_ids == cold.token_ids, name
            assert warm.stats.accepted_per_step == cold.stats.accepted_per_step, name
            assert warm.stats.drafted_per_step == cold.stats.drafted_per_step, name
            assert (warm.stats.cached_prompt_tokens, cold.stats.cached_prompt_tokens) == (30, 0)
            outputs.add(tuple(warm.token_ids))
        assert len(outputs) == 1  # SD from the prefix equals AR from it


def test_a_prompt_inside_the_prefix_and_sampling_repeat_cold_runs(tiny_gemma):
    """A prompt the prefix covers whole (its last position still runs) and speculative sampling from a prefix,
    same seed: the cold run's tokens."""
    pair = tiny_gemma
    prompt = _prompts(24, (8,))[0]
    prefix = pair.target.cache_prefix(prompt)
    inside = prompt[:15]
    cold, warm = (generate(pair.target, inside, max_new_tokens=12, prefix=p) for p in (None, prefix))
    assert warm.token_ids == cold.token_ids and warm.stats.cached_prompt_tokens == 14
    sampling = SamplingConfig(temperature=1.0)
    cold, warm = (generate(pair.target, prompt, drafter=ModelDrafter(pair.draft), draft_len=3, max_new_tokens=30,
                           sampling=sampling, seed=7, prefix=p) for p in (None, prefix))
    assert warm.token_ids == cold.token_ids and warm.stats.accepted_per_step == cold.stats.accepted_per_step
    assert warm.stats.cached_prompt_tokens == prompt.numel() - 1


def test_a_prefix_serves_only_its_model_and_its_feature_layers(tiny):
    prompt = _prompts(12, (5,))[0]
    prefix = tiny.target.cache_prefix(prompt[:12], layers=(1,))
    with pytest.raises(ConfigError, match="another model"):
        generate(tiny.draft, prompt, max_new_tokens=2, prefix=prefix)
    head = random_head(tiny.target, draft_vocab=64, seed=3)
    with pytest.raises(ConfigError, match="feature layers"):
        generate(tiny.target, prompt, drafter=Eagle3Drafter(head, tiny.target), max_new_tokens=2, prefix=prefix)
    with pytest.raises(ConfigError, match="at least one token"):
        tiny.target.cache_prefix([])
