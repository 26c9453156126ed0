"""EAGLE-3 draft training on a tiny pair: its settings are checked, and it resumes only the run its
work directory holds."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dropmatch import draft_training as dt
from dropmatch.draft_training import TrainConfig, train_draft, training_documents
from dropmatch.errors import ConfigError, DataError
from dropmatch.models import load_pair
from dropmatch.tasks import data as data_mod

DOCS = [f"question {i}: the quick brown fox jumps over the lazy dog {i} times. answer: {i * 7}" for i in range(40)]


def tiny_config(tmp_path, **kw) -> TrainConfig:
    settings = dict(out=str(tmp_path / "head"), work_dir=str(tmp_path / "work"), budget_minutes=5.0, seq_len=32,
                    draft_vocab=48, topk=4, max_steps=2, intermediate_size=32, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, checkpoint_minutes=0.001)
    return TrainConfig(**settings | kw)


def test_training_resumes_its_run_and_refuses_another_in_the_same_work_dir(tmp_path):
    pair = load_pair("tiny")
    cfg = tiny_config(tmp_path)
    assert train_draft(pair, cfg, DOCS)["steps"] == 2
    assert train_draft(pair, replace(cfg, max_steps=3), DOCS)["steps"] == 3  # resumed at step 2, not restarted
    with pytest.raises(ConfigError, match="draft_vocabulary"):  # label ids index another draft vocabulary
        train_draft(pair, replace(cfg, draft_vocab=30, max_steps=4), DOCS)
    with pytest.raises(ConfigError, match="sequences"):
        train_draft(pair, replace(cfg, seq_len=24, max_steps=4), DOCS)


@pytest.mark.parametrize("setting", [{"seq_len": 0}, {"seq_len": 1}, {"batch_size": 0}, {"ttt_steps": 0},
                                     {"data_fraction": 1.0}, {"budget_minutes": 0.0}, {"max_steps": 0},
                                     {"seq_len": 3, "ttt_steps": 3}, {"max_sequences": 1},
                                     {"sources": ("gsm8k_train", "gsm8k_test")}, {"sources": ()}])
def test_bad_training_settings_are_refused_before_any_work(tmp_path, setting):
    """Among them an unroll deeper than a sequence allows (ttt-steps 3 needs seq-len >= 4)."""
    with pytest.raises(ConfigError, match=next(iter(setting)).replace("_", "-")):
        replace(tiny_config(tmp_path), **setting)



class Clock:
    """A stand-in for ``time.monotonic`` that advances ``tick`` seconds per call: a machine of any speed."""

    def __init__(self, tick: float) -> None:
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def lr_history(cfg: TrainConfig) -> list[float]:
    return [h["lr"] for h in torch.load(Path(cfg.work_dir) / "train_state.pt", weights_only=False)["history"]]


@pytest.mark.parametrize("docs", [[], ["hi"], ["x" * 31]], ids=["none", "short", "one-sequence"])
def test_too_little_text_is_a_data_error_before_any_labelling(tmp_path, monkeypatch, docs):
    pair = load_pair("tiny")
    monkeypatch.setattr(dt, "target_labels", lambda *a, **k: pytest.fail("labelled a sequence"))
    with pytest.raises(DataError, match=rf"need >= 2 sequences of 32 tokens, got \d from {len(docs)} documents"):
        train_draft(pair, tiny_config(tmp_path), docs)


def test_two_sequences_are_enough_to_train(tmp_path):
    assert train_draft(load_pair("tiny"), tiny_config(tmp_path), ["x" * 62])["data"]["sequences_used"] == 2


def fake_training_data(root: Path, monkeypatch, gsm8k: list[dict], mmlu_header: str) -> None:
    """Two GSM8K train records and one MMLU subject of two dev rows, through the real loader."""
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm8k))
    if mmlu_header:
        (root / "mmlu" / "dev").mkdir(parents=True)
        (root / "mmlu" / "dev" / "zoology_dev.csv").write_text(mmlu_header + "\nWhat?,a,b,c,d,2\nWho?,e,f,g,h,0\n")
    counts = {"gsm8k_train": 2, "mmlu_dev": 2}
    monkeypatch.setattr(data_mod, "SOURCES", {k: dataclasses.replace(v, count=counts.get(k, v.count))
                                               for k, v in data_mod.SOURCES.items()})


GSM8K = [{"question": f"q{i}?", "answer": f"Work.\n#### {i}"} for i in range(2)]
MMLU_HEADER = "question,choice0,choice1,choice2,choice3,answer"


def test_training_documents_read_the_checked_benchmark_files(tmp_path, monkeypatch, offline):
    fake_training_data(tmp_path, monkeypatch, GSM8K, MMLU_HEADER)
    assert training_documents(root=tmp_path) == [
        "Question: q0?\nAnswer: Work.\n#### 0\n\n", "Question: q1?\nAnswer: Work.\n#### 1\n\n",
        "What?\nA. a\nB. b\nC. c\nD. d\nAnswer: C\n\n", "Who?\nA. e\nB. f\nC. g\nD. h\nAnswer: A\n\n"]
    assert len(training_documents(("mmlu_dev",), root=tmp_path)) == 2


@pytest.mark.parametrize(("gsm8k", "mmlu_header", "message"), [
    ([GSM8K[0], {"question": "q1?"}], MMLU_HEADER, "gsm8k_train: record 1 .* lacks answer"),
    (GSM8K, MMLU_HEADER.replace("choice2,", ""), "mmlu_dev: could not read"),
    (GSM8K, "", "mmlu_dev: .* is missing"),
], ids=["gsm8k-without-answer", "mmlu-without-choice2", "no-mmlu"])
def test_bad_or_missing_training_files_are_data_errors(tmp_path, monkeypatch, offline, gsm8k, mmlu_header, message):
    fake_training_data(tmp_path, monkeypatch, gsm8k, mmlu_header)
    with pytest.raises(DataError, match=message):
        training_documents(root=tmp_path)


def test_unknown_training_sources_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="gsm8k_test"):
        training_documents(("gsm8k_train", "gsm8k_test"), root=tmp_path)


def test_resume_refuses_other_training_settings(tmp_path):
    pair = load_pair("tiny")
    cfg = tiny_config(tmp_path)
    train_draft(pair, cfg, DOCS)
    for setting in ({"ttt_steps": 1}, {"batch_size": 4}, {"lr": 5e-2}, {"warmup_steps": 5}):
        with pytest.raises(ConfigError, match=next(iter(setting))):
            train_draft(pair, replace(cfg, max_steps=4, **setting), DOCS)


def test_resume_compares_the_head_shape_not_its_config_text(tmp_path):
    """A work directory recorded by an older ``to_dict`` (fewer keys: its options off, layer ids
    spelled otherwise) and without the newer settings resumes if the head's shape is the same."""
    pair = load_pair("tiny")
    cfg = tiny_config(tmp_path)
    train_draft(pair, cfg, DOCS)
    progress = Path(cfg.work_dir) / "progress.json"
    state = json.loads(progress.read_text())
    head = state["run"]["head"]
    older = {k: v for k, v in head.items() if v is not False and v is not None and not k.startswith("eagle")}
    older["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": head["feature_layers"]}
    state["run"] = {k: state["run"][k] for k in ("sequences", "draft_vocabulary", "topk")} | {"head": older}
    progress.write_text(json.dumps(state))
    assert train_draft(pair, replace(cfg, max_steps=3), DOCS)["steps"] == 3
    with pytest.raises(ConfigError, match="head shape"):
        train_draft(pair, replace(cfg, intermediate_size=48, max_steps=4), DOCS)


