"""`make reproduce` end to end: the whole notebook series run headless by papermill.

``make test`` runs the ``ci`` preset (the smoke preset's sweeps on the tiny random Gemma-3 pair, with a
random EAGLE-3 head for Table 7): every notebook, cell and figure, in minutes. ``make smoke`` (marker
``slow``) runs the ``smoke`` preset on the embedded Gemma-3-270M pair, ~20 minutes on 2 cores.
"""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import torch

from dropmatch.drafters.eagle3 import committed_head, init_head, save_head
from dropmatch.models import load_pair
from dropmatch.paths import data_dir
from dropmatch.reproduce import PRESETS, notebooks
from dropmatch.runner import read_results

from .test_eagle3 import tiny_head_config

pytestmark = pytest.mark.skipif(not (data_dir() / "gsm8k").is_dir(), reason="benchmark data directory not found")


def _reproduce(preset: str, results, figures, *extra):
    return subprocess.run([sys.executable, "-m", "dropmatch.reproduce", "--preset", preset, "--results", str(results),
                           "-p", "figures_dir", str(figures), *extra], capture_output=True, text=True, timeout=3000)


def _random_eagle3_head(pair_name: str, path) -> list[str]:
    """``-p eagle3_head DIR`` for a random-init EAGLE-3 head of ``pair_name``'s target, saved under ``path``."""
    target = load_pair(pair_name, need_draft=False).target
    head = init_head(tiny_head_config(target, target.vocab_size), target, torch.arange(target.vocab_size), seed=0)
    save_head(head, path, dtype=torch.float32)
    return ["-p", "eagle3_head", str(path)]


@pytest.fixture(scope="module", params=["ci", pytest.param("smoke", marks=[pytest.mark.slow, pytest.mark.gemma])])
def series(request, tmp_path_factory):
    """The whole series under one preset, run once: (preset, results dir, figures dir, extra arguments, process)."""
    preset, root = request.param, tmp_path_factory.mktemp(request.param)
    pair = PRESETS[preset]["pair"]
    extra = [] if committed_head(pair) else _random_eagle3_head(pair, root / "head")
    out = _reproduce(preset, root / "results", root / "figures", *extra)
    return preset, root / "results", root / "figures", extra, out


def _untimed(value, path: str = "") -> dict:
    """A result record as {path: leaf}, without its wall-clock fields (stats ending in _s: seconds, tokens/s)."""
    if isinstance(value, dict | list):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return {k: v for key, item in items for k, v in _untimed(item, f"{path}/{key}").items()}
    return {} if path.startswith("/stats/") and path.endswith("_s") else {path: value}


@pytest.mark.timeout(3600)  # the smoke preset: all eight notebooks on the Gemma pair, ~20 min on 2 cores, 25+ on slower ones
def test_preset_runs_the_whole_series(series):
    preset, results, figures, extra, out = series
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for nb in notebooks():
        assert (results / nb.name).exists()
    pngs = sorted(figures.glob("*.png"))
    assert len(pngs) >= 10
    for png in pngs:
        assert png.with_suffix(".pdf").exists() and png.with_name(png.stem + ".manifest.json").exists()
    assert list(results.glob("*eagle3*.jsonl")), "Table 7 (EAGLE-3) did not run"
    table = pd.read_csv(results / "side_by_side.csv")
    assert {"comparison", "paper", "ours", "paper setup", "our setup"} <= set(table.columns) and len(table) >= 4


@pytest.mark.timeout(3600)  # runs the series if the test above has not
def test_same_preset_same_numbers(series, tmp_path):
    """A second process decodes what the series decoded: notebook 02's K = 5 run again on its first prompt
    (per-example seeds: a prompt's output does not depend on the others) gives the same record, tokens,
    step counts, scores and fidelity, up to wall-clock times."""
    preset, first, _, extra, out = series
    assert out.returncode == 0, out.stderr[-3000:]
    again = _reproduce(preset, tmp_path / "r", tmp_path / "f", *extra, "--only", "02_", "-p", "ks", "[5]",
                       "-p", "n_prompts", "1")
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
    out = _reproduce("ci", tmp_path / "r", tmp_path / "f", "--only", "02_", "-p", "task", "no_such_task")
    assert out.returncode == 1
    assert "FAILED 02_ablation_k.ipynb" in out.stderr and "unknown task 'no_such_task'" in out.stderr
