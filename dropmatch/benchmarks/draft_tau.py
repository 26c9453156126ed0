"""Acceptance of the drafts on the embedded pair: tau at draft length L per task, EAGLE-3 head vs int8 draft,
beside n-gram lookup alone and lookup first with the EAGLE-3 head where nothing matches.

    python -m dropmatch.benchmarks.draft_tau [--prompts 8] [--max-new-tokens 64] [--draft-len 5]
                                             [--tasks gsm8k humaneval mt_bench komt_bench] [--head DIR]

Greedy chain SD (exact match, lossless); tau = new tokens per target forward (prefill included), summed
over the prompts of a task; also the mean accepted draft tokens per verify step, and the drafting and
verification time per step (the drafters run interleaved, prompt by prompt, so these compare). Prompts: the first
``--prompts`` examples of each task's benchmark prompts (GSM8K: the 4-shot prompts of ``make bench-engine``).
"""

from __future__ import annotations

import argparse
import sys

from ..drafters import LookupFirstDrafter, ModelDrafter, NgramDrafter
from ..drafters.eagle3 import Eagle3Drafter, committed_head, drafting_dtype, load_head
from ..engine import generate
from ..errors import run_command
from ..models import load_pair
from ..provenance import machine_line
from ..runner import merge_stats
from ..tasks import load_task
from ..tasks.prompts import chat_prompt
from .common import format_table, gsm8k_fewshot_prompts


def task_prompts(task: str, n: int) -> list[str]:
    """Base-model prompts: GSM8K 4-shot, HumanEval as is, chat tasks' first turn (no chat template)."""
    if task == "gsm8k":
        return gsm8k_fewshot_prompts(n)
    return [ex.prompt if ex.prompt is not None else chat_prompt(ex.turns[:1]) for ex in load_task(task, limit=n)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-len", type=int, default=5)
    parser.add_argument("--tasks", nargs="+", default=["gsm8k", "humaneval", "mt_bench", "komt_bench"])
    parser.add_argument("--head", help="EAGLE-3 head directory (default: the committed one)")
    args = parser.parse_args(argv)

    pair = load_pair("gemma-3-270m")
    head = load_head(args.head or committed_head(pair.name), pair.target, dtype=drafting_dtype(pair.target))
    drafters = {"EAGLE-3 head": lambda: Eagle3Drafter(head, pair.target), "int8 draft": lambda: ModelDrafter(pair.draft),
                "n-gram lookup": NgramDrafter,
                "lookup first, EAGLE-3 head": lambda: LookupFirstDrafter(Eagle3Drafter(head, pair.target))}
    pair.target.prepare()  # the screened head and its reorders, built before any clock starts
    warm = pair.encode("Question: 1 + 1?\nAnswer:")
    for factory in drafters.values():  # first-call costs out of the first task's timings
        generate(pair.target, warm, drafter=factory(), draft_len=args.draft_len, max_new_tokens=8)
    rows = []
    for task in args.tasks:
        prompts = [pair.encode(p) for p in task_prompts(task, args.prompts)]
        runs: dict[str, list] = {name: [] for name in drafters}
        for ids in prompts:  # interleaved prompt by prompt: drift of the machine hits every drafter alike
            for name, factory in drafters.items():
                runs[name].append(generate(pair.target, ids, drafter=factory(), draft_len=args.draft_len,
                                           max_new_tokens=args.max_new_tokens, eos_token_ids=pair.eos_token_ids).stats)
        for name, parts in runs.items():
            s = merge_stats(parts)
            steps = max(len(s.accepted_per_step), 1)
            rows.append({"task": task, "draft": name, f"tau (L={args.draft_len})": s.new_tokens / s.target_calls,
                         "accepted/step": sum(s.accepted_per_step) / steps, "draft ms/step": 1e3 * s.draft_s / steps,
                         "verify ms/step": 1e3 * s.verify_s / steps, "prompts": len(prompts)})
            print(rows[-1], flush=True)
    print(f"# draft acceptance: {args.prompts} prompts per task, {args.max_new_tokens} new tokens, greedy; "
          f"{machine_line()}")
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    sys.exit(run_command(main))