def test_learning_rate_depends_on_the_step_not_on_the_clock(tmp_path, monkeypatch):
    """On a slow machine the budget ends the run early; the steps it took have the same learning rates."""
    pair = load_pair("tiny")
    runs = []
    for tick in (1e-6, 10.0):
        monkeypatch.setattr(dt, "monotonic", Clock(tick))
        cfg = tiny_config(tmp_path / str(tick), max_steps=8, max_sequences=5, checkpoint_minutes=60.0)
        train_draft(pair, cfg, DOCS)
        runs.append(lr_history(cfg))
    fast, slow = runs
    assert len(fast) == 8 and 0 < len(slow) < 8
    assert slow == fast[: len(slow)]
    assert fast == [dt.learning_rate(cfg, i, 8) for i in range(8)]


def test_a_budget_bounded_run_estimates_its_length_once(tmp_path, monkeypatch):
    """Without max-steps the schedule runs over a step count estimated from the first steps' speed,
    which a resumed run keeps (on a machine of another speed too)."""
    pair = load_pair("tiny")
    monkeypatch.setattr(dt, "monotonic", Clock(0.45))
    cfg = tiny_config(tmp_path, max_steps=None, max_sequences=5, budget_minutes=1.0, checkpoint_minutes=60.0)
    manifest = train_draft(pair, cfg, DOCS)
    estimate = json.loads((Path(cfg.work_dir) / "progress.json").read_text())["estimated_steps"]
    assert manifest["lr_schedule_steps"] == estimate and abs(estimate - manifest["steps"]) <= 5
    expected = [dt.learning_rate(cfg, i, None if i < dt.ESTIMATE_AFTER else estimate) for i in range(manifest["steps"])]
    assert lr_history(cfg) == expected
    monkeypatch.setattr(dt, "monotonic", Clock(0.3))
    longer = replace(cfg, budget_minutes=1.2)
    resumed = train_draft(pair, longer, DOCS)
    assert resumed["steps"] > manifest["steps"] and resumed["lr_schedule_steps"] == estimate
    assert lr_history(longer) == expected + [dt.learning_rate(cfg, i, estimate)
                                             for i in range(manifest["steps"], resumed["steps"])]


def test_a_budget_too_small_to_train_exports_nothing(tmp_path):
    cfg = tiny_config(tmp_path, max_steps=None, budget_minutes=1e-6)  # 60 us: 60 ms fit a tiny step on AMX
    with pytest.raises(ConfigError, match="no time for a training step"):
        train_draft(load_pair("tiny"), cfg, DOCS)
    assert not Path(cfg.out).exists()
