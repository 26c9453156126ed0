"""Our measurements from the series' result tables and per-example records: ratios and score changes of
two runs (paired over prompts where the records are there), and single values of the analysis tables."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from .. import intervals, report, summarize
from ..report import Estimate
from ..runner import read_results
from .rules import P_MATCH_TOLERANCE, SCORE_FLOOR, Measurement, ci_text, odds


@dataclass
class Runs:
    """A summary table of :func:`~dropmatch.experiments.run_methods` runs with their p_drop and L."""

    name: str
    table: pd.DataFrame | None
    results_dir: Path

    @classmethod
    def read(cls, results_dir: Path, name: str) -> Runs:
        table = report.read_table(results_dir, name)
        if table is not None and "method" in table.columns:
            methods = table["method"].astype(str)
            p = table["p_drop"] if "p_drop" in table.columns else methods.map(lambda m: report.label_value(m, "p"))
            label_L = methods.map(lambda m: report.label_value(m, "L"))
            if "name" in table.columns:
                label_L = label_L.fillna(table["name"].astype(str).map(lambda m: report.label_value(m, "L")))
            table = table.assign(_p=pd.to_numeric(p, errors="coerce"), _L=label_L)
        elif table is not None:
            table = None  # an older table without method labels
        return cls(name, table, results_dir)

    def find(self, task: str, prefix: str, *, L: float | None = None, p: float | None = None,
             contains: str = "", excludes: str = "", t: float | None = None) -> pd.Series | None:
        """The run of ``task`` whose method label starts with ``prefix`` (and holds ``contains``)."""
        if self.table is None or "task" not in self.table.columns:
            return None
        rows = self.table[(self.table["task"] == task) & self.table["method"].str.startswith(prefix)]
        if contains:
            rows = rows[rows["method"].str.contains(contains, regex=False)]
        if excludes:
            rows = rows[~rows["method"].str.contains(excludes, regex=False)]
        if L is not None:
            rows = rows[rows["_L"] == L]
        if t is not None:
            rows = rows[rows["method"].map(lambda m: report.label_value(m, "t")).sub(t).abs() <= 1e-12 + 1e-9 * t]
        if p is not None:
            rows = rows[rows["_p"].map(lambda q: abs(odds(q) / odds(p) - 1) <= P_MATCH_TOLERANCE if q > 0 else False)]
        return rows.iloc[0] if len(rows) else None

    def records(self, row: pd.Series) -> list[dict] | None:
        return report.records_for(self.results_dir, row)


def missing(text: str, p: float | None = None) -> Measurement:
    return Measurement(p_drop=p, missing=text)


def ratio(runs: Runs, a: pd.Series | None, b: pd.Series | None, kind: str, what: str) -> Measurement:
    """Run a over run b (``report.RATIOS``): paired over per-example records where present, else from the
    summary columns (the paper's tau or decode tokens/s, with ``<column>_lo`` / ``_hi``)."""
    p = _p_of(a)
    if a is None or b is None:
        return missing(f"no {what} in {runs.name}", p)
    ra, rb = runs.records(a), runs.records(b)
    if ra is not None and rb is not None:
        return Measurement(report.paired_ratio(report.paired(ra, rb), kind), p)
    versus, shift = {"tau": ("tau_gain", 1.0), "speed": ("speedup", 0.0)}[kind]
    if f"{versus}_lo" in a and b.get("speedup") == 1.0:  # b is the table's baseline: its paired interval
        e = report.column_estimate(a, versus, lambda v: float(v) + shift)
        return Measurement(replace(e, source=f"paired interval of column {versus} (no per-example records)"), p)
    column = {"tau": "paper_tau", "speed": "decode tokens/s"}[kind]
    x, y = report.column_estimate(a, column), report.column_estimate(b, column)
    if math.isfinite(x.lo) and math.isfinite(y.lo) and y.lo > 0:  # unpaired, conservative: the extremes
        return Measurement(Estimate(x.value / y.value, x.lo / y.hi, x.hi / y.lo, min(x.n or 0, y.n or 0) or None,
                                    f"unpaired from {column}_lo/_hi (no per-example records)"), p)
    return Measurement(Estimate(x.value / y.value if y.value else float("nan"),
                                source=f"no per-example records ({report.records_path(runs.results_dir, a).name}) "
                                       f"and no {column}_lo/_hi columns"), p)


def quality(runs: Runs, a: pd.Series | None, b: pd.Series | None, what: str, lossless: pd.Series | None = None,
            scale: float = 100.0) -> Measurement:
    """Score of run a minus run b (points), with a's answer agreement with the ``lossless`` run (default b);
    missing when the lossless run's score sits at the floor."""
    p = _p_of(a)
    if a is None or b is None:
        return missing(f"no {what} in {runs.name}", p)
    lossless = b if lossless is None else lossless
    ra, rb, rl = runs.records(a), runs.records(b), runs.records(lossless)
    task = str(a["task"])
    agree = None
    if ra is not None and rl is not None:
        agree = report.agreement(task, report.paired(ra, rl))
    elif "agreement" in a:
        agree = report.column_estimate(a, "agreement")
    if ra is None or rb is None:
        estimate = _unpaired_difference(a, b, scale)
        base = float(lossless["mean"]) if "mean" in lossless else float("nan")
    else:
        key = report.score_key(task, ra + rb)
        if key is None:
            return Measurement(p_drop=p, missing=f"{task} has no task score", agreement=agree)
        estimate = report.score_difference(report.paired(ra, rb), key, scale)
        base = report.mean_score(rl if rl is not None else rb, key)
    if scale == 100.0 and math.isfinite(base) and not SCORE_FLOOR <= base <= 1 - SCORE_FLOOR:
        shown = f"; answer agreement with it {ci_text(agree)}" if agree is not None else ""
        return Measurement(estimate, p, f"the lossless run scores {100 * base:.1f} % (floor: SCORE_FLOOR = "
                                        f"{SCORE_FLOOR:g}), so a score change cannot show{shown}", agree)
    return Measurement(estimate, p, agreement=agree)


def _unpaired_difference(a: pd.Series, b: pd.Series, scale: float) -> Estimate:
    """From the summaries' ``mean`` with ``mean_lo`` / ``mean_hi`` (older tables: ``ci95``, "[lo, hi]"),
    conservatively: the extremes of the two intervals (no per-example records)."""
    def interval(row):
        if "mean_lo" in row and "mean_hi" in row:
            return [float(row["mean_lo"]), float(row["mean_hi"])]
        text = str(row.get("ci95", ""))
        parts = text.strip("[]").split(",") if text.startswith("[") else []
        return [float(v) for v in parts] if len(parts) == 2 else [float("nan")] * 2

    (alo, ahi), (blo, bhi) = interval(a), interval(b)
    value = scale * (float(a.get("mean", float("nan"))) - float(b.get("mean", float("nan"))))
    return Estimate(value, scale * (alo - bhi), scale * (ahi - blo), int(a["n"]) if "n" in a else None,
                    "unpaired from the summaries' intervals (no per-example records)")


def _p_of(row: pd.Series | None) -> float | None:
    if row is None or "_p" not in row or pd.isna(row["_p"]):
        return None
    return float(row["_p"])


def at_p(m: Measurement, p: float) -> Measurement:
    """A missing measurement names the p_drop it looked for."""
    if m.missing and m.p_drop is None:
        return replace(m, p_drop=p, missing=f"{m.missing} at p_drop ~ {p:.3g}")
    return m


def head_pass_change(results_dir: Path, p: float) -> Measurement:
    """Per prompt, the mean pass@1 of the K dropout paths at ``p`` minus the dropout-free path's (p = 0)."""
    files = sorted(Path(results_dir).glob("dropout_paths__humaneval__*.jsonl"), key=lambda f: f.stat().st_mtime)
    if not files:
        return missing("no dropout paths on humaneval (notebook 01)", p)
    records = read_results(files[-1], repair=False)
    ps = sorted({r["p_drop"] for r in records})
    near = [q for q in ps if q > 0 and abs(odds(q) / odds(p) - 1) <= P_MATCH_TOLERANCE]
    if 0.0 not in ps:
        return missing(f"no dropout-free baseline in {files[-1].name} (add 0.0 to notebook 01's p_heads)", p)
    if not near:
        return missing(f"no dropout paths at p_drop ~ {p:.3g} in {files[-1].name}", p)
    base = {r["id"]: r["score"].get("pass@1", float("nan")) for r in records if r["p_drop"] == 0.0 and r["head"] == 0}
    per_id: dict[str, list[float]] = {}
    for r in records:
        if r["p_drop"] == near[0] and r["id"] in base:
            per_id.setdefault(r["id"], []).append(r["score"].get("pass@1", float("nan")))
    estimate = report.paired_mean([100 * (sum(v) / len(v) - base[i]) for i, v in per_id.items()], "pass@1 change",
                                  bounds=intervals.difference_bounds(summarize.SCORE_RANGE["pass@1"], 100.0))
    level = sum(base.values()) / max(len(base), 1)
    if not SCORE_FLOOR <= level <= 1 - SCORE_FLOOR:
        return Measurement(estimate, near[0], f"the dropout-free paths pass {100 * level:.1f} % (floor: "
                                              f"SCORE_FLOOR = {SCORE_FLOOR:g}), so a change cannot show")
    return Measurement(estimate, near[0])


def all_heads_agree(results_dir: Path, p: float) -> Measurement:
    """Table 2's share from notebook 01 (humaneval), else notebook 03's scaling table (gsm8k positions)."""
    agreement = report.read_table(results_dir, "table2_head_agreement.csv")
    if agreement is not None:
        five = agreement[agreement["agreeing_heads"] == agreement["agreeing_heads"].max()]
        m = table_value(results_dir, "table2_head_agreement.csv", p, "share", "share", frame=five)
        if not m.missing:
            return m
    m = table_value(results_dir, "pdrop_scaling.csv", p, "all_heads_agree", "all_heads_agree")
    if m.missing:
        return missing(f"no head agreement at p_drop ~ {p:.3g} in table2_head_agreement.csv or pdrop_scaling.csv", p)
    return replace(m, estimate=replace(m.estimate, source=f"{m.estimate.source}; gsm8k positions (notebook 03), "
                                                            "not humaneval"))


def table_value(results_dir: Path, name: str, p: float, column: str, ci: str, *,
                where: tuple[str, str] | None = None, frame: pd.DataFrame | None = None) -> Measurement:
    """``column`` of the row of table ``name`` at p_drop ~ ``p``, its interval from ``<ci>_lo`` / ``<ci>_hi``."""
    table = report.read_table(results_dir, name) if frame is None else frame
    if table is None or "p_drop" not in table.columns or column not in table.columns:
        return missing(f"no {name} with columns p_drop and {column}", p)
    if where is not None:
        table = table[table[where[0]] == where[1]] if where[0] in table.columns else table.iloc[:0]
    rows = table[table["p_drop"].map(lambda q: q > 0 and abs(odds(q) / odds(p) - 1) <= P_MATCH_TOLERANCE)]
    if not len(rows):
        return missing(f"no row at p_drop ~ {p:.3g} in {name}", p)
    row = rows.iloc[0].copy()
    if ci != column and f"{ci}_lo" in row and f"{ci}_hi" in row:
        row[f"{column}_lo"], row[f"{column}_hi"] = row[f"{ci}_lo"], row[f"{ci}_hi"]
    return Measurement(report.column_estimate(row, column), float(row["p_drop"]))
