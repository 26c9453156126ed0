"""Tables that put the paper's numbers beside ours, built from the notebooks' result tables, and the
paired estimates over per-example records (95 % bootstrap intervals over prompts) the verdicts rest on."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .errors import ConfigError
from .intervals import UNIT, bootstrap_ci, difference_bounds, paired_ratio_ci
from .paper import PAPER_SETUPS, TABLE2_AGREEMENT, TABLE4_OVERHEAD_PERCENT, TABLE10_KOMT, table6_for
from .provenance import describe_model, machine_line
from .runner import read_results
from .summarize import PRIMARY_SCORE, SCORE_RANGE
from .tasks.metrics import answers_agree


def setup_line(pair) -> str:
    """Our setup, read off the loaded models: pair name, each model's kind (dtype / int8) and device(s),
    and the machine."""
    draft = describe_model(pair.draft) if pair.draft is not None else "none (model-free drafter)"
    return f"{pair.name}: target {describe_model(pair.target)}, draft {draft}; {machine_line()}"


def figure_labels(pair) -> tuple[str, str]:
    """Legend labels of the paper's bars and ours, from the loaded models (the paper's setup varies by row)."""
    return "paper (each row's setup)", f"ours ({pair.name}, target {describe_model(pair.target)})"


def _column(frame: pd.DataFrame, preferred: str, fallback: str) -> str:
    """``preferred`` where the table has it (newer results), else ``fallback``."""
    return preferred if preferred in frame.columns else fallback


def read_table(results_dir: str | Path, name: str) -> pd.DataFrame | None:
    path = Path(results_dir) / name
    return pd.read_csv(path) if path.exists() else None


PAIRED_COLUMNS = {"our tau gain": "tau_gain", "our speedup DM/SD": "speedup", "our e2e speedup DM/SD": "speedup e2e"}
"""Table 6's comparisons of ours and the run-table columns (paired over prompts) they are read from."""


def table6_side_by_side(main: pd.DataFrame) -> pd.DataFrame:
    """Per task and draft length: the paper's tau and speedup of SD + DropMatch over SD beside ours.

    ``main`` has rows named ``SD L=<L>`` and ``SD+DM L=<L>`` per ``task`` with tau, tokens/s, delta_nll
    and, from newer runs, paper_tau, decode tokens/s, tokens/s pooled and model. Our tau is taken in the
    paper's definition (tokens per verify step) and our speedup after the prefill (decode tokens/s) where
    the table has them; the paper's rows are those of the pair's family (Qwen3 or Llama-3.1).

    Our tau gain and speedups are the SD+DM row's paired columns (``tau_gain``, ``speedup``, ``speedup
    e2e`` of :func:`~dropmatch.experiments.run_cells`: the same prompts for both runs), with their
    intervals in ``<column> lo`` / ``<column> hi``; tables without them (older runs) give the unpaired
    ratio of the two rows, without an interval, and ``paired`` False.
    """
    ours = []
    main = main.assign(L=main["name"].str.extract(r"L=(\d+)")[0].astype(int))
    tau, speed = _column(main, "paper_tau", "tau"), _column(main, "decode tokens/s", "tokens/s")
    e2e = _column(main, "tokens/s pooled", "tokens/s")
    model = str(main["model"].iloc[0]) if "model" in main.columns and len(main) else None
    setup, numbers = table6_for(model)
    for (task, L), rows in main.groupby(["task", "L"]):
        sd = rows[rows["name"].str.startswith("SD L")].iloc[0]
        dm = rows[rows["name"].str.startswith("SD+DM")].iloc[0]
        row = {"task": task, "L": L, "our tau SD": sd[tau], "our tau SD+DM": dm[tau],
               "paired": all(pd.notna(dm.get(c)) for c in PAIRED_COLUMNS.values())}
        unpaired = {"our tau gain": dm[tau] / sd[tau] - 1, "our speedup DM/SD": dm[speed] / sd[speed],
                    "our e2e speedup DM/SD": dm[e2e] / sd[e2e]}
        for ours_column, paired_column in PAIRED_COLUMNS.items():
            value, lo, hi = ((dm[paired_column], dm[f"{paired_column}_lo"], dm[f"{paired_column}_hi"]) if row["paired"]
                             else (unpaired[ours_column], float("nan"), float("nan")))
            row.update({ours_column: value, f"{ours_column} lo": lo, f"{ours_column} hi": hi})
        ours.append({**row, "our delta NLL": dm.get("delta_nll", float("nan"))})
    paper = pd.DataFrame([{"task": t, "L": L, "paper tau SD": v[0], "paper tau SD+DM": v[1],
                           "paper tau gain": v[1] / v[0] - 1, "paper speedup DM/SD": v[4],
                           "paper accuracy change": v[3] - v[2]} for (t, L), v in numbers.items()])
    table = paper.merge(pd.DataFrame(ours), on=["task", "L"], how="right")
    return table.assign(**{"paper setup": PAPER_SETUPS[setup], "our model": model or ""})


