"""`make reproduce` end to end with the smoke preset (the CI run of the notebook series)."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from dropmatch.paths import data_dir
from dropmatch.reproduce import notebooks

pytestmark = [pytest.mark.gemma,
              pytest.mark.skipif(not (data_dir() / "gsm8k").is_dir(), reason="benchmark data directory not found")]

_TIMED = ("tokens/s", "tokens/s pooled", "decode tokens/s", "speedup", "speedup e2e", "verify_ms_per_step")
TIMING = tuple(f"{c}{end}" for c in _TIMED for end in ("", "_lo", "_hi"))


def _reproduce(results, figures, *extra):
    return subprocess.run([sys.executable, "-m", "dropmatch.reproduce", "--preset", "smoke", "--results", str(results),
                           "-p", "figures_dir", str(figures), *extra], capture_output=True, text=True, timeout=1500)


@pytest.mark.timeout(1800)  # all eight notebooks on the Gemma pair: ~13 min on 2 cores, near the 900 s default
def test_smoke_preset_runs_the_whole_series(tmp_path):
    out = _reproduce(tmp_path / "results", tmp_path / "figures")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for nb in notebooks():
        assert (tmp_path / "results" / nb.name).exists()
    pngs = sorted((tmp_path / "figures").glob("*.png"))
    assert len(pngs) >= 10
    for png in pngs:
        assert png.with_suffix(".pdf").exists() and png.with_name(png.stem + ".manifest.json").exists()
    table = pd.read_csv(tmp_path / "results" / "side_by_side.csv")
    assert {"comparison", "paper", "ours", "paper setup", "our setup"} <= set(table.columns) and len(table) >= 4


def test_same_preset_same_numbers(tmp_path):
    tables = []
    for run in ("a", "b"):
        out = _reproduce(tmp_path / run, tmp_path / f"fig-{run}", "--only", "02_", "-p", "ks", "[5]",
                         "-p", "n_prompts", "1")
        assert out.returncode == 0, out.stderr[-3000:]
        tables.append(pd.read_csv(tmp_path / run / "ablation_k.csv").drop(columns=list(TIMING), errors="ignore"))
    pd.testing.assert_frame_equal(*tables)


def test_failing_notebook_stops_the_run_with_its_name(tmp_path):
    out = _reproduce(tmp_path / "r", tmp_path / "f", "--only", "02_", "-p", "ks", "[0]")
    assert out.returncode == 1
    assert "FAILED 02_ablation_k.ipynb" in out.stderr and "K" in out.stderr
