"""DropMatch head overhead on the embedded pair: ``make bench-dropmatch``.

    python -m dropmatch.benchmarks.dropmatch_overhead [--prompts 4] [--max-new-tokens 96] [--repeats 3]

1. Greedy standard SD runs on 4-shot GSM8K prompts; every verify step's tensors are recorded and
   the mean verify-step time (target trunk + head + rule) is measured.
2. The recorded steps are replayed through each rule, interleaved and repeated: standard
   verification and DropMatch (naive, js, js+majority; K = 5, p_drop = 0.3, bfloat16 and float32
   perturbation GEMMs). The head overhead is the extra rule time per step as a percentage of the
   standard verify step. Identical inputs for every rule, so the difference is the heads alone.
3. End to end: tau and tokens/s of SD and SD + DropMatch on the same prompts, same process.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from ..drafters import ModelDrafter
from ..engine import generate
from ..methods import Decoder, MethodConfig, build_rule
from ..models import load_pair
from ..verification import StandardVerification, VerifyInput
from .common import format_table, gsm8k_fewshot_prompts, machine_line


class _Recorder(StandardVerification):
    def __init__(self) -> None:
        self.steps: list[VerifyInput] = []

    def verify(self, inp: VerifyInput):
        self.steps.append(inp)
        return super().verify(inp)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-len", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--p-drop", type=float, default=0.3)
    args = parser.parse_args(argv)

    pair = load_pair("gemma-3-270m")
    prompts = [pair.encode(p) for p in gsm8k_fewshot_prompts(args.prompts)]
    recorder = _Recorder()
    verify_s = steps = 0.0
    with torch.inference_mode():
        for ids in prompts:
            s = generate(pair.target, ids, drafter=ModelDrafter(pair.draft), rule=recorder,
                         draft_len=args.draft_len, max_new_tokens=args.max_new_tokens,
                         eos_token_ids=pair.eos_token_ids).stats
            verify_s += s.verify_s
            steps += s.verify_steps
    step_ms = 1000 * verify_s / steps

    variants = {"standard": MethodConfig("sd")}
    for criterion in ("naive", "js", "js+majority"):
        for dtype in ("bfloat16", "float32"):
            variants[f"dropmatch {criterion} ({dtype} heads)"] = MethodConfig(
                "dropmatch", k=args.k, p_drop=args.p_drop, criterion=criterion, head_dtype=dtype)
    rules = {name: build_rule(pair.target, config) for name, config in variants.items()}
    seconds = dict.fromkeys(rules, 0.0)
    evaluations = dict.fromkeys(rules, 0)
    with torch.inference_mode():
        for repeat in range(args.repeats):
            for i, inp in enumerate(recorder.steps):
                for name, rule in rules.items():
                    seeded = replace(inp, generator=torch.Generator().manual_seed(i))
                    start = time.perf_counter()
                    verdict = rule.verify(seeded)
                    seconds[name] += time.perf_counter() - start
                    if repeat == 0:
                        evaluations[name] += verdict.criterion_evaluations
    n = len(recorder.steps) * args.repeats
    base = 1000 * seconds["standard"] / n
    rows = []
    for name in rules:
        rule_ms = 1000 * seconds[name] / n
        rows.append({"rule": name, "rule time / step (ms)": rule_ms,
                     "positions with heads / step": evaluations[name] / len(recorder.steps),
                     "head overhead (% of verify step)": 100 * (rule_ms - base) / step_ms})

    e2e = []
    for label, config in (("SD", MethodConfig("sd", draft_len=args.draft_len)),
                          ("SD + DropMatch js+majority", MethodConfig("dropmatch", draft_len=args.draft_len,
                                                                      k=args.k, p_drop=args.p_drop))):
        decoder = Decoder(pair, config)
        tokens = wall = calls = 0
        for ids in prompts:
            s = decoder.generate(ids, max_new_tokens=args.max_new_tokens).stats
            tokens, wall, calls = tokens + s.new_tokens, wall + s.wall_s, calls + s.target_calls
        e2e.append({"method": label, "tau": tokens / calls, "tokens/s": tokens / wall})
    e2e[1]["vs SD"] = e2e[1]["tokens/s"] / e2e[0]["tokens/s"]
    e2e[0]["vs SD"] = 1.0

    print(f"# DropMatch overhead: {len(recorder.steps)} recorded verify steps from {len(prompts)} 4-shot GSM8K "
          f"prompts (L={args.draft_len}, K={args.k}, p_drop={args.p_drop}), x{args.repeats}; {machine_line()}")
    print(f"mean standard verify step (target trunk + head + rule): {step_ms:.1f} ms")
    print(format_table(rows, ["rule", "rule time / step (ms)", "positions with heads / step",
                              "head overhead (% of verify step)"]))
    print()
    print(format_table(e2e, ["method", "tau", "tokens/s", "vs SD"]))


if __name__ == "__main__":
    main()
