"""Model loading: vocabularies, offline errors, the int8 draft, the screened head."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from dropmatch import models
from dropmatch.errors import ConfigError, ModelNotFoundError, VocabularyMismatchError
from dropmatch.heads.screened import ScreenedHead
from dropmatch.models import (
    ByteTokenizer,
    CausalLM,
    check_same_tokenizer,
    int8_draft,
    load_pair,
    pair_vocabularies,
    tiny_config,
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


def test_local_directory_without_tokenizer_or_weights_says_which(tmp_path):
    """A folder with a config.json alone names the missing part, not 'not a local directory'."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=300)
    bare = tmp_path / "bare"
    config.save_pretrained(bare)
    with pytest.raises(ModelNotFoundError, match=f"cannot load a tokenizer from the directory {bare}"):
        load_pair(None, target=str(bare), draft=str(bare), device="cpu")
    with pytest.raises(ModelNotFoundError, match=f"cannot load model weights from the directory {bare}"):
        models._from_pretrained(AutoModelForCausalLM, str(bare))
    LlamaForCausalLM(config).save_pretrained(bare)  # weights present: it loads
    assert models._from_pretrained(AutoModelForCausalLM, str(bare)).config.vocab_size == 300


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


@pytest.mark.parametrize("vocab", [5000, 8192])  # 8192: whole blocks, so candidates come from the two-level search
@pytest.mark.parametrize("seed", range(5))
def test_screened_head_argmax_is_exact_and_bound_holds(seed, vocab):
    g = torch.Generator().manual_seed(seed)
    d = 64
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

    from .conftest import random_prompt, screened_heads

    with screened_heads(tiny.target):
        for seed in range(4):
            prompt = random_prompt(seed)
            ar = generate(tiny.target, prompt, max_new_tokens=32).token_ids
            sd = generate(tiny.target, prompt, drafter=ModelDrafter(tiny.draft), max_new_tokens=32).token_ids
            assert sd == ar


def test_screened_head_breaks_exact_ties_as_argmax_does_whatever_else_it_recomputes():
    """Tokens 3 and 97 have the same row, so the same logit: the argmax is 3, the first, however many
    other tokens are recomputed beside them (a float32 product over the gathered rows rounded them by
    their place in the set: 97 won with refine margin 0)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 640, generator=g) * 1e-3
    hidden = torch.randn(1, 640, generator=g) * 1e3
    weight[97] = weight[3] = torch.randn(640, generator=g) * 0.05
    for margin in (0.0, 0.5, 4.0, 1e4):
        logits = ScreenedHead(weight, refine_margin=margin)(hidden.clone())
        assert logits[0, 3] == logits[0, 97] and int(logits.argmax(-1)) == 3, margin


def test_screened_head_fallback_is_exact_float32():
    """Rows with more candidates than ``max_refined`` are recomputed fully in float32: exact values
    on every token of those rows (the screened path leaves the unlikely ones in bfloat16)."""
    g = torch.Generator().manual_seed(7)
    vocab, d = 3000, 64
    weight = torch.randn(vocab, d, generator=g) / d**0.5
    hidden = torch.randn(5, d, generator=g) * 8
    exact = torch.stack([F.linear(row, weight) for row in hidden])
    screened = ScreenedHead(weight)(hidden)
    assert not torch.equal(screened, exact)  # the normal path is not exact everywhere
    fallback = ScreenedHead(weight, max_refined=0)(hidden)  # every row falls back
    assert torch.equal(fallback, exact) and torch.equal(fallback.argmax(-1), exact.argmax(-1))
    # mixed: a near-zero row has every token within the margin, more than max_refined -> fallback
    hidden[0] *= 1e-3
    exact = torch.stack([F.linear(row, weight) for row in hidden])
    mixed = ScreenedHead(weight, max_refined=vocab // 2)(hidden)
    assert torch.equal(mixed[0], exact[0])
    assert torch.equal(mixed.argmax(-1), exact.argmax(-1))
    assert not torch.equal(mixed[1:], exact[1:])


class _ScaledLlama(LlamaForCausalLM):
    """Logits that are not lm_head(last hidden state): scaled by 2 after the head."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_check_split_refuses_logits_that_are_not_the_head():
    torch.manual_seed(0)
    CausalLM(LlamaForCausalLM(tiny_config("llama"))).check_split()  # the plain model passes
    torch.manual_seed(0)
    refusal = r"_ScaledLlama does not compute its logits as lm_head\(last hidden state\)"
    with pytest.raises(ConfigError, match=refusal):
        CausalLM(_ScaledLlama(tiny_config("llama"))).check_split()


