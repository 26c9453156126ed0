"""In-place KV-cache layers: the same attention inputs, logits and rollbacks as transformers' dynamic layers."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from dropmatch.kv_cache import (
    InPlaceLayer,
    InPlaceSlidingWindowLayer,
    fill_from,
    filled_states,
    use_in_place_layers,
)
from dropmatch.models import CausalLM, load_pair, rollback


def _reference_cache(model):
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


@pytest.mark.parametrize("pair_name", ["tiny", "tiny-gemma"])
def test_in_place_cache_gives_the_logits_of_the_dynamic_cache_through_updates_and_rollbacks(pair_name):
    """Prefill, then steps of 1-4 positions with rollbacks of 0-3, past tiny-gemma's window of 8:
    every step's logits equal those computed with transformers' own cache."""
    target = load_pair(pair_name).target
    ours, _ = target.new_cache(rollback=True)
    assert all(type(layer) in (InPlaceLayer, InPlaceSlidingWindowLayer) for layer in ours.layers) or not ours.layers
    reference = _reference_cache(target.model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (5,), generator=gen)
    steps = [(ids, 0)] + [(torch.randint(0, target.vocab_size, (n,), generator=gen), back)
                          for n, back in [(1, 0), (4, 3), (3, 1), (2, 2), (4, 0), (1, 0), (3, 3), (4, 2)] * 2]
    with torch.inference_mode():
        for step_ids, back in steps:
            got = target.head(target.hidden(step_ids, ours))
            want = target.head(target.hidden(step_ids, reference))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            ours.crop(-back)
            reference.crop(-back)
            assert ours.get_seq_length() == reference.get_seq_length()
    assert ours.get_seq_length() > 8  # the sliding window was passed


def test_swap_replaces_dynamic_layers_only_and_refuses_a_filled_cache():
    cache = DynamicCache(config=load_pair("tiny-gemma").target.model.config)
    kinds = [type(layer) for layer in cache.layers]
    use_in_place_layers(cache)
    swapped = {DynamicLayer: InPlaceLayer, DynamicSlidingWindowLayer: InPlaceSlidingWindowLayer}
    assert [type(layer) for layer in cache.layers] == [swapped[k] for k in kinds]
    filled = DynamicCache(config=load_pair("tiny-gemma").target.model.config)
    filled.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)
    with pytest.raises(ValueError, match="empty cache"):
        use_in_place_layers(filled)


def test_buffer_growth_keeps_old_states_and_crop_refuses_positive_counts():
    layer = InPlaceLayer()
    states = torch.arange(2 * 700 * 3, dtype=torch.float32).view(1, 2, 700, 3)
    layer.update(states[:, :, :100], states[:, :, :100])
    capacity = layer.buffer.keys.shape[-2]
    layer.update(states[:, :, 100:], states[:, :, 100:])  # past the first capacity: grown, old states kept
    assert layer.buffer.keys.shape[-2] > capacity
    torch.testing.assert_close(layer.keys, states)
    layer.crop(-50)
    torch.testing.assert_close(layer.values, states[:, :, :650])
    with pytest.raises(ValueError):
        layer.crop(5)


@pytest.mark.parametrize("n_tokens", [7, -1])
def test_a_refused_rollback_leaves_a_hybrid_cache_whole(n_tokens):
    """LFM2's cache (conv, attention, conv layers) is cropped layer by layer: a count outside [0, cached]
    is refused before the conv layer 0 is cropped, and the cache goes on giving a fresh forward's states."""
    from transformers import AutoModelForCausalLM, Lfm2Config

    config = Lfm2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"],
                        max_position_embeddings=64)
    torch.manual_seed(0)
    target = CausalLM(AutoModelForCausalLM.from_config(config).eval())
    with torch.inference_mode():
        cache, _ = target.new_cache(prompt_ids=torch.tensor([2, 5, 6]))
        target.hidden(torch.tensor([7, 8, 9]), cache)
        with pytest.raises(ValueError, match=f"cannot drop {n_tokens} of 6 cached positions"):
            rollback(cache, n_tokens)
        assert [int(layer.get_seq_length()) for layer in cache.layers] == [6, 6, 6]
        rollback(cache, 2)
        cached = target.hidden(torch.tensor([10, 11]), cache)
        fresh = target.trunk(input_ids=torch.tensor([[2, 5, 6, 7, 10, 11]])).last_hidden_state[0, -2:]
    torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)


def test_filled_states_refill_a_cache_and_refuse_an_empty_layer():
    """A prefill's states, read and written into a fresh cache up to position n, give the cache a prefill of
    the first n tokens builds; a layer the prefill left empty is refused, by its type."""
    target = load_pair("tiny-gemma").target
    ids = torch.arange(3, 15)  # 12 positions, past the window of 8
    with torch.inference_mode():
        full, _ = target.new_cache(rollback=False, prompt_ids=ids)
        part, _ = target.new_cache(rollback=False, prompt_ids=ids[:10])
        refilled, _ = target.new_cache(rollback=False)
        fill_from(refilled, filled_states(full), 10)
    assert refilled.get_seq_length() == part.get_seq_length() == 10
    for a, b in zip(filled_states(refilled), filled_states(part), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    with torch.inference_mode():  # one more token: attention sees the last window's positions alike
        torch.testing.assert_close(target.hidden(torch.tensor([15]), refilled), target.hidden(torch.tensor([15]), part),
                                   rtol=1e-4, atol=1e-5)
    for a, b in zip(refilled.layers, part.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-5)
    assert min(layer.keys.shape[-2] for layer in part.layers) < part.get_seq_length()  # a window was cut
    empty, _ = target.new_cache(rollback=False)
    with pytest.raises(ValueError, match=r"layer 0 \(InPlace.*\) was not filled"):
        filled_states(empty)
    with pytest.raises(ValueError, match="positions"):
        fill_from(empty, filled_states(full), 13)
