"""Fidelity to the target's own greedy output."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dropmatch.engine import generate
from dropmatch.fidelity import compare_to_greedy, first_divergence, summarize_fidelity, target_nll, token_nlls
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.models import CausalLM

from .conftest import random_prompt
from .test_cli import run


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_target_nll_matches_a_direct_forward(tiny):
    prompt, generated = [2, 10, 20], [30, 40, 50, 60]
    with torch.no_grad():
        logits = tiny.target.model(torch.tensor([prompt + generated])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    expected = -logp[torch.arange(4), torch.tensor(generated)].mean()
    assert abs(target_nll(tiny.target, prompt, generated) - float(expected)) < 1e-4


def _direct_nll(pair, prompt: list[int], generated: list[int]) -> float:
    with torch.no_grad():
        logits = pair.target.model(torch.tensor([prompt + generated])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return float(-logp[torch.arange(len(generated)), torch.tensor(generated)].mean())


def test_lossless_is_faithful_and_lossy_is_measured(tiny):
    greedy = Decoder(tiny, MethodConfig("ar"))
    lossy = Decoder(tiny, MethodConfig("dropmatch", p_drop=0.5, criterion="naive"))
    exact, measured, references, outputs = [], [], [], []
    for seed in range(4):
        prompt = random_prompt(seed).tolist()
        reference = greedy.generate(prompt, max_new_tokens=32).token_ids
        sd = Decoder(tiny, MethodConfig("sd")).generate(prompt, max_new_tokens=32).token_ids
        exact.append(compare_to_greedy(tiny.target, prompt, sd, reference))
        out = lossy.generate(prompt, max_new_tokens=32, seed=seed).token_ids
        measured.append(compare_to_greedy(tiny.target, prompt, out, reference))
        references.append((prompt, reference))
        outputs.append((prompt, out))
    summary = summarize_fidelity(exact)
    assert summary["exact_match_rate"] == 1.0 and summary["mean_first_divergence"] is None
    # NLLs against a direct full forward of the wrapped model (no trunk/head split, no cache)
    for f, (prompt, out) in zip(exact + measured, references + outputs, strict=True):
        assert f.nll == pytest.approx(_direct_nll(tiny, prompt, out), abs=1e-4)
    assert summarize_fidelity(measured)["exact_match_rate"] < 1.0


def test_greedy_token_is_likelier_at_the_first_divergence(tiny):
    lossy = Decoder(tiny, MethodConfig("dropmatch", p_drop=0.5, criterion="naive"))
    checked = 0
    for seed in range(4):
        prompt = random_prompt(seed).tolist()
        reference = Decoder(tiny, MethodConfig("ar")).generate(prompt, max_new_tokens=32).token_ids
        out = lossy.generate(prompt, max_new_tokens=32, seed=seed).token_ids
        i = first_divergence(out, reference)
        if i is None or i >= min(len(out), len(reference)):
            continue
        assert token_nlls(tiny.target, prompt, reference)[i] <= token_nlls(tiny.target, prompt, out)[i]
        checked += 1
    assert checked > 0


def test_cli_fidelity(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\\nworld\nabc abc\n")
    out = run("fidelity", "--pair", "tiny", "--method", "dropmatch", "--prompts", str(prompts),
              "--max-new-tokens", "16")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["prompts"] == 2 and len(report["per_prompt"]) == 2
    out = run("generate", "--pair", "tiny", "--method", "sd", "--prompt", "Hi", "--max-new-tokens", "8",
              "--json", "--fidelity")
    assert json.loads(out.stdout)["fidelity"]["exact_match"] is True


# --------------------------------------------------------------------------------------------
# A hand-built target whose every NLL is known: a bigram model over 6 tokens


def _bigram_probs(vocab: int = 6) -> list[list[float]]:
    """After token i: i + 1 with probability 1/2, i + 2 with 1/4, the other four 1/16 each (mod 6)."""
    rows = []
    for i in range(vocab):
        row = [1 / 16] * vocab
        row[(i + 1) % vocab], row[(i + 2) % vocab] = 1 / 2, 1 / 4
        rows.append(row)
    return rows


def _bigram_target(vocab: int = 6) -> CausalLM:
    """A one-layer Llama with every layer weight zero (the residual stream is the embedding), one-hot
    embeddings and an LM head holding log P: its next-token law is exactly :func:`_bigram_probs`."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=4, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=vocab, tie_word_embeddings=False,
                         max_position_embeddings=64, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.model.layers.parameters():
            param.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        model.model.norm.weight.fill_(1.0)
        norm = (1 / vocab + config.rms_norm_eps) ** -0.5  # RMSNorm of a one-hot row
        model.lm_head.weight.copy_(torch.tensor(_bigram_probs(vocab)).log().T / norm)
    return CausalLM(model)


LN2 = math.log(2)


def test_nll_and_divergence_on_a_hand_built_target():
    target = _bigram_target()
    greedy = generate(target, [0], max_new_tokens=4).token_ids
    assert greedy == [1, 2, 3, 4]  # the argmax chain, by hand
    torch.testing.assert_close(token_nlls(target, [0], [1, 3, 4, 5]), torch.tensor([LN2, 2 * LN2, LN2, LN2]))
    assert target_nll(target, [0], [0, 0]) == pytest.approx(math.log(16), abs=1e-5)
    lossy = compare_to_greedy(target, [0], [1, 3, 4, 5], greedy)
    assert (lossy.exact_match, lossy.first_divergence, lossy.length, lossy.greedy_length) == (False, 1, 4, 4)
    assert lossy.nll == pytest.approx(5 * LN2 / 4, abs=1e-5) and lossy.greedy_nll == pytest.approx(LN2, abs=1e-5)
    same = compare_to_greedy(target, [0], greedy, greedy)
    assert same.exact_match and same.first_divergence is None and same.nll == pytest.approx(LN2, abs=1e-5)
    short = compare_to_greedy(target, [0], [1, 2], greedy, greedy_nll=LN2)
    assert (short.exact_match, short.first_divergence, short.length) == (False, 2, 2)
    assert short.nll == pytest.approx(LN2, abs=1e-5)  # its own NLL, not the reference's
    wrong_first = compare_to_greedy(target, [0], [2, 3], greedy)  # 1/4 then 1/2
    assert wrong_first.first_divergence == 0 and wrong_first.nll == pytest.approx(1.5 * LN2, abs=1e-5)
    summary = summarize_fidelity([same, lossy, short, wrong_first])
    assert summary["prompts"] == 4 and summary["exact_match_rate"] == 0.25
    assert summary["mean_first_divergence"] == 1.0  # (1 + 2 + 0) / 3: identical outputs are left out
    assert summary["nll"] == pytest.approx((1 + 1.25 + 1 + 1.5) * LN2 / 4, abs=1e-5)
    assert summary["greedy_nll"] == pytest.approx(LN2, abs=1e-5)
    assert summarize_fidelity([])["mean_first_divergence"] is None
