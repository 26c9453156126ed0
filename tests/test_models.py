"""Model loading: vocabularies, offline errors, the int8 draft, the screened head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dropmatch.errors import ConfigError, ModelNotFoundError, VocabularyMismatchError
from dropmatch.heads.screened import ScreenedHead
from dropmatch.models import (
    ByteTokenizer,
    check_same_tokenizer,
    int8_draft,
    load_pair,
    pair_vocabularies,
    tiny_pair,
)


def test_load_tiny_pairs():
    for name in ("tiny", "tiny-gemma"):
        pair = load_pair(name, device="cpu")
        assert pair.target.vocab_size == pair.draft.vocab_size == len(pair.tokenizer)
        assert pair.decode(pair.encode("héllo")) == "héllo"
        assert pair.eos_token_ids == (1,)


def test_padding_only_vocab_difference_is_allowed():
    target, _ = tiny_pair(vocab_size=320)  # 61 padding rows past the 259 tokens
    _, draft = tiny_pair(vocab_size=288, seed=1)
    t, d = pair_vocabularies(target, draft, n_tokens=259)
    assert t.vocab_size == d.vocab_size == 288
    hidden = torch.zeros(1, 64)
    assert t.head(hidden).shape == (1, 288)


def test_real_vocab_mismatch_is_refused():
    target, _ = tiny_pair(vocab_size=259)
    _, draft = tiny_pair(vocab_size=200, seed=1)
    with pytest.raises(VocabularyMismatchError, match="not padding"):
        pair_vocabularies(target, draft, n_tokens=259)


def test_different_tokenizers_are_refused():
    class Other(ByteTokenizer):
        def get_vocab(self):
            vocab = super().get_vocab()
            vocab["<5>"], vocab["<6>"] = 6, 5
            return vocab

    check_same_tokenizer(ByteTokenizer(), ByteTokenizer(), "a", "b")
    with pytest.raises(VocabularyMismatchError, match="different vocabularies"):
        check_same_tokenizer(ByteTokenizer(), Other(), "org/target", "org/draft")


def test_unknown_model_offline_says_how_to_pass_local_weights(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="local") as info:
        load_pair(None, target="no-such-org/no-such-model", draft="no-such-org/tiny", device="cpu")
    assert "--target DIR" in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="holds no loadable model"):
        load_pair(None, target=str(empty), draft=str(empty), device="cpu")


def test_local_directory_pair_round_trip(tmp_path):
    """Hugging Face ids and local directories go through the same path (here: saved tiny models)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target, draft = tiny_pair(vocab_size=300)
    vocab = {f"t{i}": i for i in range(300)}
    tok = PreTrainedTokenizerFast(tokenizer_object=_word_tokenizer(Tokenizer, models, pre_tokenizers, vocab),
                                  eos_token="t1", bos_token="t2", pad_token="t0", unk_token="t3")
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    pair = load_pair(None, target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), dtype="float32",
                     device="cpu")
    assert pair.target.vocab_size == 300
    torch.testing.assert_close(pair.target.head_weight, target.lm_head.weight)


def _word_tokenizer(Tokenizer, models, pre_tokenizers, vocab):
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def test_bad_pair_arguments():
    with pytest.raises(ConfigError, match="unknown pair"):
        load_pair("gpt-5")
    with pytest.raises(ConfigError, match="without --target"):
        load_pair(None, draft="x")
    with pytest.raises(ConfigError, match="dtype"):
        load_pair(None, target="x", draft="y", dtype="int4")


def test_int8_draft_unties_and_quantizes_the_head():
    target, _ = tiny_pair(arch="gemma3")
    target.config.tie_word_embeddings = True
    target.tie_weights()
    draft = int8_draft(target)
    assert "quantized" in type(draft.get_output_embeddings()).__module__
    assert target.get_output_embeddings().weight is target.get_input_embeddings().weight  # target untouched
    ids = torch.tensor([[2, 10, 20, 30]])
    with torch.no_grad():
        agree = (draft(ids).logits.argmax(-1) == target(ids).logits.argmax(-1)).float().mean()
    assert agree > 0.5


@pytest.mark.parametrize("seed", range(5))
def test_screened_head_argmax_is_exact_and_bound_holds(seed):
    g = torch.Generator().manual_seed(seed)
    vocab, d = 5000, 64
    weight = torch.randn(vocab, d, generator=g) / d**0.5
    hidden = torch.randn(40, d, generator=g) * 8
    # near-ties: copy the top row of some hidden states with a tiny perturbation
    exact = F.linear(hidden, weight)
    top = exact.argmax(-1)
    weight[top[:10] + 1] = weight[top[:10]] + 1e-4 * torch.randn(10, d, generator=g)
    exact = F.linear(hidden, weight)
    head = ScreenedHead(weight)
    approx = F.linear(hidden.to(torch.bfloat16), head.weight_bf16).float()
    assert bool(((approx - exact).abs() <= head.error_bound(approx, hidden)).all())
    screened = head(hidden)
    assert torch.equal(screened.argmax(-1), exact.argmax(-1))
    likely = exact >= exact.amax(-1, keepdim=True) - 4.0
    torch.testing.assert_close(screened[likely], exact[likely])


def test_forced_screened_head_keeps_sd_equal_to_ar(tiny):
    from dropmatch.drafters import ModelDrafter
    from dropmatch.engine import generate

    from .conftest import random_prompt

    tiny.target.fast_head = True
    try:
        for seed in range(4):
            prompt = random_prompt(seed)
            ar = generate(tiny.target, prompt, max_new_tokens=32).token_ids
            sd = generate(tiny.target, prompt, drafter=ModelDrafter(tiny.draft), max_new_tokens=32).token_ids
            assert sd == ar
    finally:
        tiny.target.fast_head = False
