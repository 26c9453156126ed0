"""Shared pieces of the benchmark scripts: fixed prompts, speed totals and table printing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..intervals import paired_ratio_ci
from ..paths import data_dir


def gsm8k_fewshot_prompts(n_prompts: int, shots: int = 4) -> list[str]:
    """The first ``n_prompts`` GSM8K test questions, each after ``shots`` worked train examples."""
    root = data_dir() / "gsm8k"
    train = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()[:shots]]
    test = [json.loads(line) for line in (root / "test.jsonl").read_text().splitlines()[:n_prompts]]
    header = "".join(f"Question: {ex['question']}\nAnswer: {ex['answer']}\n\n" for ex in train)
    return [f"{header}Question: {ex['question']}\nAnswer:" for ex in test]


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A GitHub-markdown table of ``rows`` (dicts) restricted to ``columns``."""
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


SPEED_COLUMNS = ["tokens/s", "tokens/s mean", "decode tokens/s", "tau", "paper tau"]


@dataclass
class SpeedTotals:
    """One method's generations in a benchmark and their totals.

    ``each`` holds every generation's (new tokens, wall s, prefill s, target forwards) in the order added
    (:meth:`speedup_over` pairs them). In :meth:`row`, ``tokens/s`` is pooled end to end (total new tokens
    over total wall time, prefill included), ``tokens/s mean`` the mean over generations, ``decode
    tokens/s`` pooled after the prefill (the tokens after each generation's first over the time after its
    prefill), ``tau`` ours (new tokens per target forward, prefill included) and ``paper tau`` the paper's
    (tokens per verify step).
    """

    each: list[tuple[int, float, float, int]] = field(default_factory=list)
    identical: bool = True

    def add(self, n_tokens: int, seconds: float, prefill_s: float, calls: int = 0) -> None:
        """One generation: its new tokens, wall time, prefill time and target forwards (0: unknown)."""
        self.each.append((n_tokens, seconds, min(prefill_s, seconds), calls))

    def row(self) -> dict:
        tokens, seconds, prefill_s, calls = (sum(column) for column in zip(*self.each, strict=True)) if self.each else (0, 0.0, 0.0, 0)
        generations = len(self.each)
        decode_s = seconds - prefill_s
        decode_tokens = tokens - generations
        per_generation = [n / s if s > 0 else float("nan") for n, s, _, _ in self.each]
        return {"tokens/s": tokens / seconds if seconds > 0 else float("nan"),
                "tokens/s mean": sum(per_generation) / len(per_generation) if per_generation else float("nan"),
                "decode tokens/s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
                "tau": tokens / calls if calls else "",
                "paper tau": decode_tokens / (calls - generations) if calls > generations else ""}

    def speedup_over(self, base: SpeedTotals, decode: bool = False) -> tuple[float, float]:
        """95 % paired bootstrap interval of this method's pooled tokens/s over ``base``'s (``decode``:
        after each generation's prefill, as ``decode tokens/s``), resampling generations: generation i
        of both must be the same prompt and pass (the benchmarks add them in that order)."""
        if len(self.each) != len(base.each):
            raise ValueError(f"{len(self.each)} generations against {len(base.each)}: not paired")

        def columns(totals: SpeedTotals) -> tuple[list[float], list[float]]:
            if decode:
                return [n - 1 for n, _, _, _ in totals.each], [s - p for _, s, p, _ in totals.each]
            return [n for n, _, _, _ in totals.each], [s for _, s, _, _ in totals.each]

        return paired_ratio_ci(*columns(self), *columns(base))
