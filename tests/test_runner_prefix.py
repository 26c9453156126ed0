"""The runner's prompt prefix (``run_task(..., prefix_cache=True)``): a task's shared few-shot beginning is
prefilled once per method, for the target, a draft model and the greedy reference alike; greedy SD from it
still equals its reference, the NLLs read the same states, and runs with and without it never mix."""

from __future__ import annotations

import pytest
import torch

from dropmatch import fidelity
from dropmatch.drafters import ModelDrafter
from dropmatch.drafters.eagle3 import save_head
from dropmatch.errors import ConfigError
from dropmatch.experiments import run_methods
from dropmatch.fidelity import token_nlls
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.paths import data_dir
from dropmatch.runner import (
    MIN_PREFIX_TOKENS,
    TaskRunner,
    prefix_digest,
    prefix_name,
    read_results,
    run_task,
    task_prefix,
)
from dropmatch.tasks import load_task

from .test_eagle3 import random_head

pytestmark = [pytest.mark.skipif(not (data_dir() / "korean_text").is_dir(), reason="benchmark data directory not found"),
              pytest.mark.usefixtures("one_thread")]

TASK = "klue_nli"  # few-shot prompts: ~540 shared bytes of the tiny pair's byte tokenizer, then each example's own


def test_the_prefix_is_the_tasks_shared_beginning_and_every_prompt_starts_with_it(tiny):
    runner = TaskRunner(Decoder(tiny, MethodConfig("sd")), TASK)
    assert runner.prefix == task_prefix(tiny, TASK)
    prompts = [runner.encode(tiny, e) for e in load_task(TASK, limit=6)]
    assert runner.prefix is not None and len(runner.prefix) >= MIN_PREFIX_TOKENS
    assert all(p[: len(runner.prefix)] == runner.prefix and len(p) > len(runner.prefix) for p in prompts)
    assert TaskRunner(Decoder(tiny, MethodConfig("sd")), TASK, prefix_cache=False).prefix is None
    assert TaskRunner(Decoder(tiny, MethodConfig("sd")), "humaneval").prefix is None  # no shared beginning


@pytest.mark.parametrize("config", [MethodConfig("sd"), MethodConfig("sd", lookup_first=True),
                                    MethodConfig("dropmatch", p_drop=0.3)], ids=lambda c: c.label)
def test_greedy_sd_from_the_prefix_equals_its_reference_and_skips_the_prefill(tiny, tmp_path, config, monkeypatch):
    prefix = task_prefix(tiny, TASK)
    starts, nll_prefixes = [], []  # (drafter's model, its prefix ids) at each start; the NLLs' prefix ids
    model_start, nlls = ModelDrafter.start, fidelity.token_nlls

    def spy_start(self, prompt, features=None):
        starts.append((self.model, None if self.prefix is None else self.prefix.ids.tolist()))
        return model_start(self, prompt, features)

    def spy_nlls(target, prompt, generated, cached=None):
        nll_prefixes.append(None if cached is None else cached.ids.tolist())
        return nlls(target, prompt, generated, cached)

    monkeypatch.setattr(ModelDrafter, "start", spy_start)
    monkeypatch.setattr(fidelity, "token_nlls", spy_nlls)
    decoder = Decoder(tiny, config)
    records = run_task(decoder, TASK, tmp_path / "r.jsonl", limit=2, max_new_tokens=6, fidelity=True,
                       progress=False, reference_cache=tmp_path / "greedy.jsonl", warmup=False)
    assert all(r["prompt_prefix"] == prefix_name(prefix) for r in records)
    assert all(r["stats"]["cached_prompt_tokens"] == len(prefix) for r in records)
    if config.method == "sd":  # lossless: the target's greedy output from the same cached states
        assert all(r["fidelity"]["exact_match"] for r in records)
    # the draft model started from its own cached prefix (through lookup first too), and only for these calls
    assert starts == [(tiny.draft, prefix)] * 2
    assert getattr(decoder.drafter, "drafter", decoder.drafter).prefix is None
    # the reference's NLLs (and the output's, where it differs) read the cached prefix
    assert len(nll_prefixes) >= 2 and all(ids == prefix for ids in nll_prefixes)


def test_the_reference_decodes_from_the_prefix(tiny, tmp_path, monkeypatch):
    asked = []
    generate = Decoder.generate

    def spy(self, prompt, max_new_tokens=64, seed=0, stop=(), prefix=None):
        asked.append((self.config.method, None if prefix is None else list(prefix)))
        return generate(self, prompt, max_new_tokens, seed, stop, prefix)

    monkeypatch.setattr(Decoder, "generate", spy)
    run_task(Decoder(tiny, MethodConfig("sd")), TASK, tmp_path / "r.jsonl", limit=1, max_new_tokens=4, fidelity=True,
             progress=False, reference_cache=tmp_path / "greedy.jsonl", warmup=False)
    prefix = task_prefix(tiny, TASK)
    assert sorted(asked) == [("ar", prefix), ("sd", prefix)]
    # the reference cache keeps it apart from a reference decoded without the prefix
    asked.clear()
    run_task(Decoder(tiny, MethodConfig("sd")), TASK, tmp_path / "cold.jsonl", limit=1, max_new_tokens=4,
             fidelity=True, progress=False, reference_cache=tmp_path / "greedy.jsonl", warmup=False, prefix_cache=False)
    assert sorted(asked) == [("ar", None), ("sd", None)]


