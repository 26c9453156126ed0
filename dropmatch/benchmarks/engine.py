"""Engine benchmark: our AR and SD against Hugging Face ``generate`` on the embedded pair.

    python -m dropmatch.benchmarks.engine [--prompts 4] [--max-new-tokens 96] [--draft-len 5] [--repeats 2]

All rows are measured in one process, interleaved prompt by prompt, on 4-shot GSM8K prompts with
greedy decoding. Tokens/s is total new tokens over total wall time (prefill included) per method;
speedups are ratios against rows of the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..drafters import ModelDrafter, NgramDrafter
from ..engine import generate
from ..models import load_pair
from .common import format_table, gsm8k_fewshot_prompts, machine_line


def _hf_runner(pair, **kwargs):
    model = pair.target.model

    def run(ids: list[int], max_new: int) -> tuple[list[int], float]:
        inputs = torch.tensor([ids])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new,
                                 do_sample=False, **kwargs)
        return out[0, len(ids):].tolist(), time.perf_counter() - start

    return run


def _our_runner(pair, drafter_factory, draft_len):
    def run(ids: list[int], max_new: int) -> tuple[list[int], float, float]:
        drafter = drafter_factory() if drafter_factory else None
        result = generate(pair.target, ids, drafter=drafter, draft_len=draft_len, max_new_tokens=max_new,
                          eos_token_ids=pair.eos_token_ids)
        return result.token_ids, result.stats.wall_s, result.stats.target_calls

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-len", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (interleaved)")
    args = parser.parse_args(argv)

    pair = load_pair("gemma-3-270m")
    L = args.draft_len
    hf_assist = dict(assistant_model=pair.draft.model, num_assistant_tokens=L,
                     num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    methods = {
        "HF generate (plain)": _hf_runner(pair),
        f"HF assisted (int8 draft, L={L})": _hf_runner(pair, **hf_assist),
        f"HF prompt lookup (L={L})": _hf_runner(pair, prompt_lookup_num_tokens=L),
        "ours AR": _our_runner(pair, None, L),
        f"ours SD (int8 draft, L={L})": _our_runner(pair, lambda: ModelDrafter(pair.draft), L),
        f"ours SD (n-gram, L={L})": _our_runner(pair, NgramDrafter, L),
    }
    prompts = [pair.encode(p) for p in gsm8k_fewshot_prompts(args.prompts)]
    for run in methods.values():  # warm-up
        run(prompts[0][:64], 8)
    totals = {name: {"tokens": 0, "seconds": 0.0, "calls": 0, "identical": True} for name in methods}
    reference: dict[int, list[int]] = {}
    for _ in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name, run in methods.items():
                out = run(ids, args.max_new_tokens)
                tokens, seconds = out[0], out[1]
                reference.setdefault(i, tokens if name.startswith("HF generate") else None)
                row = totals[name]
                row["tokens"] += len(tokens)
                row["seconds"] += seconds
                row["calls"] += out[2] if len(out) > 2 else 0
                row["identical"] &= tokens == reference[i]
    plain = totals["HF generate (plain)"]["tokens"] / totals["HF generate (plain)"]["seconds"]
    assisted_name = f"HF assisted (int8 draft, L={L})"
    assisted = totals[assisted_name]["tokens"] / totals[assisted_name]["seconds"]
    rows = []
    for name, t in totals.items():
        speed = t["tokens"] / t["seconds"]
        rows.append({"method": name, "tokens/s": speed, "tau": t["tokens"] / t["calls"] if t["calls"] else "",
                     "vs HF plain": speed / plain, "vs HF assisted": speed / assisted,
                     "identical to greedy": "yes" if t["identical"] else "NO"})
    print(f"# engine benchmark: {len(prompts)} 4-shot GSM8K prompts x {args.repeats}, "
          f"{args.max_new_tokens} new tokens, greedy; {machine_line()}")
    print(format_table(rows, ["method", "tokens/s", "tau", "vs HF plain", "vs HF assisted", "identical to greedy"]))


if __name__ == "__main__":
    main()
