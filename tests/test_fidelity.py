"""Fidelity to the target's own greedy output."""

from __future__ import annotations

import json

import torch

from dropmatch.fidelity import compare_to_greedy, first_divergence, summarize_fidelity, target_nll, token_nlls
from dropmatch.methods import Decoder, MethodConfig

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


def test_lossless_is_faithful_and_lossy_is_measured(tiny):
    greedy = Decoder(tiny, MethodConfig("ar"))
    lossy = Decoder(tiny, MethodConfig("dropmatch", p_drop=0.5, criterion="naive"))
    exact, measured = [], []
    for seed in range(4):
        prompt = random_prompt(seed).tolist()
        reference = greedy.generate(prompt, max_new_tokens=32).token_ids
        sd = Decoder(tiny, MethodConfig("sd")).generate(prompt, max_new_tokens=32).token_ids
        exact.append(compare_to_greedy(tiny.target, prompt, sd, reference))
        out = lossy.generate(prompt, max_new_tokens=32, seed=seed).token_ids
        measured.append(compare_to_greedy(tiny.target, prompt, out, reference))
    summary = summarize_fidelity(exact)
    assert summary["exact_match_rate"] == 1.0 and summary["mean_first_divergence"] is None
    assert summary["nll"] == summary["greedy_nll"]
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
