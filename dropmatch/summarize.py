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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .runner import read_results

PRIMARY_SCORE = {"gsm8k": "exact_match", "mmlu": "accuracy", "humaneval": "pass@1", "ifeval": "prompt_level_strict_acc",
                 "klue_nli": "accuracy", "mt_bench": "output_chars", "komt_bench": "output_chars",
                 "kullm": "output_chars"}


def bootstrap_ci(values: Sequence[float], n_resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean."""
    values = np.asarray(values, dtype=float)
    if len(values) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(n_resamples, len(values)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summarize_records(records: Sequence[dict], baseline: str = "sd") -> list[dict]:
    """Rows (dicts) of the summary table; ``baseline`` names a method label or its prefix."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["task"], r["method"])].append(r)
    rows = []
    for (task, method), rs in sorted(groups.items()):
        tokens = sum(r["stats"]["new_tokens"] for r in rs)
        calls = sum(r["stats"]["target_calls"] for r in rs)
        speeds = pooled_speeds([r["stats"] for r in rs])
        key = PRIMARY_SCORE.get(task)
        if any("judge_score" in r["score"] for r in rs):  # an LLM judge graded this run
            key = "judge_score"
        scores = [r["score"][key] for r in rs if key in r["score"]]
        if key is not None and not scores and any(r["score"] for r in rs):
            raise ValueError(f"{task}/{method}: no record has the score {key!r}; "
                             f"the records have {sorted(rs[0]['score'])}")
        low, high = bootstrap_ci(scores)
        row = {"task": task, "method": method, "n": len(rs), "tau": tokens / calls if calls else float("nan"),
               "paper_tau": speeds["paper_tau"],
               "tokens/s": float(np.mean([r["stats"]["tokens_per_s"] for r in rs])),
               "tokens/s pooled": speeds["tokens/s pooled"], "decode tokens/s": speeds["decode tokens/s"],
               "score": key, "mean": float(np.mean(scores)) if scores else float("nan"),
               "ci95": f"[{low:.3f}, {high:.3f}]"}
        fids = [r["fidelity"] for r in rs if r.get("fidelity")]
        if fids:
            row["exact_match_rate"] = float(np.mean([f["exact_match"] for f in fids]))
            row["nll"] = float(np.mean([f["nll"] for f in fids]))
            row["greedy_nll"] = float(np.mean([f["greedy_nll"] for f in fids]))
        rows.append(row)
    for row in rows:
        base = [b for b in rows if b["task"] == row["task"] and _is_baseline(b["method"], baseline)]
        if len(base) > 1:  # e.g. sd@L5 and sd@L10: compare with the one at the same draft length
            base = [b for b in base if _draft_length(b["method"]) == _draft_length(row["method"])] or base[:0]
        if len(base) > 1:
            raise ValueError(f"baseline {baseline!r} matches several runs of {row['task']}: "
                             f"{', '.join(b['method'] for b in base)}; name one exactly")
        decode = row["decode tokens/s"] == row["decode tokens/s"]  # older records: no times, mean tokens/s
        speed = "decode tokens/s" if decode else "tokens/s"
        row["speedup"] = _ratio(row[speed], base[0][speed]) if base else float("nan")
        row["speedup e2e"] = _ratio(row["tokens/s pooled"], base[0]["tokens/s pooled"]) if base else float("nan")
    return rows


def pooled_speeds(stats: Sequence[dict]) -> dict[str, float]:
    """``paper_tau``, ``tokens/s pooled`` and ``decode tokens/s`` (pooled after the prefill) of several
    generations' statistics (``GenerationStats.to_dict()``; records without ``generations`` count one)."""
    gens = [s.get("generations", 1) for s in stats]
    new = sum(s["new_tokens"] for s in stats)
    wall = sum(s.get("wall_s", 0.0) for s in stats)
    decode_tokens = sum(max(s["new_tokens"] - g, 0) for s, g in zip(stats, gens, strict=True))
    decode_steps = sum(max(s["target_calls"] - g, 0) for s, g in zip(stats, gens, strict=True))
    decode_s = sum(max(s.get("wall_s", 0.0) - s.get("prefill_s", 0.0), 0.0) for s in stats)
    nan = float("nan")
    return {"paper_tau": decode_tokens / decode_steps if decode_steps else nan,
            "tokens/s pooled": new / wall if wall > 0 else nan,
            "decode tokens/s": decode_tokens / decode_s if decode_s > 0 else nan}


def _ratio(a: float, b: float) -> float:
    return a / b if b and b == b else float("nan")


def _is_baseline(method: str, baseline: str) -> bool:
    return method == baseline or method.startswith(baseline + "@") or method.startswith(baseline + "(")


def _draft_length(method: str) -> str | None:
    return method.rsplit("@", 1)[1] if "@" in method else None


COLUMNS = ["task", "method", "n", "tau", "paper_tau", "tokens/s", "tokens/s pooled", "decode tokens/s", "speedup",
           "speedup e2e", "score", "mean", "ci95", "exact_match_rate", "nll", "greedy_nll"]


def summarize_files(paths: Sequence[str | Path], baseline: str = "sd") -> list[dict]:
    records = [r for p in paths for r in read_results(Path(p), repair=False)]
    return summarize_records(records, baseline)
