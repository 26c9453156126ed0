"""`make reproduce` end to end with the smoke preset (the CI run of the notebook series)."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from dropmatch.paths import data_dir
from dropmatch.reproduce import notebooks
from dropmatch.runner import read_results

pytestmark = [pytest.mark.gemma,
              pytest.mark.skipif(not (data_dir() / "gsm8k").is_dir(), reason="benchmark data directory not found")]


def _reproduce(results, figures, *extra):
    return subprocess.run([sys.executable, "-m", "dropmatch.reproduce", "--preset", "smoke", "--results", str(results),
                           "-p", "figures_dir", str(figures), *extra], capture_output=True, text=True, timeout=1500)


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    """The whole smoke series, run once: its results directory, its figures directory and the process."""
    root = tmp_path_factory.mktemp("smoke")
    return root / "results", root / "figures", _reproduce(root / "results", root / "figures")


def _untimed(value, path: str = "") -> dict:
    """A result record as {path: leaf}, without its wall-clock fields (stats ending in _s: seconds, tokens/s)."""
    if isinstance(value, dict | list):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return {k: v for key, item in items for k, v in _untimed(item, f"{path}/{key}").items()}
    return {} if path.startswith("/stats/") and path.endswith("_s") else {path: value}


@pytest.mark.timeout(1800)  # all eight notebooks on the Gemma pair: ~13 min on 2 cores, near the 900 s default
def test_smoke_preset_runs_the_whole_series(series):
    results, figures, out = series
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for nb in notebooks():
        assert (results / nb.name).exists()
    pngs = sorted(figures.glob("*.png"))
    assert len(pngs) >= 10
    for png in pngs:
        assert png.with_suffix(".pdf").exists() and png.with_name(png.stem + ".manifest.json").exists()
    table = pd.read_csv(results / "side_by_side.csv")
    assert {"comparison", "paper", "ours", "paper setup", "our setup"} <= set(table.columns) and len(table) >= 4


@pytest.mark.timeout(1800)  # runs the series if the test above has not
def test_same_preset_same_numbers(series, tmp_path):
    """A second process decodes what the series decoded: notebook 02's K = 5 run again on its first prompt
    (per-example seeds: a prompt's output does not depend on the others) gives the same record, tokens,
    step counts, scores and fidelity, up to wall-clock times."""
    first, _, out = series
    assert out.returncode == 0, out.stderr[-3000:]
    again = _reproduce(tmp_path / "r", tmp_path / "f", "--only", "02_", "-p", "ks", "[5]", "-p", "n_prompts", "1")
    assert again.returncode == 0, again.stderr[-3000:]
    (rerun,) = (tmp_path / "r").glob("*K=5*.jsonl")
    records = read_results(rerun, repair=False)
    before = {r["id"]: r for r in read_results(first / rerun.name, repair=False)}
    assert len(records) == 1 and len(before) == 2
    leaves, expected = _untimed(records[0]), _untimed(before[records[0]["id"]])
    assert leaves.keys() == expected.keys()
    for path, value in leaves.items():  # floats (NLLs) to float32 summation noise, the rest exactly
        assert value == (pytest.approx(expected[path], rel=1e-6) if isinstance(value, float) else expected[path]), path


def test_failing_notebook_stops_the_run_with_its_name(tmp_path):
    # an unknown task fails in the notebook's first cell after the parameters, before the models load
    out = _reproduce(tmp_path / "r", tmp_path / "f", "--only", "02_", "-p", "task", "no_such_task")
    assert out.returncode == 1
    assert "FAILED 02_ablation_k.ipynb" in out.stderr and "unknown task 'no_such_task'" in out.stderr
