"""The decoding paths on a CUDA device (skipped without one; `make gpu-check` runs them on a GPU):
greedy SD equals AR, DropMatch at p_drop = 0 is standard verification, the same seed gives the same
output, and an EAGLE-3 head in the public checkpoint layout loads onto the target's GPU and drafts."""

from __future__ import annotations

import os

import pytest
import torch

from dropmatch.methods import Decoder, MethodConfig
from dropmatch.models import ModelPair
from dropmatch.sampling import SamplingConfig

from .conftest import make_tiny
from .test_eagle3 import _public_checkpoint, random_head

DEVICE = os.environ.get("DROPMATCH_TEST_GPU", "cuda")  # "cpu" runs these checks' logic on a CPU
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")


def _on_device(pair: ModelPair) -> ModelPair:
    pair.target.model.to(DEVICE)
    pair.draft.model.to(DEVICE)
    return pair


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    return _on_device(make_tiny("llama", seed=3, vocab_size=64, layers=3))


def _tokens(pair: ModelPair, config: MethodConfig, prompt: list[int]) -> list[int]:
    return Decoder(pair, config).generate(prompt, max_new_tokens=24).token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_sd_and_dropmatch_at_p_drop_zero_equal_ar_on_device(arch):
    pair = _on_device(make_tiny(arch, seed=1, vocab_size=64))
    prompt = list(range(3, 20))
    ar = _tokens(pair, MethodConfig("ar"), prompt)
    assert pair.target.head_weight.device.type == DEVICE
    for draft_len in (1, 3, 5):
        assert _tokens(pair, MethodConfig("sd", draft_len=draft_len), prompt) == ar
    for criterion in ("naive", "js+majority"):
        for head_dtype in ("float32", None):
            config = MethodConfig("dropmatch", p_drop=0.0, criterion=criterion, head_dtype=head_dtype)
            assert _tokens(pair, config, prompt) == ar


def test_dropmatch_same_seed_same_output_on_device(pair):
    prompt = list(range(5, 15))
    for config in (MethodConfig("dropmatch", p_drop=0.3), MethodConfig("dropmatch", p_drop=0.032)):
        for sampling in (SamplingConfig(), SamplingConfig(0.8, 1.0)):
            runs = [Decoder(pair, config, sampling).generate(prompt, max_new_tokens=24, seed=seed).token_ids
                    for seed in (7, 7)]
            assert runs[0] == runs[1]
            if not sampling.greedy:  # the seed reaches the draws
                assert any(Decoder(pair, config, sampling).generate(prompt, max_new_tokens=24, seed=seed).token_ids
                           != runs[0] for seed in range(8, 12))


def test_eagle3_head_in_public_layout_drafts_on_device(pair, tmp_path):
    head = random_head(pair.target, 40, seed=3)
    _public_checkpoint(tmp_path, head.cpu())
    prompt = list(range(3, 20))
    ar = _tokens(pair, MethodConfig("ar"), prompt)
    assert _tokens(pair, MethodConfig("sd", draft="eagle3", draft_head=str(tmp_path)), prompt) == ar
    for criterion in ("naive", "js+majority"):
        config = MethodConfig("dropmatch", draft="eagle3", criterion=criterion, draft_head=str(tmp_path))
        assert 0 < len(_tokens(pair, config, prompt)) <= 24  # runs on the device (EOS may end it early)
        assert _tokens(pair, MethodConfig("dropmatch", draft="eagle3", criterion=criterion, p_drop=0.0,
                                          draft_head=str(tmp_path)), prompt) == ar
