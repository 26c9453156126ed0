"""Shared pieces of the benchmark scripts: fixed prompts and table printing."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence

import torch

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


def machine_line() -> str:
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, python {platform.python_version()}")
