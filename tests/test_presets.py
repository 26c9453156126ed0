"""Presets of the notebook series: the paper's models per table, run-wide settings, the judges."""

from __future__ import annotations

import os

import pytest

from dropmatch import experiments, reproduce
from dropmatch.errors import ConfigError, JudgeError
from dropmatch.paper import PAPER_MODELS
from dropmatch.tasks.llm_judge import JudgeEndpoint


def test_paper_preset_uses_each_tables_models():
    paper = reproduce.PRESETS["paper"]
    main = reproduce.notebook_parameters("paper", "04_main_results.ipynb", paper, {})
    korean = reproduce.notebook_parameters("paper", "05_korean_ood.ipynb", paper, {})
    assert (main["target"], main["draft"]) == PAPER_MODELS["table6_llama"]
    assert korean["target"] == "meta-llama/Llama-3.3-70B-Instruct" == PAPER_MODELS["table10"][0]
    assert korean["draft"] == "meta-llama/Llama-3.1-8B-Instruct"
    forced = reproduce.notebook_parameters("paper", "05_korean_ood.ipynb", paper, {"target": "mine"})
    assert forced["target"] == "mine"  # the command line wins
    qwen = reproduce.PRESETS["paper-qwen"]
    assert (qwen["target"], qwen["draft"]) == ("Qwen/Qwen3-32B", "Qwen/Qwen3-4B") and qwen["notebooks"] == ["04_", "07_"]


def test_paper_preset_mines_all_of_gsm8k_train_and_spreads_the_target():
    paper = reproduce.PRESETS["paper"]
    assert paper["mine_problems"] is None and paper["mine_max_new_tokens"] == paper["max_new_tokens"]
    assert paper["device_map"] == "auto" and paper["llm_judge"] is True
    assert "device_map" not in reproduce.PRESETS["default"] and not reproduce.PRESETS["default"].get("llm_judge")


def test_run_environment_exports_and_restores(monkeypatch):
    monkeypatch.delenv("DROPMATCH_DEVICE_MAP", raising=False)
    monkeypatch.delenv("DROPMATCH_JUDGE_URL", raising=False)
    monkeypatch.setenv("DROPMATCH_LLM_JUDGE", "stale")
    with reproduce.run_environment({"device_map": "auto", "llm_judge": True}):
        assert os.environ["DROPMATCH_DEVICE_MAP"] == "auto" and os.environ["DROPMATCH_LLM_JUDGE"] == "1"
        assert experiments.judge_from_env() is None  # switched on, but no endpoint: runs go on unjudged
    assert "DROPMATCH_DEVICE_MAP" not in os.environ and os.environ["DROPMATCH_LLM_JUDGE"] == "stale"
    with reproduce.run_environment({"llm_judge": False}):
        assert "DROPMATCH_LLM_JUDGE" not in os.environ


def test_judge_endpoint_only_when_switched_on_and_configured(monkeypatch):
    monkeypatch.setenv("DROPMATCH_JUDGE_URL", "http://localhost:1/v1/")
    monkeypatch.setenv("DROPMATCH_JUDGE_MODEL", "judge-model")
    monkeypatch.delenv("DROPMATCH_LLM_JUDGE", raising=False)
    assert experiments.judge_from_env() is None
    monkeypatch.setenv("DROPMATCH_LLM_JUDGE", "1")
    endpoint = experiments.judge_from_env()
    assert endpoint.url == "http://localhost:1/v1" and endpoint.model == "judge-model"
    with pytest.raises(JudgeError, match="http://localhost:1/v1 is not reachable"):  # nothing listens on port 1
        reproduce.judge_status()
    monkeypatch.setattr(JudgeEndpoint, "check", lambda self: None)  # a reachable one (check: test_llm_judge)
    assert "judge-model" in reproduce.judge_status()
    monkeypatch.delenv("DROPMATCH_JUDGE_MODEL")
    with pytest.raises(ConfigError, match="DROPMATCH_JUDGE_MODEL"):
        reproduce.judge_status()


def test_run_methods_passes_the_judge_to_judged_tasks_only(tiny, tmp_path, monkeypatch):
    from dropmatch.methods import MethodConfig

    seen = []

    def fake_run_task(decoder, task, out, **kw):
        seen.append((task, kw["llm_judge"]))
        return [{"task": task, "method": decoder.config.label, "score": {},
                 "stats": {"new_tokens": 3, "target_calls": 2, "tokens_per_s": 1.0, "wall_s": 1.0,
                           "prefill_s": 0.5, "accepted_per_step": [1], "drafted_per_step": [1],
                           "verify_s": 0.1, "extra_accepts": 0}}]

    monkeypatch.setattr(experiments, "run_task", fake_run_task)
    monkeypatch.setattr(experiments, "judge_from_env", lambda: "endpoint")
    for task in ("mt_bench", "komt_bench", "gsm8k"):
        table = experiments.run_methods(tiny, task, {"SD": MethodConfig("sd")}, tmp_path, n_prompts=1,
                                        baseline="SD")
        assert table["model"].iloc[0] == tiny.name and table["speedup"].iloc[0] == 1.0
    assert seen == [("mt_bench", "endpoint"), ("komt_bench", "endpoint"), ("gsm8k", None)]
