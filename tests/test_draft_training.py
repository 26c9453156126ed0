"""EAGLE-3 draft training on a tiny pair: its settings are checked, and it resumes only the run its
work directory holds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dropmatch.draft_training import TrainConfig, train_draft
from dropmatch.errors import ConfigError
from dropmatch.models import load_pair

DOCS = [f"question {i}: the quick brown fox jumps over the lazy dog {i} times. answer: {i * 7}" for i in range(40)]


def tiny_config(tmp_path, **kw) -> TrainConfig:
    return TrainConfig(out=str(tmp_path / "head"), work_dir=str(tmp_path / "work"), budget_minutes=5.0, seq_len=32,
                       draft_vocab=48, topk=4, max_steps=2, intermediate_size=32, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, checkpoint_minutes=0.001, **kw)


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
                                     {"data_fraction": 1.0}, {"budget_minutes": 0.0}, {"max_steps": 0}])
def test_bad_training_settings_are_refused_before_any_work(tmp_path, setting):
    with pytest.raises(ConfigError, match=next(iter(setting)).replace("_", "-")):
        replace(tiny_config(tmp_path), **setting)

