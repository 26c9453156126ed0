"""One table over result files: ``python -m dropmatch summarize results/*.jsonl [--baseline sd]``.

Per task and method: examples; ``tau`` (ours: total new tokens over total target calls, prefill
included) and ``paper_tau`` (the paper's: tokens per verify step, the first token of each generation
and its prefill left out); end-to-end speed both as the mean over examples (``tokens/s``) and pooled
(``tokens/s pooled``: total new tokens over total wall time); ``decode tokens/s`` pooled after the
prefill (tokens after the first over the time after the prefill); ``speedup`` = ratio of decode
tokens/s to the baseline run of the same task (methods that change verification are compared on
decode speed: the prefill, identical for all, dilutes the ratio), ``speedup e2e`` the same on pooled
end-to-end tokens/s (the user's view); each task score with a bootstrap 95 % interval, and fidelity
to the target's greedy output (exact-match rate, target NLL per token of the output and of the
greedy output) where recorded.

Every number that is an estimate over prompts has a bootstrap 95 % interval over the prompts beside
it, in ``<column>_lo`` and ``<column>_hi``: pooled ratios (tau, paper_tau, decode tokens/s) resample
the prompts and pool again; comparisons with the baseline (``speedup``, ``speedup e2e``,
``tau_gain`` = paper_tau ratio - 1) resample the prompts both runs share, the same ones for both
(paired); ``agreement`` is the share of those prompts where the run's answer is the baseline's
(:func:`~dropmatch.tasks.metrics.answers_agree`: the same final number on GSM8K, letter on MMLU, label
on KLUE-NLI, pass / fail on HumanEval and IFEval strict, else the same text).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .intervals import UNIT, bootstrap_ci, paired_ratio_ci, pooled_ratio_ci
from .runner import OLD_RECORD_DEFAULTS, read_results
from .tasks.metrics import answers_agree

PRIMARY_SCORE = {"gsm8k": "exact_match", "mmlu": "accuracy", "humaneval": "pass@1", "ifeval": "prompt_level_strict_acc",
                 "klue_nli": "accuracy", "mt_bench": "output_chars", "komt_bench": "output_chars",
                 "kullm": "output_chars"}
# the range of each per-prompt score that has one (an LLM judge grades 1-10; output_chars has none)
SCORE_RANGE = {"exact_match": (0.0, 1.0), "accuracy": (0.0, 1.0), "pass@1": (0.0, 1.0),
               "prompt_level_strict_acc": (0.0, 1.0), "judge_score": (1.0, 10.0)}
def per_example(records: Sequence[dict]) -> dict[str, np.ndarray]:
    """Per record: new tokens, target calls, decode tokens and steps (after each generation's prefill),
    wall and decode seconds, and end-to-end tokens/s, as arrays (missing timings count 0)."""
    stats = [r["stats"] for r in records]
    gens = np.array([s.get("generations", 1) for s in stats], dtype=float)
    new = np.array([s["new_tokens"] for s in stats], dtype=float)
    calls = np.array([s["target_calls"] for s in stats], dtype=float)
    wall = np.array([s.get("wall_s", 0.0) for s in stats], dtype=float)
    prefill = np.array([s.get("prefill_s", 0.0) for s in stats], dtype=float)
    return {"new": new, "calls": calls, "decode_tokens": np.maximum(new - gens, 0),
            "decode_steps": np.maximum(calls - gens, 0), "wall": wall, "decode_s": np.maximum(wall - prefill, 0),
            "tokens_per_s": np.array([s["tokens_per_s"] for s in stats], dtype=float)}


def with_ci(row: dict, column: str, value: float, interval: tuple[float, float]) -> None:
    """Set ``column``, ``column_lo`` and ``column_hi`` of ``row``."""
    row[column], row[f"{column}_lo"], row[f"{column}_hi"] = value, interval[0], interval[1]


# What besides task and method sets a run apart: records that differ in any of these are never pooled.
# A baseline run must share the first six with the run it is compared with (not the seed: a greedy
# baseline does not depend on it); among several such, the one with the same seed is taken. A cached prompt
# prefix (runner.task_prefix) leaves the shared prefill out of a run's times, so it pairs only with its like.
RUN_SETTINGS = ("model", "sampling", "max_new_tokens", "chat_template", "llm_judge", "prompt_prefix", "seed", "seeding")
PAIRED_SETTINGS = RUN_SETTINGS[:6]

RunKey = tuple[str, str, tuple[str, ...]]  # task, method label, RUN_SETTINGS values (JSON)


def run_key(record: dict) -> RunKey:
    """The run a record belongs to: its task, method label and :data:`RUN_SETTINGS` (records written
    before a setting existed hold its old default; synthetic records without one hold ``None``)."""
    settings = tuple(json.dumps(record.get(k, OLD_RECORD_DEFAULTS.get(k)), sort_keys=True, default=str)
                     for k in RUN_SETTINGS)
    return record["task"], record["method"], settings


def _labels(keys: Sequence[RunKey]) -> dict[RunKey, str]:
    """Each run's method label, followed by the settings in which it differs from runs of the same task
    and method (e.g. ``sd@L5 [sampling={...}]``), so that rows stay apart in the table."""
    labels = {}
    for key in keys:
        twins = [k for k in keys if k[:2] == key[:2]]
        differs = [i for i in range(len(RUN_SETTINGS)) if len({k[2][i] for k in twins}) > 1]
        tag = ", ".join(f"{RUN_SETTINGS[i]}={key[2][i]}" for i in differs)
        labels[key] = f"{key[1]} [{tag}]" if tag else key[1]
    return labels


def summarize_records(records: Sequence[dict], baseline: str = "sd") -> list[dict]:
    """Rows (dicts) of the summary table, one per run (:func:`run_key`); ``baseline`` names a method
    label or its prefix. Each run is compared with the baseline run of the same task and
    :data:`PAIRED_SETTINGS`. ``ConfigError`` if a run holds one prompt twice (e.g. a file given twice)."""
    groups: dict[RunKey, list[dict]] = defaultdict(list)
    for r in records:
        groups[run_key(r)].append(r)
    for (task, method, _), rs in groups.items():
        ids = [r.get("id", i) for i, r in enumerate(rs)]
        if len(set(ids)) < len(ids):
            twice = sorted({str(i) for i in ids if ids.count(i) > 1})
            raise ConfigError(f"{task} / {method}: the results hold prompt(s) {', '.join(twice[:3])} more than once "
                              f"(the same file twice, or runs of one configuration in two files); give each once")
    keys = sorted(groups)
    labels = _labels(keys)
    rows = {key: summarize_run(key[0], labels[key], groups[key]) for key in keys}
    paired = len(PAIRED_SETTINGS)
    for key in keys:
        base = [k for k in keys if k[0] == key[0] and k[2][:paired] == key[2][:paired] and _is_baseline(k[1], baseline)]
        if len(base) > 1:  # e.g. sd@L5 and sd@L10: compare with the one at the same draft length
            base = [k for k in base if _draft_length(k[1]) == _draft_length(key[1])]
        if len(base) > 1:  # runs of the baseline with other seeds: the one with this run's seed
            base = [k for k in base if k[2] == key[2]] or base
        if len(base) > 1:
            raise ConfigError(f"baseline {baseline!r} matches several runs of {key[0]}: "
                              f"{', '.join(labels[k] for k in base)}; name one exactly")
        base_records = groups[base[0]] if base else []
        rows[key].update(compare_runs(groups[key], base_records))
        rows[key].update(agreement(key[0], groups[key], base_records))
    return [rows[key] for key in keys]


def summarize_run(task: str, method: str, rs: Sequence[dict]) -> dict:
    """One run's row: counts, speeds and scores, each estimate with its interval over the prompts.

    ``n`` counts the prompts; ``nll``, ``greedy_nll`` and ``delta_nll`` (estimate and interval alike)
    rest on the ``n_nll`` of them where both NLLs are defined (an output empty after its stop string
    has none), as the score rests on the records that hold it."""
    x = per_example(rs)
    key = PRIMARY_SCORE.get(task)
    if any("judge_score" in r["score"] for r in rs):  # an LLM judge graded this run
        key = "judge_score"
    scores = [r["score"][key] for r in rs if key in r["score"]]
    if key is not None and not scores and any(r["score"] for r in rs):
        raise ConfigError(f"{task}/{method}: no record has the score {key!r}; "
                         f"the records have {sorted(rs[0]['score'])}")
    low, high = bootstrap_ci(scores, bounds=SCORE_RANGE.get(key))
    row = {"task": task, "method": method, "n": len(rs)}
    with_ci(row, "tau", pooled_ratio(x["new"], x["calls"]), pooled_ratio_ci(x["new"], x["calls"]))
    with_ci(row, "paper_tau", pooled_ratio(x["decode_tokens"], x["decode_steps"]),
            pooled_ratio_ci(x["decode_tokens"], x["decode_steps"]))
    with_ci(row, "tokens/s", float(np.mean(x["tokens_per_s"])), bootstrap_ci(x["tokens_per_s"]))
    row["tokens/s pooled"] = pooled_ratio(x["new"], x["wall"])
    with_ci(row, "decode tokens/s", pooled_ratio(x["decode_tokens"], x["decode_s"]),
            pooled_ratio_ci(x["decode_tokens"], x["decode_s"]))
    row["score"] = key
    with_ci(row, "mean", float(np.mean(scores)) if scores else float("nan"), (low, high))
    row["ci95"] = f"[{low:.3f}, {high:.3f}]"
    fids = [r["fidelity"] for r in rs if r.get("fidelity")]
    if fids:
        exact = [float(f["exact_match"]) for f in fids]
        with_ci(row, "exact_match_rate", float(np.mean(exact)), bootstrap_ci(exact, bounds=UNIT))
        nll = np.array([(f["nll"], f["greedy_nll"]) for f in fids], dtype=float)
        nll = nll[np.isfinite(nll).all(axis=1)]
        delta = nll[:, 0] - nll[:, 1]
        row.update(n_nll=len(nll), nll=_mean(nll[:, 0]), greedy_nll=_mean(nll[:, 1]))
        with_ci(row, "delta_nll", _mean(delta), bootstrap_ci(delta))
    return row


def compare_runs(records: Sequence[dict], base_records: Sequence[dict]) -> dict[str, float]:
    """``speedup`` (decode tokens/s over the baseline's; records without timings: mean tokens/s),
    ``speedup e2e`` (pooled end-to-end tokens/s) and ``tau_gain`` (paper_tau ratio - 1) of a run
    over ``base_records``, each with its paired interval, on the prompts both hold (nan without them)."""
    a, b = _paired(records, base_records)
    row: dict[str, float] = {}
    if not a:
        for column in ("speedup", "speedup e2e", "tau_gain"):
            with_ci(row, column, float("nan"), (float("nan"), float("nan")))
        return row
    x, y = per_example(a), per_example(b)
    ones = np.ones(len(a))
    timed = x["decode_s"].sum() > 0 and y["decode_s"].sum() > 0  # older records: no times, mean tokens/s
    num, den = ("decode_tokens", "decode_s") if timed else ("tokens_per_s", None)
    speed = [x[num], x[den] if den else ones, y[num], y[den] if den else ones]
    with_ci(row, "speedup", _ratio(pooled_ratio(*speed[:2]), pooled_ratio(*speed[2:])), paired_ratio_ci(*speed))
    e2e = [x["new"], x["wall"], y["new"], y["wall"]]
    with_ci(row, "speedup e2e", _ratio(pooled_ratio(*e2e[:2]), pooled_ratio(*e2e[2:])), paired_ratio_ci(*e2e))
    tau = [x["decode_tokens"], x["decode_steps"], y["decode_tokens"], y["decode_steps"]]
    low, high = paired_ratio_ci(*tau)
    with_ci(row, "tau_gain", _ratio(pooled_ratio(*tau[:2]), pooled_ratio(*tau[2:])) - 1, (low - 1, high - 1))
    return row


def agreement(task: str, records: Sequence[dict], reference_records: Sequence[dict]) -> dict[str, float]:
    """``agreement``: share of the prompts both runs hold where ``records`` give the answer
    ``reference_records`` give (:func:`~dropmatch.tasks.metrics.answers_agree`; the reference: a
    lossless run), with its interval; nan where no pair of records can be compared. A run compared with
    itself agrees by construction: 1 [1, 1]."""
    same = []
    for r, ref in zip(*_paired(records, reference_records), strict=True):
        if "output" in r and "output" in ref:
            try:
                same.append(float(answers_agree(task, r, ref)))
            except ValueError:  # pass / fail tasks whose records hold no score
                continue
    row: dict[str, float] = {}
    itself = records is reference_records
    with_ci(row, "agreement", float(np.mean(same)) if same else float("nan"),
            bootstrap_ci(same, bounds=None if itself else UNIT))
    return row


def _paired(records: Sequence[dict], base_records: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """The records of the prompts both runs hold, in the first run's order (by ``id``; by position
    for records without one)."""
    base = {r.get("id", i): r for i, r in enumerate(base_records)}
    keys = [(r.get("id", i), r) for i, r in enumerate(records)]
    shared = [(r, base[k]) for k, r in keys if k in base]
    return [r for r, _ in shared], [b for _, b in shared]


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else float("nan")


def pooled_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """sum(num) / sum(den), nan where the denominator is 0 (a share of nothing is undefined, not 0)."""
    return _ratio(float(np.sum(num)), float(np.sum(den)))


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b else float("nan")


def _is_baseline(method: str, baseline: str) -> bool:
    return method == baseline or method.startswith(baseline + "@") or method.startswith(baseline + "(")


def _draft_length(method: str) -> str | None:
    return method.rsplit("@", 1)[1] if "@" in method else None


COLUMNS = ["task", "method", "n", "tau", "paper_tau", "tokens/s", "tokens/s pooled", "decode tokens/s", "speedup",
           "speedup e2e", "tau_gain", "score", "mean", "ci95", "agreement", "exact_match_rate", "nll", "greedy_nll",
           "delta_nll", "n_nll"]


def summarize_files(paths: Sequence[str | Path], baseline: str = "sd") -> list[dict]:
    records = []
    for path in map(Path, paths):
        if not path.exists():
            raise ConfigError(f"no such results file: {path}")
        found = read_results(path, repair=False, key="id")
        if not found:
            raise ConfigError(f"no results in {path}")
        missing = [k for k in ("task", "method", "stats") if k not in found[0]]
        if missing:
            raise ConfigError(f"{path} holds no decoding results (its records have no {', '.join(missing)}); "
                              f"summarize takes the JSON lines of `dropmatch run`")
        records += found
    return summarize_records(records, baseline)
