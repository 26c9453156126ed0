"""The prepared device check runs end to end (at a reduced shape on the CPU)."""

from __future__ import annotations

import torch

from dropmatch.benchmarks import gpu_check


def test_gpu_check_small_shape_runs_and_reports(capsys):
    gpu_check.main(["--small", "--repeats", "1", "--device", "cpu", "--profile", "3"])
    out = capsys.readouterr().out
    assert "paper overhead (Table 4, K=5)" in out and "overhead_vs_timed_forward_pct" in out
    assert "engine rule dropmatch_rule_ms" in out and "profile of the DropMatch rule step" in out
    expected = "n/a (no CUDA)" if not torch.cuda.is_available() else "True"
    assert f"float32 heads): {expected}" in out


def test_llama_8b_weight_bytes():
    assert 15.5e9 < gpu_check.Shape().weight_bytes() < 16.5e9  # ~8.0B parameters in bf16