def test_a_prefix_for_an_eagle3_drafter_records_its_feature_layers(tiny, tmp_path):
    save_head(random_head(tiny.target), tmp_path / "head")
    decoder = Decoder(tiny, MethodConfig("sd", draft="eagle3", draft_head=str(tmp_path / "head")))
    prompt = list(range(3, 40))
    prefix = decoder.prompt_prefix(prompt[:30])
    assert prefix.layers == tuple(decoder.drafter.feature_layers) and prefix.features.shape[0] == 30
    result = decoder.generate(prompt, max_new_tokens=4, prefix=prompt[:30])
    assert result.stats.cached_prompt_tokens == 30
    assert result.token_ids == Decoder(tiny, MethodConfig("ar")).generate(prompt, max_new_tokens=4,
                                                                           prefix=prompt[:30]).token_ids


def test_nlls_from_the_cached_prefix_are_those_of_a_whole_prefill(tiny):
    g = torch.Generator().manual_seed(0)
    prompt, generated = torch.randint(3, 259, (40,), generator=g).tolist(), torch.randint(3, 259, (8,), generator=g).tolist()
    whole = token_nlls(tiny.target, prompt, generated)
    cached = token_nlls(tiny.target, prompt, generated, tiny.target.cache_prefix(prompt[:30]))
    torch.testing.assert_close(cached, whole, rtol=0, atol=1e-4)
    # a prefix reaching into the generated tokens would hide the prompt's last row: it is not used
    past = tiny.target.cache_prefix(prompt + generated[:3])
    assert torch.equal(token_nlls(tiny.target, prompt, generated, past), whole)


def test_runs_with_and_without_the_prefix_never_mix(tiny, tmp_path):
    out = tmp_path / "r.jsonl"
    decoder = Decoder(tiny, MethodConfig("sd"))
    run_task(decoder, TASK, out, limit=1, max_new_tokens=4, progress=False)
    with pytest.raises(ConfigError, match="prompt_prefix.*--no-prefix-cache"):
        run_task(decoder, TASK, out, limit=1, max_new_tokens=4, progress=False, prefix_cache=False)
    cold = run_task(decoder, TASK, tmp_path / "cold.jsonl", limit=1, max_new_tokens=4, progress=False,
                    prefix_cache=False)
    assert cold[0]["prompt_prefix"] is None and cold[0]["stats"]["cached_prompt_tokens"] == 0
    # keyed files: one per setting, and a run without a prefix keeps the name it had before prefixes
    with_prefix = run_task(decoder, TASK, tmp_path / "k.jsonl", limit=1, max_new_tokens=4, progress=False, keyed=True)
    run_task(decoder, TASK, tmp_path / "k.jsonl", limit=1, max_new_tokens=4, progress=False, keyed=True,
             prefix_cache=False)
    files = sorted(p.name for p in tmp_path.glob("k__*.jsonl"))
    assert len(files) == 2 and with_prefix[0]["prompt_prefix"] is not None
    assert sum(read_results(tmp_path / f)[0]["prompt_prefix"] is None for f in files) == 1


def test_the_notebooks_result_files_name_a_cached_prefix(tiny, tmp_path):
    sd = {"sd": MethodConfig("sd")}
    cached = run_methods(tiny, TASK, sd, tmp_path, n_prompts=1, max_new_tokens=2, fidelity=False, progress=False)
    cold = run_methods(tiny, TASK, sd, tmp_path, n_prompts=1, max_new_tokens=2, fidelity=False, progress=False,
                       prefix_cache=False)
    none = run_methods(tiny, "humaneval", sd, tmp_path, n_prompts=1, max_new_tokens=2, fidelity=False, progress=False)
    assert cached.records[0].endswith(f"-new2-prefix{prefix_digest(task_prefix(tiny, TASK))}.jsonl")
    assert cold.records[0].endswith("-new2.jsonl") and none.records[0].endswith("-new2.jsonl")  # names of before


def test_a_tasks_methods_and_their_reference_prefill_the_prefix_once(tiny, tmp_path, monkeypatch):
    from dropmatch.models import CausalLM

    prefilled = []  # (model, layers) of each prefix computed
    cache_prefix = CausalLM.cache_prefix

    def spy(self, ids, layers=()):
        prefilled.append((self, tuple(layers)))
        return cache_prefix(self, ids, layers)

    monkeypatch.setattr(CausalLM, "cache_prefix", spy)
    for name, config in (("sd", MethodConfig("sd")), ("dm", MethodConfig("dropmatch", p_drop=0.3))):
        run_task(Decoder(tiny, config), "gsm8k", tmp_path / f"{name}.jsonl", limit=1, max_new_tokens=2, fidelity=True,
                 progress=False, reference_cache=tmp_path / "greedy.jsonl", warmup=False)
    assert len(prefilled) == 2 and set(prefilled) == {(tiny.target, ()), (tiny.draft, ())}  # two runs, a reference