def largest_p_within(table: pd.DataFrame, tolerance: float) -> dict[str, float]:
    """Per criterion, the largest p_drop whose NLL increase over greedy is within ``tolerance``
    (0.0 when none is). ``table`` has columns criterion, p_drop, delta_nll."""
    out = {}
    for criterion, rows in table.groupby("criterion"):
        ok = rows[rows["delta_nll"] <= tolerance]["p_drop"]
        out[criterion] = float(ok.max()) if len(ok) else 0.0
    return out


def side_by_side(results_dir: str | Path, overhead: pd.DataFrame | None, p_equal: float, our_setup: str) -> pd.DataFrame:
    """One row per comparison with the paper's number and ours, from whatever the series produced."""
    rows = []
    main = read_table(results_dir, "table6_side_by_side.csv")
    if main is not None:
        setup = main["paper setup"].iloc[0] if "paper setup" in main.columns else PAPER_SETUPS["table6_llama"]
        model = main["our model"].iloc[0] if "our model" in main.columns else None
        for _, r in main.iterrows():
            rows.append({"comparison": f"tau gain SD+DM over SD, {r.task}, L={r.L}",
                         "paper": r["paper tau gain"], "ours": r["our tau gain"], "paper setup": setup, "model": model})
            rows.append({"comparison": f"speedup SD+DM over SD, {r.task}, L={r.L} (ours: after the prefill)",
                         "paper": r["paper speedup DM/SD"], "ours": r["our speedup DM/SD"], "paper setup": setup,
                         "model": model})
            rows.append({"comparison": f"quality cost of SD+DM, {r.task}, L={r.L} "
                                       "(paper: accuracy change, points; ours: NLL increase, nats/token)",
                         "paper": r["paper accuracy change"], "ours": r["our delta NLL"], "paper setup": setup,
                         "model": model})
    korean = read_table(results_dir, "table10_korean.csv")
    if korean is not None and (korean["task"] == "komt_bench").any():
        k = korean[korean["task"] == "komt_bench"].set_index("name")
        tau = _column(k, "paper_tau", "tau")
        rows.append({"comparison": "KoMT-bench tau gain SD+DM over SD",
                     "paper": TABLE10_KOMT["standard+dm"][1] / TABLE10_KOMT["standard"][1] - 1,
                     "ours": k.loc["SD+DM", tau] / k.loc["SD", tau] - 1, "paper setup": PAPER_SETUPS["table10"],
                     "model": k["model"].iloc[0] if "model" in k.columns else None})
        if "score" in k.columns and (k["score"] == "judge_score").all():  # graded by an LLM judge
            rows.append({"comparison": "KoMT-bench score change SD+DM minus SD (LLM judge, out of 10)",
                         "paper": TABLE10_KOMT["standard+dm"][0] - TABLE10_KOMT["standard"][0],
                         "ours": float(k.loc["SD+DM", "mean"] - k.loc["SD", "mean"]),
                         "paper setup": PAPER_SETUPS["table10"], "model": k["model"].iloc[0] if "model" in k else None})
    if overhead is not None:
        js = overhead[overhead["rule"].str.contains("js+majority", regex=False)
                      & overhead["rule"].str.contains("bfloat16")]
        at_paper_p = js["rule"].str.contains("p=0.3 ", regex=False)  # the paper's p_drop where measured
        js = js[at_paper_p] if at_paper_p.any() else js
        if len(js):
            rows.append({"comparison": "head overhead, K=5 JS (% of the verify step)",
                         "paper": TABLE4_OVERHEAD_PERCENT["K=5 js"],
                         "ours": float(js["head overhead (% of verify step)"].iloc[0]), "paper setup": PAPER_SETUPS["table4"]})
    agreement = read_table(results_dir, "table2_head_agreement.csv")
    if agreement is not None:
        share = agreement[(agreement["p_drop"] == 0.3) & (agreement["agreeing_heads"] == 5)]["share"]
        if len(share):
            rows.append({"comparison": "positions where all 5 heads agree, p_drop=0.3",
                         "paper": TABLE2_AGREEMENT[5], "ours": float(share.iloc[0]), "paper setup": PAPER_SETUPS["table2"]})
    scaling = read_table(results_dir, "pdrop_scaling.csv")
    if scaling is not None and len(scaling):
        nearest = scaling.iloc[(scaling["p_drop"] - p_equal).abs().argsort().iloc[0]]
        rows.append({"comparison": f"all 5 heads agree at the equal-noise p_drop ({nearest.p_drop:.3f})",
                     "paper": TABLE2_AGREEMENT[5], "ours": float(nearest.all_heads_agree),
                     "paper setup": PAPER_SETUPS["table2"]})
    judge = read_table(results_dir, "judge_study.csv")
    if judge is not None and judge["name"].str.startswith("AJ+DM").any():
        gsm = judge[judge["split"] == "in distribution"]
        for t in sorted({n.split("t=")[1] for n in gsm["name"] if "t=" in n}):
            aj, both = gsm[gsm["name"] == f"AJ t={t}"], gsm[gsm["name"] == f"AJ+DM t={t}"]
            speed = _column(gsm, "decode tokens/s", "tokens/s")
            rows.append({"comparison": f"GSM8K tokens/s AJ+DM over AJ, threshold {t} (ours: after the prefill)",
                         "paper": "1.06-1.29 (Table 8)", "ours": float(both[speed].iloc[0] / aj[speed].iloc[0]),
                         "paper setup": PAPER_SETUPS["table8"],
                         "model": gsm["model"].iloc[0] if "model" in gsm.columns else None})
    table = pd.DataFrame(rows, columns=["comparison", "paper", "ours", "paper setup", "model"])
    table["paper"] = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in table["paper"]]
    table["our setup"] = [our_setup if not isinstance(m, str) or not m or m in our_setup else f"{m}; {machine_line()}"
                          for m in table.pop("model")]  # a table run on other models than ours names them
    return table