def _tiny_gemma2(softcap: float, noise: float = 0.1) -> tuple[CausalLM, CausalLM]:
    """A random Gemma-2 target with final-logit soft-capping (sliding window 8 on one of two layers)
    and a noisy copy as draft."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                          sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                          final_logit_softcapping=softcap, max_position_embeddings=8192, initializer_range=0.2,
                          tie_word_embeddings=False, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config).eval()
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * param.std() * noise if param.numel() > 1 else 0)
    return CausalLM(target), CausalLM(draft)



def test_gemma2_softcap_head_sd_and_dropout_heads(one_thread):
    """CausalLM.head applies Gemma-2's final-logit cap (it equals the model's own logits), greedy SD
    equals AR on the capped model, and DropMatch heads at p_drop = 0 are the capped logits."""
    from dropmatch.drafters import ModelDrafter
    from dropmatch.engine import generate
    from dropmatch.methods import dropout_head

    from .conftest import random_prompt

    cap = 1.5
    target, draft = _tiny_gemma2(cap)
    assert target.softcap == cap
    target.check_split()
    ids = random_prompt(0, max_len=20)
    ids = torch.cat([ids, ids])  # past the sliding window
    with torch.no_grad():
        model_logits = target.model(ids.view(1, -1)).logits[0].float()
        hidden = target.trunk(input_ids=ids.view(1, -1)).last_hidden_state[0]
        raw = target.lm_head(hidden).float()
    head = target.head(hidden)
    torch.testing.assert_close(head, model_logits, atol=1e-5, rtol=1e-5)
    assert raw.abs().max() > 2 * cap and head.abs().max() < cap  # the cap is active, and applied
    for p_drop, atol in ((0.0, 1e-5), (0.3, None)):
        heads = dropout_head(target, k=3, p_drop=p_drop, head_dtype="float32")
        logits = heads.logits(hidden, head, heads.draw_masks(len(ids), torch.Generator().manual_seed(0)))
        if atol is not None:
            for i in range(3):
                torch.testing.assert_close(logits[:, i], model_logits, atol=atol, rtol=1e-5)
        else:
            assert logits.abs().max() < cap and not torch.allclose(logits[:, 0], head)
    for seed in range(3):
        prompt = random_prompt(seed)
        ar = generate(target, prompt, max_new_tokens=24).token_ids
        for draft_len in (1, 4):
            sd = generate(target, prompt, drafter=ModelDrafter(draft), draft_len=draft_len, max_new_tokens=24)
            assert sd.token_ids == ar, (seed, draft_len)
        assert any(a < d for a, d in zip(sd.stats.accepted_per_step, sd.stats.drafted_per_step, strict=True))


def test_verify_step_screens_only_for_rules_that_take_screened_logits(tiny):
    """Greedy verify steps hand screened logits only to rules that say they take them; every other rule
    (rivals reading probabilities, DropMatch told not to) gets the float32 head, bit for bit."""
    from dropmatch.drafters import Draft
    from dropmatch.engine import verify_step
    from dropmatch.heads.dropout import DropoutHead
    from dropmatch.rules import AnyOf, RelaxedVerification, StandardVerification, TopK
    from dropmatch.rules.dropmatch import DropMatch
    from dropmatch.sampling import SamplingConfig

    from .conftest import screened_heads

    class Recording(StandardVerification):
        def __init__(self, ok: bool):
            self.screened_logits_ok, self.seen = ok, None

        def verify(self, inp):
            self.seen = inp
            return super().verify(inp)

    target = tiny.target
    hidden = torch.randn(6, target.head_weight.shape[1], generator=torch.Generator().manual_seed(0))
    draft = Draft(torch.tensor([3, 4, 5, 6, 7]), None)
    with screened_heads(target), torch.inference_mode():  # both heads as verify steps run them (no autograd)
        exact = target.head(hidden)
        screened = target.head(hidden, exact=False)
        assert not torch.equal(screened, exact)  # the tiny pair's screened head is inexact off the top
        for ok, sampling in ((True, SamplingConfig()), (False, SamplingConfig()), (True, SamplingConfig(0.8, 1.0))):
            rule = Recording(ok)
            verify_step(target, rule, hidden, draft, sampling, torch.Generator().manual_seed(0))
            takes = ok and sampling.greedy
            assert rule.seen.logits_screened == takes
            assert torch.equal(rule.seen.target_logits, screened if takes else exact)

    weight = target.head_weight
    sparse32 = DropoutHead(weight, 5, 0.03, compute_dtype=torch.float32, sparse=True)
    for criterion in ("js+majority", "js", "naive"):  # DropMatch certifies every decision on screened logits
        assert RelaxedVerification(DropMatch(sparse32, criterion)).screened_logits_ok
    assert RelaxedVerification(DropMatch(DropoutHead(weight, 5, 0.3, exact_rows=True), "js+majority")).screened_logits_ok
    assert RelaxedVerification(DropMatch(DropoutHead(weight, 5, 0.3, sparse=False), "js+majority")).screened_logits_ok
    assert not RelaxedVerification(DropMatch(sparse32, "naive", screened_clean_logits=False)).screened_logits_ok
    assert not RelaxedVerification(TopK(3)).screened_logits_ok
    assert not AnyOf([DropMatch(sparse32, "naive"), TopK(3)]).screened_logits_ok
    assert AnyOf([DropMatch(sparse32, "naive")]).screened_logits_ok


def test_unusable_devices_are_clear_errors():
    from dropmatch.models import resolve_device

    with pytest.raises(ConfigError, match="unknown device"):
        load_pair("tiny", device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            load_pair("tiny", device="cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_screened_head_of_no_rows_is_empty():
    weight = torch.randn(8192, 32)
    assert ScreenedHead(weight)(torch.zeros(0, 32)).shape == (0, 8192)


@pytest.mark.parametrize("assign", [False, True], ids=["copied-in", "assigned"])
@pytest.mark.parametrize("screened", [False, True], ids=["float32-head", "screened-head"])
def test_a_checkpoint_loaded_into_a_wrapped_model_is_what_decodes(screened, assign):
    """Loading other weights into a model after CausalLM wrapped it and decoded (its packed trunk
    layers, its head's bfloat16 copy, screened head and oneDNN kernel all built), copied into its tensors
    or assigned as new ones: it then decodes as the other model does, token for token and logit for logit."""
    from dropmatch.engine import generate

    from .conftest import random_prompt

    model, other = tiny_pair(seed=0)[0], tiny_pair(seed=7)[0]
    wrapped, reference = CausalLM(model, fast_head=screened), CausalLM(other, fast_head=screened)
    if screened:
        wrapped.screen_max_rows = reference.screen_max_rows = 1 << 30
    prompt = random_prompt(3)
    before = generate(wrapped, prompt, max_new_tokens=24).token_ids
    hidden = torch.randn(4, model.config.hidden_size)
    with torch.inference_mode():
        wrapped.head(hidden, exact=not screened)  # the head's copies exist
    model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=assign)
    expected = generate(reference, prompt, max_new_tokens=24).token_ids
    assert expected != before  # the two models differ, so the test can tell them apart
    assert generate(wrapped, prompt, max_new_tokens=24).token_ids == expected
    with torch.inference_mode():
        torch.testing.assert_close(wrapped.head(hidden, exact=not screened), reference.head(hidden, exact=not screened))


def test_decoding_reorders_each_weight_once(monkeypatch):
    """The weight stamps never move on their own: a second generation reorders nothing for oneDNN and
    keeps the screened head it built (a stamp that changed on every call would repack every step). oneDNN
    serves every few-row call here (the native kernel, where preferred, keeps no copy to reorder)."""
    from dropmatch import onednn_linear
    from dropmatch.drafters import ModelDrafter
    from dropmatch.engine import generate

    from .conftest import random_prompt

    if not onednn_linear.onednn_linear_supported():
        pytest.skip("this torch has no oneDNN linear ops")
    monkeypatch.setattr(onednn_linear, "native_few_rows_preferred", lambda: False)
    target, draft = tiny_pair(seed=0)
    target, draft = CausalLM(target, fast_head=True), CausalLM(draft)
    target.screen_max_rows = 1 << 30
    reorders: list[tuple[int, ...]] = []
    real = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, *a: reorders.append(tuple(w.shape)) or real(w, *a))
    for drafter in (None, ModelDrafter(draft)):
        generate(target, random_prompt(1), drafter=drafter, max_new_tokens=16)
    first, screened = len(reorders), target._screened
    assert first >= target.packed_linears and screened is not None
    for drafter in (None, ModelDrafter(draft)):
        generate(target, random_prompt(2), drafter=drafter, max_new_tokens=16)
    assert len(reorders) == first and target._screened is screened
