"""Side-by-side tables from result tables."""

from __future__ import annotations

import pandas as pd
import pytest

from dropmatch import report


def _main():
    rows = []
    for task, (sd_tau, dm_tau) in {"gsm8k": (3.0, 4.5), "mmlu": (2.0, 2.2)}.items():
        for L in (5, 10):
            rows.append({"task": task, "name": f"SD L={L}", "tau": sd_tau, "tokens/s": 10.0, "delta_nll": 0.0})
            rows.append({"task": task, "name": f"SD+DM L={L}", "tau": dm_tau, "tokens/s": 12.0, "delta_nll": 0.1})
    return pd.DataFrame(rows)


def test_table6_side_by_side():
    table = report.table6_side_by_side(_main())
    row = table[(table.task == "gsm8k") & (table.L == 5)].iloc[0]
    assert row["our tau gain"] == pytest.approx(0.5) and row["our speedup DM/SD"] == pytest.approx(1.2)
    assert row["paper tau SD"] == 4.97 and row["paper tau gain"] == pytest.approx(5.50 / 4.97 - 1)


def test_largest_p_within():
    table = pd.DataFrame({"criterion": ["js"] * 3 + ["naive"] * 2, "p_drop": [0.01, 0.1, 0.3, 0.01, 0.3],
                          "delta_nll": [0.01, 0.04, 0.2, 0.5, 0.9]})
    assert report.largest_p_within(table, 0.05) == {"js": 0.1, "naive": 0.0}


def test_side_by_side_uses_what_exists(tmp_path):
    report.table6_side_by_side(_main()).to_csv(tmp_path / "table6_side_by_side.csv", index=False)
    pd.DataFrame({"task": ["komt_bench", "komt_bench"], "name": ["SD", "SD+DM"], "tau": [2.0, 3.0]}).to_csv(
        tmp_path / "table10_korean.csv", index=False)
    overhead = pd.DataFrame({"rule": ["standard", "dropmatch js+majority (bfloat16 heads)"],
                             "head overhead (% of verify step)": [0.0, 12.5]})
    table = report.side_by_side(tmp_path, overhead, 0.03, "ours")
    by = dict(zip(table.comparison, table.ours, strict=True))
    assert by["KoMT-bench tau gain SD+DM over SD"] == pytest.approx(0.5)
    assert by["head overhead, K=5 JS (% of the verify step)"] == 12.5
    assert "tau gain SD+DM over SD, gsm8k, L=10" in by
    paper = dict(zip(table.comparison, table.paper, strict=True))
    quality = next(c for c in by if c.startswith("quality cost of SD+DM, gsm8k, L=5"))
    assert by[quality] == pytest.approx(0.1) and paper[quality] == f"{94.29 - 94.69:.3f}"
    assert paper["tau gain SD+DM over SD, gsm8k, L=5"] == f"{5.50 / 4.97 - 1:.3f}"
    assert report.side_by_side(tmp_path / "missing", None, 0.03, "ours").empty
