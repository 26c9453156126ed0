"""EAGLE-3 + DropMatch against EAGLE-3 alone (paper Table 7, Fig. 1b) on the embedded pair.

    python -m dropmatch.benchmarks.eagle3_dropmatch [--prompts 12] [--max-new-tokens 64] [--draft-len 5]
                                                    [--tasks gsm8k mt_bench komt_bench] [--p-drop 0.3 0.032]

Greedy decoding. Per task, every prompt is decoded by every method in turn (one process, interleaved),
after one untimed warm-up generation per method. Methods: plain AR, EAGLE-3 chain SD (lossless), and
EAGLE-3 + DropMatch (K = 5) with the paper's Table 7 criterion (naive) and with js+majority, at each
``--p-drop``. Reported per task and method: the paper's tau (tokens per verify step) with a 95 %
bootstrap interval over prompts, pooled decode tokens/s (tokens after the first over the time after the
prefill), and the ratios to EAGLE-3 alone of decode tokens/s and of tau, each a ratio of sums with a
paired 95 % bootstrap interval over prompts; plus the share of prompts whose output equals EAGLE-3's
(the target's greedy output).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError, run_command
from ..intervals import bootstrap_ci, paired_ratio_ci
from ..methods import Decoder, MethodConfig
from ..models import load_pair
from ..provenance import machine_line
from .common import format_table
from .draft_tau import task_prompts


@dataclass
class PerPrompt:
    """One method's per-prompt totals: decode tokens, decode seconds, verify steps, outputs."""

    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, result) -> None:
        s = result.stats
        self.tokens.append(s.decode_tokens)
        self.seconds.append(s.decode_s)
        self.steps.append(s.decode_steps)
        self.outputs.append(result.token_ids)


def ratio_ci(num: np.ndarray, den: np.ndarray, base_num: np.ndarray, base_den: np.ndarray) -> tuple[float, float, float]:
    """(sum num / sum den) / (sum base_num / sum base_den) and its paired 95 % bootstrap interval over
    prompts (:func:`~dropmatch.intervals.paired_ratio_ci`)."""
    point = (num.sum() / den.sum()) / (base_num.sum() / base_den.sum())
    return (float(point), *paired_ratio_ci(num, den, base_num, base_den))


def mean_ci(values: np.ndarray) -> tuple[float, float, float]:
    """The mean and its 95 % bootstrap interval (:func:`~dropmatch.intervals.bootstrap_ci`)."""
    return (float(values.mean()), *bootstrap_ci(values))


def methods(draft_len: int, p_drops: list[float], k: int) -> dict[str, MethodConfig]:
    out = {"AR": MethodConfig("ar"), "EAGLE-3": MethodConfig("sd", draft="eagle3", draft_len=draft_len)}
    for p in p_drops:
        for criterion in ("naive", "js+majority"):
            out[f"EAGLE-3 + DM {criterion} p={p:g}"] = MethodConfig(
                "dropmatch", draft="eagle3", draft_len=draft_len, k=k, p_drop=p, criterion=criterion)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-len", type=int, default=5)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--p-drop", type=float, nargs="+", default=[0.3, 0.032])
    parser.add_argument("--tasks", nargs="+", default=["gsm8k", "mt_bench", "komt_bench"])
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error("--prompts and --max-new-tokens must be >= 1")
    try:  # bad K, p_drop or draft length: a clean message before the model loads
        configs = methods(args.draft_len, args.p_drop, args.k)
    except ConfigError as err:
        parser.error(str(err))

    pair = load_pair("gemma-3-270m")
    decoders = {name: Decoder(pair, config) for name, config in configs.items()}
    print(f"# EAGLE-3 + DropMatch vs EAGLE-3 alone, Gemma-3-270M, greedy, L = {args.draft_len}, K = {args.k}, "
          f"{args.prompts} prompts x {args.max_new_tokens} new tokens per task; {machine_line()}")
    rows = []
    for task in args.tasks:
        prompts = task_prompts(task, args.prompts)
        for decoder in decoders.values():
            decoder.warm_up(prompts[0])
        runs = {name: PerPrompt() for name in decoders}
        for i, prompt in enumerate(prompts):
            for name, decoder in decoders.items():
                runs[name].add(decoder.generate(prompt, max_new_tokens=args.max_new_tokens, seed=i))
        base = runs["EAGLE-3"]
        b_tok, b_sec, b_steps = (np.asarray(x, dtype=float) for x in (base.tokens, base.seconds, base.steps))
        for name, run in runs.items():
            tok, sec, steps = (np.asarray(x, dtype=float) for x in (run.tokens, run.seconds, run.steps))
            tau = mean_ci(tok / np.maximum(steps, 1))
            speed = ratio_ci(tok, sec, b_tok, b_sec)
            tau_ratio = ratio_ci(tok, np.maximum(steps, 1), b_tok, np.maximum(b_steps, 1))
            same = np.mean([a == b for a, b in zip(run.outputs, base.outputs, strict=True)])
            rows.append({"task": task, "method": name, "n": len(prompts),
                         "paper tau [95% CI]": f"{tau[0]:.2f} [{tau[1]:.2f}, {tau[2]:.2f}]",
                         "decode tokens/s": f"{tok.sum() / sec.sum():.1f}",
                         "speed vs EAGLE-3 [95% CI]": f"{speed[0]:.3f} [{speed[1]:.3f}, {speed[2]:.3f}]",
                         "tau vs EAGLE-3 [95% CI]": f"{tau_ratio[0]:.3f} [{tau_ratio[1]:.3f}, {tau_ratio[2]:.3f}]",
                         "output = EAGLE-3": f"{same:.2f}"})
        print(format_table([r for r in rows if r["task"] == task], list(rows[0])), flush=True)
    print("paper (Table 7, Llama-3.3-70B, naive, p_drop 0.3, K 5, L 5): tau 5.82 -> 6.09 on GSM8K (1.05x), "
          "speed 4.19x -> 4.32x over AR (1.03x); up to 1.09x at L 9")


if __name__ == "__main__":
    sys.exit(run_command(main))