# --- paired estimates over the per-example records of two runs -------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A value with its 95 % interval, the number of prompts it rests on and how it was obtained."""

    value: float
    lo: float = float("nan")
    hi: float = float("nan")
    n: int | None = None
    source: str = ""


def label_value(label: str, key: str) -> float:
    """A number a method label or run name shows (``p=0.3``, ``t=0.2``, ``@L5`` / ``L=5``); NaN if none."""
    pattern = {"L": r"(?:@L|\bL=)(\d+)"}.get(key, rf"\b{re.escape(key)}=([0-9.]+(?:e-?\d+)?)")
    found = re.search(pattern, label)
    return float(found.group(1)) if found else float("nan")


def records_path(results_dir: str | Path, row: pd.Series) -> Path:
    """The JSON-lines file :func:`~dropmatch.experiments.run_methods` wrote for a summary row: its
    ``records`` column, else the one file named from ``task``, ``model`` and ``method`` with the run's
    ``__seed<seed>-new<budget>`` (and ``-prefix`` where its prompts' shared beginning was cached; ``ConfigError``
    if several are, e.g. two seeds), else the name older runs wrote, without them."""
    from .experiments import slug

    results_dir = Path(results_dir)
    if isinstance(row.get("records"), str) and row["records"]:
        return results_dir / Path(row["records"]).name
    stem = f"{row['task']}__{slug(str(row['model']))}__{slug(str(row['method']))}"
    found = sorted(p for p in results_dir.glob(f"{stem}__seed*-new*.jsonl")
                   if re.fullmatch(rf"{re.escape(stem)}__seed\d+-new\d+(?:-prefix[0-9a-f]{{10}})?\.jsonl", p.name))
    if len(found) > 1:
        raise ConfigError(f"several record files match {row['method']} on {row['task']} in {results_dir}: "
                          f"{', '.join(p.name for p in found)}; give the table a records column naming one")
    return found[0] if found else results_dir / f"{stem}.jsonl"


def records_for(results_dir: str | Path, row: pd.Series) -> list[dict] | None:
    """The per-example records behind a summary row, or ``None`` when the row lacks the columns or the
    file is absent."""
    if not isinstance(row.get("records"), str) and not all(isinstance(row.get(c), str)
                                                           for c in ("task", "model", "method")):
        return None
    path = records_path(results_dir, row)
    return read_results(path, repair=False) if path.exists() else None


def paired(a: Sequence[dict], b: Sequence[dict]) -> list[tuple[dict, dict]]:
    """The records of two runs on the same prompts (by ``id``, in ``a``'s order)."""
    by_id = {r["id"]: r for r in b}
    return [(r, by_id[r["id"]]) for r in a if r["id"] in by_id]


def decode_totals(record: dict) -> tuple[float, float, float]:
    """(tokens after the first, verify steps, seconds after the prefill) of one record's statistics."""
    s = record["stats"]
    g = s.get("generations", 1)
    return (max(s["new_tokens"] - g, 0), max(s["target_calls"] - g, 0),
            max(s.get("wall_s", 0.0) - s.get("prefill_s", 0.0), 0.0))


