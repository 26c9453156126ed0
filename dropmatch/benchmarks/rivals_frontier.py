"""Lossy rules on the fidelity-vs-tau plane, side by side on the embedded pair (int8 draft, greedy).

    python -m dropmatch.benchmarks.rivals_frontier [--prompts 8] [--max-new-tokens 48] [--draft-len 5]

Prompts: the GSM8K test questions asked zero-shot ("Question: ...", the last block of the task's
8-shot prompt, so the prefill stays short). Every rule decodes every prompt; the reference is the
target's own greedy output (plain AR). Reported per rule: the paper's tau (tokens per verify step),
with a 95 % bootstrap interval over prompts; the share of outputs identical to the greedy output;
the mean target NLL per token of the output minus that of the greedy output (nats; 0 = as likely as
greedy under the target); tokens accepted beyond exact match per verify step.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ..errors import run_command
from ..fidelity import compare_to_greedy, target_nll
from ..methods import Decoder, MethodConfig
from ..models import load_pair
from ..provenance import machine_line
from ..tasks import load_task
from .common import format_table
from .eagle3_dropmatch import mean_ci


def rules(draft_len: int) -> dict[str, MethodConfig]:
    """SD, DropMatch at the paper's and the equal-noise p_drop, the older rivals and the two new ones."""
    def cfg(method: str, **kw) -> MethodConfig:
        return MethodConfig(method, draft_len=draft_len, **kw)

    return {
        "SD (lossless)": cfg("sd"),
        "DropMatch js+majority K=5 p=0.3": cfg("dropmatch", k=5, p_drop=0.3),
        "DropMatch js+majority K=5 p=0.032": cfg("dropmatch", k=5, p_drop=0.032),
        "DropMatch naive K=5 p=0.3": cfg("dropmatch", k=5, p_drop=0.3, criterion="naive"),
        "top-K (K=2)": cfg("topk", topk=2),
        "typical (eps=0.09, delta=0.3)": cfg("typical"),
        "FLy (H3>=0.3, W=1)": cfg("fly", fly_entropy=0.3, fly_window=1),
        "FLy (H3>=0.3, W=2)": cfg("fly", fly_entropy=0.3, fly_window=2),
        "ensemble (w=0.5)": cfg("ensemble", ensemble_weight=0.5),
        "ensemble (w=0.8)": cfg("ensemble", ensemble_weight=0.8),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--draft-len", type=int, default=5)
    args = parser.parse_args(argv)

    pair = load_pair("gemma-3-270m")
    prompts = ["Question:" + ex.prompt.split("Question:")[-1] for ex in load_task("gsm8k", limit=args.prompts)]
    ids = [pair.encode(p) for p in prompts]
    greedy = Decoder(pair, MethodConfig("ar"))
    references = []
    for prompt in ids:
        out = greedy.generate(prompt, max_new_tokens=args.max_new_tokens).token_ids
        references.append((out, target_nll(pair.target, prompt, out)))
    rows = []
    for name, config in rules(args.draft_len).items():
        decoder = Decoder(pair, config)
        taus, same, delta, extra, steps = [], [], [], 0, 0
        for i, (prompt, (ref, ref_nll)) in enumerate(zip(ids, references, strict=True)):
            result = decoder.generate(prompt, max_new_tokens=args.max_new_tokens, seed=i)
            fid = compare_to_greedy(pair.target, prompt, result.token_ids, ref, ref_nll)
            taus.append(result.stats.paper_tau)
            same.append(fid.exact_match)
            delta.append(fid.nll - fid.greedy_nll)
            extra += result.stats.extra_accepts
            steps += result.stats.decode_steps
        tau = mean_ci(np.asarray(taus))
        d = mean_ci(np.asarray(delta))
        rows.append({"rule": name, "n": len(ids), "paper tau [95% CI]": f"{tau[0]:.2f} [{tau[1]:.2f}, {tau[2]:.2f}]",
                     "= greedy": f"{np.mean(same):.2f}",
                     "delta NLL/token [95% CI]": f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]",
                     "extra accepts/step": f"{extra / max(steps, 1):.2f}"})
        print(rows[-1], flush=True)
    print(f"# lossy rules, Gemma-3-270M + int8 draft, zero-shot GSM8K, {args.prompts} prompts x "
          f"{args.max_new_tokens} tokens, L = {args.draft_len}, greedy; {machine_line()}")
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    sys.exit(run_command(main))
