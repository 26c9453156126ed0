"""Models spread by accelerate device maps (the 70B path), on CPU: hooks in play, greedy SD == AR."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dropmatch import models
from dropmatch.drafters import ModelDrafter
from dropmatch.engine import generate
from dropmatch.errors import ConfigError, ModelNotFoundError
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.models import ByteTokenizer, CausalLM, ModelPair, tiny_pair


def _dispatched(tmp_path) -> tuple[CausalLM, CausalLM]:
    from accelerate import dispatch_model

    target, draft = tiny_pair()
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    target = dispatch_model(target, device_map=device_map, main_device="cpu", offload_dir=str(tmp_path),
                            force_hooks=True)
    return CausalLM(target), CausalLM(draft)


def test_greedy_sd_equals_ar_through_dispatch_hooks(tmp_path):
    target, draft = _dispatched(tmp_path)
    assert hasattr(target.model.model.layers[1], "_hf_hook")  # offloaded: weights come in through the hook
    assert target.device == torch.device("cpu") and target.input_device == torch.device("cpu")
    target.check_split()
    prompt = torch.tensor([2, 40, 41, 42, 43])
    ar = generate(target, prompt, max_new_tokens=24)
    sd = generate(target, prompt, drafter=ModelDrafter(draft), draft_len=4, max_new_tokens=24)
    assert sd.token_ids == ar.token_ids and sd.stats.verify_steps < 23
    pair = ModelPair(target, draft, ByteTokenizer(), "tiny-dispatched")
    dm = Decoder(pair, MethodConfig("dropmatch", p_drop=0.1, draft_len=4)).generate(prompt, max_new_tokens=24)
    assert len(dm.token_ids) == 24


def test_device_of_a_dispatched_module_is_its_hook_execution_device():
    layer = nn.Linear(4, 4, device="meta")  # weights offloaded: only the hook knows where it computes

    class Hook:
        execution_device = "cpu"

    layer._hf_hook = Hook()
    assert models._module_device(layer, layer.weight) == torch.device("cpu")
    del layer._hf_hook
    assert models._module_device(layer, layer.weight) == torch.device("meta")


def _save_hub_like(tmp_path):
    """A tiny target and draft saved with a word-level tokenizer, loadable like hub models."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i + 3 for i in range(200)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    target, draft = tiny_pair()
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(tmp_path / name)
        fast.save_pretrained(tmp_path / name)
        dirs.append(str(tmp_path / name))
    return dirs


def test_load_pair_with_a_device_map(tmp_path):
    target_dir, draft_dir = _save_hub_like(tmp_path)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    pair = models.load_pair(None, target=target_dir, draft=draft_dir, device="cpu", device_map=device_map)
    assert pair.draft.device == pair.target.device
    prompt = pair.encode("w1 w2 w3 w4 w5")
    ar = Decoder(pair, MethodConfig("ar")).generate(prompt, max_new_tokens=16)
    sd = Decoder(pair, MethodConfig("sd", draft_len=4)).generate(prompt, max_new_tokens=16)
    assert sd.token_ids == ar.token_ids


def test_device_map_for_a_named_pair_is_refused():
    with pytest.raises(ConfigError, match="device_map"):
        models.load_pair("tiny", device_map="auto")


def test_device_map_default_comes_from_the_environment(monkeypatch):
    seen = {}

    def fake(target_id, draft_id, dtype, device, device_map=None):
        seen["device_map"] = device_map
        return "pair"

    monkeypatch.setattr(models, "_load_hub_pair", fake)
    monkeypatch.setenv(models.DEVICE_MAP_ENV, "auto")
    assert models.load_pair(None, target="x", draft="y", device="cpu") == "pair" and seen["device_map"] == "auto"
    models.load_pair(None, target="x", draft="y", device="cpu", device_map={"": "cpu"})
    assert seen["device_map"] == {"": "cpu"}


# --- gated models ---------------------------------------------------------------------------------


class _Loader:
    def __init__(self, error: BaseException):
        self.error = error

    def from_pretrained(self, name, **kwargs):
        raise self.error


def _gated_error() -> OSError:
    import httpx
    from huggingface_hub.errors import GatedRepoError

    response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/x"))
    try:
        try:
            raise GatedRepoError("Cannot access the repo at https://huggingface.co/x.", response=response)
        except GatedRepoError as inner:
            raise OSError("You are trying to access a gated repo.\nMake sure to have access to it.") from inner
    except OSError as err:
        return err


@pytest.mark.parametrize("error", [_gated_error(), OSError("403 Client Error: Forbidden for url ...")])
def test_gated_model_error_says_how_to_log_in(monkeypatch, error):
    monkeypatch.setattr(models, "hub_reachable", lambda: (True, ""))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ModelNotFoundError) as err:
        models._from_pretrained(_Loader(error), "meta-llama/Llama-3.3-70B-Instruct")
    text = str(err.value)
    assert "huggingface-cli login" in text and "HF_TOKEN" in text and "gated" in text
    assert "https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct" in text and "licence" in text


def test_other_load_errors_keep_their_message(monkeypatch):
    monkeypatch.setattr(models, "hub_reachable", lambda: (True, ""))
    with pytest.raises(ModelNotFoundError) as err:
        models._from_pretrained(_Loader(OSError("disk full")), "org/name")
    assert "could not be fetched" in str(err.value) and "licence" not in str(err.value)