RATIOS = {"tau": (0, 1), "speed": (0, 2)}
"""What a ratio of two runs divides: the paper's tau (decode tokens / verify steps) or decode tokens/s."""


def paired_ratio(pairs: Sequence[tuple[dict, dict]], kind: str) -> Estimate:
    """(run a / run b) of ``RATIOS[kind]``, each a ratio of sums over the prompts, with a paired 95 %
    bootstrap interval over prompts."""
    num, den = RATIOS[kind]
    a = np.array([decode_totals(x) for x, _ in pairs], dtype=float).reshape(-1, 3)
    b = np.array([decode_totals(y) for _, y in pairs], dtype=float).reshape(-1, 3)
    if not len(pairs) or min(a[:, den].sum(), b[:, den].sum(), b[:, num].sum()) <= 0:
        return Estimate(float("nan"), n=len(pairs), source="no decoded tokens")
    value = (a[:, num].sum() / a[:, den].sum()) / (b[:, num].sum() / b[:, den].sum())
    lo, hi = paired_ratio_ci(a[:, num], a[:, den], b[:, num], b[:, den])
    return Estimate(float(value), lo, hi, len(pairs), f"paired bootstrap over {len(pairs)} prompts")


def paired_mean(values: Sequence[float], what: str, bounds: tuple[float, float] | None = None) -> Estimate:
    """The mean of per-prompt values with its 95 % bootstrap interval (``bounds``: the values' range, see
    :func:`~dropmatch.intervals.bootstrap_ci`)."""
    values = np.asarray(values, dtype=float)
    if not len(values):
        return Estimate(float("nan"), n=0, source=f"no prompts with {what}")
    lo, hi = bootstrap_ci(values, bounds=bounds)
    return Estimate(float(values.mean()), lo, hi, len(values), f"bootstrap over {len(values)} prompts ({what})")


def score_key(task: str, records: Sequence[dict]) -> str | None:
    """The score a task is read by: an LLM judge's where one graded the records, else the primary one."""
    if any("judge_score" in r.get("score", {}) for r in records):
        return "judge_score"
    return PRIMARY_SCORE.get(task)


def score_difference(pairs: Sequence[tuple[dict, dict]], key: str, scale: float = 100.0) -> Estimate:
    """Mean over prompts of score(a) - score(b) times ``scale`` (100: points of a 0-1 score)."""
    diffs = [scale * (x["score"][key] - y["score"][key]) for x, y in pairs
             if key in x.get("score", {}) and key in y.get("score", {})]
    bounds = difference_bounds(SCORE_RANGE[key], scale) if key in SCORE_RANGE else None
    return paired_mean(diffs, f"{key} difference", bounds=bounds)


def _agree(task: str, a: dict, b: dict) -> float:
    """1.0 / 0.0 where both records give the same / another answer, NaN where they cannot be compared
    (a pass / fail task whose record holds no score)."""
    try:
        return float(answers_agree(task, a, b))
    except (KeyError, ValueError):
        return float("nan")


def agreement(task: str, pairs: Sequence[tuple[dict, dict]]) -> Estimate:
    """Share of prompts where both runs give the same answer (:func:`~dropmatch.tasks.metrics.answers_agree`)."""
    same = [_agree(task, x, y) for x, y in pairs]
    return paired_mean([v for v in same if v == v], "answer agreement", bounds=UNIT)


def agreement_gain(task: str, triples: Sequence[tuple[dict, dict, dict]]) -> Estimate:
    """Mean over prompts of agree(a, ref) - agree(b, ref): how much more often run a than run b gives the
    reference run's answer."""
    diffs = [_agree(task, a, r) - _agree(task, b, r) for a, b, r in triples]
    return paired_mean([d for d in diffs if d == d], "answer agreement gain",
                       bounds=difference_bounds(UNIT))


def mean_score(records: Sequence[dict], key: str) -> float:
    values = [r["score"][key] for r in records if key in r.get("score", {})]
    return float(np.mean(values)) if values else float("nan")


def column_estimate(row: pd.Series, column: str, transform: Callable[[float], float] = float) -> Estimate:
    """``row[column]`` with ``<column>_lo`` / ``<column>_hi`` as its interval where the table has them."""
    value = transform(row[column]) if column in row and pd.notna(row[column]) else float("nan")
    if f"{column}_lo" in row and f"{column}_hi" in row and pd.notna(row[f"{column}_lo"]):
        return Estimate(value, transform(row[f"{column}_lo"]), transform(row[f"{column}_hi"]),
                        int(row["n"]) if "n" in row and pd.notna(row["n"]) else None, f"columns {column}_lo/_hi")
    return Estimate(value, source=f"no interval (the table has no {column}_lo / {column}_hi)")
