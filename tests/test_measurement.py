"""Measurement: the paper's tau, decode and pooled speeds, warm-up, labels, literal mode, sampling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dropmatch.benchmarks.common import SpeedTotals
from dropmatch.engine import generate
from dropmatch.methods import WARM_UP_PROMPT_TOKENS, Decoder, MethodConfig
from dropmatch.models import ByteTokenizer, CausalLM, ModelPair
from dropmatch.rules import RelaxedVerification, VerifyInput
from dropmatch.runner import merge_stats
from dropmatch.sampling import SamplingConfig, sample_with_uniform
from dropmatch.stats import GenerationStats
from dropmatch.summarize import summarize_records
from tests.conftest import make_tiny

# --- tau and speeds -------------------------------------------------------------------------------


def test_paper_tau_counts_tokens_per_verify_step(tiny):
    prompt = tiny.encode("Question: 3 + 4 =")
    sd = Decoder(tiny, MethodConfig("sd", draft_len=4)).generate(prompt, max_new_tokens=40).stats
    assert sd.verify_steps == sd.target_calls - 1 > 0
    assert sd.paper_tau == pytest.approx((sd.new_tokens - 1) / sd.verify_steps)
    assert sd.paper_tau > sd.tau  # ours counts the prefill as a forward that emitted one token
    ar = Decoder(tiny, MethodConfig("ar")).generate(prompt, max_new_tokens=12).stats
    assert ar.paper_tau == 1.0 and ar.tau == 1.0
    d = sd.to_dict()
    assert d["paper_tau"] == round(sd.paper_tau, 4) and d["generations"] == 1
    assert d["decode_tokens_per_s"] == round((sd.new_tokens - 1) / (sd.wall_s - sd.prefill_s), 3)
    assert 0 < d["decode_s"] < d["wall_s"]


def test_merged_turns_leave_out_every_prefill():
    turn = GenerationStats(new_tokens=11, target_calls=3, accepted_per_step=[4, 4], prefill_s=1.0, wall_s=3.0)
    both = merge_stats([turn, turn])
    assert both.generations == 2 and both.paper_tau == pytest.approx(20 / 4)
    assert both.decode_tokens_per_s == pytest.approx(20 / 4.0) and both.tokens_per_s == pytest.approx(22 / 6.0)


def _record(method: str, new: int, calls: int, wall: float, prefill: float) -> dict:
    stats = GenerationStats(new_tokens=new, target_calls=calls, wall_s=wall, prefill_s=prefill).to_dict()
    return {"task": "gsm8k", "method": method, "score": {"exact_match": 1.0}, "stats": stats}


def test_summary_pools_speeds_and_compares_methods_after_the_prefill():
    # SD: prefill 3 s of 8 s; DropMatch decodes twice as fast but the prefill dilutes the end-to-end ratio.
    records = [_record("sd@L5", 41, 11, 8.0, 3.0), _record("sd@L5", 11, 3, 2.0, 1.0),
               _record("dropmatch(x)@L5", 41, 6, 5.5, 3.0), _record("dropmatch(x)@L5", 11, 2, 1.5, 1.0)]
    rows = {r["method"]: r for r in summarize_records(records)}
    sd, dm = rows["sd@L5"], rows["dropmatch(x)@L5"]
    assert sd["tokens/s pooled"] == pytest.approx(52 / 10.0)
    assert sd["tokens/s"] == pytest.approx((41 / 8 + 11 / 2) / 2)  # the per-example mean, kept beside it
    assert sd["decode tokens/s"] == pytest.approx(50 / 6.0) and dm["decode tokens/s"] == pytest.approx(50 / 3.0)
    assert sd["paper_tau"] == pytest.approx(50 / 12) and dm["paper_tau"] == pytest.approx(50 / 6)
    assert sd["tau"] == pytest.approx(52 / 14)
    assert dm["speedup"] == pytest.approx(2.0)  # decode speed-up
    assert dm["speedup e2e"] == pytest.approx((52 / 7.0) / (52 / 10.0))


def test_bench_totals():
    t = SpeedTotals()
    t.add(41, 8.0, 3.0, calls=11)
    t.add(11, 2.0, 1.0, calls=3)
    row = t.row()
    assert row["tokens/s"] == pytest.approx(5.2) and row["decode tokens/s"] == pytest.approx(50 / 6)
    assert row["tokens/s mean"] == pytest.approx((41 / 8 + 11 / 2) / 2)
    assert row["paper tau"] == pytest.approx(50 / 12) and row["tau"] == pytest.approx(52 / 14)


def test_bench_speedup_interval_pairs_generations():
    """Of two generations, a method is 2x (5x after the prefill) faster on the first and 4/3x (2x) on the
    second: a 95 % bootstrap over two paired items spans the two one-item ratios, end to end and decode."""
    base, fast = SpeedTotals(), SpeedTotals()
    base.add(41, 8.0, 3.0)
    base.add(11, 2.0, 1.0)
    fast.add(41, 4.0, 3.0)
    fast.add(11, 1.5, 1.0)
    assert fast.speedup_over(base) == pytest.approx((4 / 3, 2.0))
    assert fast.speedup_over(base, decode=True) == pytest.approx((2.0, 5.0))
    fast.add(11, 1.5, 1.0)
    with pytest.raises(ValueError, match="not paired"):
        fast.speedup_over(base)


# --- warm-up --------------------------------------------------------------------------------------


def test_decoder_builds_the_screened_head_before_any_generation():
    base = make_tiny()
    target = CausalLM(base.target.model, fast_head=True)
    pair = ModelPair(target, base.draft, ByteTokenizer(), "tiny-fast")
    Decoder(pair, MethodConfig("ar"), SamplingConfig(temperature=1.0))
    assert target._screened is None  # sampling never uses it
    Decoder(pair, MethodConfig("ar"))  # greedy plain decoding screens its one-row heads too
    screened = target._screened
    assert screened is not None
    generate(target, pair.encode("abc"), drafter=Decoder(pair, MethodConfig("sd")).drafter, max_new_tokens=8)
    assert target._screened is screened


def test_run_task_warms_up_before_the_timed_examples(tiny, tmp_path, monkeypatch):
    from dropmatch.paths import data_dir
    from dropmatch.runner import run_task

    if not (data_dir() / "korean_text").is_dir():
        pytest.skip("benchmark data directory not found")
    decoder = Decoder(tiny, MethodConfig("sd"))
    calls: list[int] = []
    prompts: list[list[int]] = []
    real = decoder.generate

    def spy(prompt, max_new_tokens=64, **kw):
        calls.append(max_new_tokens)
        prompts.append(list(prompt))
        return real(prompt, max_new_tokens=max_new_tokens, **kw)

    monkeypatch.setattr(decoder, "generate", spy)
    run_task(decoder, "klue_nli", tmp_path / "a.jsonl", limit=2, max_new_tokens=5, progress=False)
    assert calls == [8, 5, 5]  # one short warm-up, then the two examples
    # the warm-up decodes after the first example's last WARM_UP_PROMPT_TOKENS tokens (no long prefill)
    assert len(prompts[1]) > WARM_UP_PROMPT_TOKENS and prompts[0] == prompts[1][-WARM_UP_PROMPT_TOKENS:]
    calls.clear()
    run_task(decoder, "klue_nli", tmp_path / "a.jsonl", limit=2, max_new_tokens=5, progress=False)
    assert calls == []  # nothing to do: no warm-up either


# --- labels ---------------------------------------------------------------------------------------


DEFAULT_LABELS = {"ar": "ar", "sd": "sd@L5", "dropmatch": "dropmatch(js+majority,K=5,p=0.3)@L5",
                  "topk": "topk(K=2)@L5", "typical": "typical(eps=0.09,delta=0.3)@L5",
                  "divergence": "divergence(js<=0.1)@L5"}


@pytest.mark.parametrize("method", sorted(DEFAULT_LABELS))
def test_default_labels_are_unchanged(method):
    assert MethodConfig(method).label == DEFAULT_LABELS[method]


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 + 0.01
    if isinstance(value, dict):
        return {"x": 1}
    return value


CHANGES = {"criterion": "naive", "majority": "plurality", "divergence": "kl", "draft": "ngram",
           "head_dtype": "bfloat16", "draft_head": "heads/eagle3-other", "draft_stop": 0.4}


@pytest.mark.parametrize("method", ["sd", "dropmatch", "topk", "typical", "divergence"])
def test_configs_differing_in_one_field_that_matters_have_different_labels(method):
    base = MethodConfig(method)
    for f in dataclasses.fields(MethodConfig):
        if f.name in ("method", "judge_path", "judge_threshold", "lookup_min", "lookup_guide"):
            continue  # lookup_min / lookup_guide: only with lookup_first (refused alone; their labels are checked in
            # test_label_names_ngram_max_with_the_ngram_drafter... and test_lookup_first.py)
        new = CHANGES.get(f.name, _changed(getattr(base, f.name)))
        assert new != getattr(base, f.name), f.name
        other = dataclasses.replace(base, **{f.name: new})
        matters = other.label != base.label
        relevant = _matters(method, f.name)
        assert matters == relevant, (method, f.name, base.label, other.label)


def _matters(method: str, name: str) -> bool:
    from dropmatch.methods import FIELD_METHODS

    if name in ("draft", "draft_len", "extra"):
        return True
    if name == "draft_stop":
        return True  # the base configurations draft with the model drafter, which reads it
    if name in ("ngram_max", "draft_head"):
        return False  # only with the n-gram / EAGLE-3 drafter (tested below and in test_eagle3.py)
    return method in FIELD_METHODS.get(name, (method,))


def test_label_names_ngram_max_with_the_ngram_drafter_and_judge_files(tmp_path):
    assert MethodConfig("sd", draft="ngram", ngram_max=4).label == "sd+ngram[ngram_max=4]@L5"
    assert MethodConfig("sd", draft="ngram").label == "sd+ngram@L5"
    assert MethodConfig("sd", lookup_first=True, lookup_min=3).label == "sd[lookup_first,lookup_min=3]@L5"
    assert MethodConfig("sd", lookup_first=True, ngram_max=4).label == "sd[ngram_max=4,lookup_first]@L5"
    assert MethodConfig("sd", draft="eagle3", draft_head="heads/h3").label == "sd+eagle3[draft_head=h3]@L5"
    assert MethodConfig("sd", draft="eagle3").label == "sd+eagle3@L5"
    a = MethodConfig("judge", judge_path=str(tmp_path / "a.joblib")).label
    assert a != MethodConfig("judge", judge_path=str(tmp_path / "b.joblib")).label and "[judge_path=a]" in a
    literal = MethodConfig("dropmatch", literal=True, majority="plurality").label
    assert literal == "dropmatch(js+majority,K=5,p=0.3)[majority=plurality,literal]@L5"


def test_summary_keeps_configurations_apart():
    records = [_record(MethodConfig("dropmatch").label, 11, 3, 2.0, 1.0),
               _record(MethodConfig("dropmatch", majority="plurality").label, 11, 3, 2.0, 1.0)]
    assert len(summarize_records(records)) == 2


# --- literal mode under greedy --------------------------------------------------------------------


class _Never:
    name = "never"

    def prepare(self, inp):
        return lambda j: False


def _greedy_input(draft: list[int], argmax: list[int], vocab: int = 8) -> VerifyInput:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return VerifyInput(torch.tensor(draft), None, logits, torch.zeros(len(argmax), 4), SamplingConfig(),
                       torch.Generator().manual_seed(0))


def test_literal_mode_keeps_a_draft_token_equal_to_the_target_argmax():
    rule = RelaxedVerification(_Never(), keep_standard_accepts=False)
    verdict = rule.verify(_greedy_input([1, 2, 3], [1, 2, 3, 4]))
    assert (verdict.n_accepted, verdict.next_token, verdict.extra_accepts) == (3, 4, 0)
    assert verdict.criterion_evaluations == 3  # the criterion still decided first at every position
    verdict = rule.verify(_greedy_input([1, 5, 3], [1, 2, 3, 4]))
    assert (verdict.n_accepted, verdict.next_token) == (1, 2)


def test_literal_and_default_modes_agree_under_greedy_when_the_criterion_only_rejects(tiny):
    prompt = tiny.encode("Question: 1 + 1 =")
    strict = MethodConfig("dropmatch", p_drop=0.0001, criterion="majority", literal=True)
    literal = Decoder(tiny, strict).generate(prompt, max_new_tokens=24)
    plain = Decoder(tiny, MethodConfig("sd")).generate(prompt, max_new_tokens=24)
    assert literal.token_ids == plain.token_ids


# --- sampling -------------------------------------------------------------------------------------


ADVERSARIAL_U = [0.0, 1e-12, 0.5, 1 - 1e-9, float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))), 1.0]


@pytest.mark.parametrize("u", ADVERSARIAL_U)
def test_sampling_never_returns_a_zero_probability_token(u):
    probs = torch.tensor([0.0, 0.0, 0.3, 0.7, 0.0, 0.0])
    assert probs[int(sample_with_uniform(probs, u))] > 0
    g = torch.Generator().manual_seed(1)
    for _ in range(20):  # float cumsum of many small terms: rounding at the end of the CDF
        raw = torch.rand(5000, generator=g) * (torch.rand(5000, generator=g) < 0.01)
        raw[-100:] = 0.0
        raw[:50] = 0.0
        p = raw / raw.sum()
        assert p[int(sample_with_uniform(p, u))] > 0
    batch = torch.stack([probs, torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0, 0.5])])
    picks = sample_with_uniform(batch, torch.tensor([u, u]))
    assert picks.shape == (2,) and all(batch[i, int(picks[i])] > 0 for i in range(2))


def test_sampling_is_unchanged_away_from_the_edges():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert [int(sample_with_uniform(probs, u)) for u in (0.05, 0.15, 0.35, 0.65, 0.95)] == [0, 1, 2, 3, 3]
