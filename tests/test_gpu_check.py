"""The prepared device check runs end to end (at a reduced shape on the CPU)."""

from __future__ import annotations

import pytest
import torch

from dropmatch.benchmarks import gpu_check


def test_gpu_check_small_shape_runs_and_reports(capsys):
    gpu_check.main(["--small", "--repeats", "1", "--device", "cpu", "--profile", "3"])
    out = capsys.readouterr().out
    assert "paper overhead (Table 4, K=5)" in out and "overhead_vs_timed_forward_pct" in out
    assert "engine rule dropmatch_rule_ms" in out and "profile of the DropMatch rule step" in out
    expected = "n/a (no CUDA)" if not torch.cuda.is_available() else "n/a (not run on CUDA)"  # --device cpu
    assert f"float32 heads): {expected}" in out
    assert "; " in out.splitlines()[0] or not torch.cuda.is_available()  # the GPU's name and the machine apart


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--repeats", "-2"]])
def test_gpu_check_refuses_no_timed_calls(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--small", "--device", "cpu", *argv])
    assert exit_info.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--k", "0"], ["--p-drop", "1.5"], ["--draft-len", "0"], ["--prompts", "0"]])
def test_eagle3_benchmark_refuses_bad_settings_before_loading_the_model(argv, capsys, monkeypatch):
    from dropmatch.benchmarks import eagle3_dropmatch

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(eagle3_dropmatch, "load_pair", no_model)
    with pytest.raises(SystemExit) as exit_info:
        eagle3_dropmatch.main(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


def test_llama_8b_weight_bytes():
    assert 15.5e9 < gpu_check.Shape().weight_bytes() < 16.5e9  # ~8.0B parameters in bf16
