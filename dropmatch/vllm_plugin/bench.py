"""Paper Table 5 inside vLLM: n-gram SD with and without DropMatch at several batch sizes, one process.

    python -m dropmatch.vllm_plugin.bench [--batch-sizes 1,2,4,8] [--prompts 8] [--max-tokens 32]
        [--draft-len 10] [--model DIR] [--device cpu|cuda] [--tp 1]

One engine with the plugin configured runs both arms: stock speculative decoding is the same engine
with DropMatch disabled at run time (``dropmatch_set(enabled=False)``: vLLM's rule, untouched). At
each batch size the same ``--prompts`` GSM8K questions (2-shot) go through in ``generate`` calls of
``batch`` prompts (so ``batch`` requests run concurrently), the arms alternating per call after one
warm-up call per arm. Tokens/s is new tokens over wall time; tau is vLLM's mean acceptance length
(bonus token included) from its per-request metrics; "same" is the share of requests whose tokens
equal stock SD's. Paper column: Table 5 (Llama-3.1-70B, GSM8K, L = 10, A100, vLLM TP = 4).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from ..errors import run_command

PAPER_TABLE5 = {1: 1.19, 4: 1.18, 16: 1.12, 32: 1.10, 64: 1.15, 128: 1.10}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--draft-len", type=int, default=10, help="num_speculative_tokens L (paper: 10)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--p-drop", type=float, default=0.3)
    ap.add_argument("--criterion", default="js+majority")
    ap.add_argument("--model", default=None, help="model directory; default: the embedded Gemma-3-270M")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    return ap.parse_args(argv)


def build_llm(args: argparse.Namespace, max_batch: int):
    from vllm import LLM

    from .weights import vllm_model_dir

    cpu = args.device == "cpu"
    return LLM(model=args.model or str(vllm_model_dir()), dtype="float32" if cpu else "auto", enforce_eager=cpu,
               max_model_len=2048, max_num_seqs=max_batch, seed=0, tensor_parallel_size=args.tp,
               speculative_config={"method": "ngram", "num_speculative_tokens": args.draft_len,
                                   "prompt_lookup_max": 3},
               per_request_spec_decode_metrics="summary",
               additional_config={"dropmatch": {"k": args.k, "p_drop": args.p_drop, "criterion": args.criterion,
                                                "seed": 0}})


def measure(llm, prompts: list[str], batch: int, max_tokens: int) -> dict[str, dict]:
    """Both arms over ``prompts`` in calls of ``batch``: tokens, wall time, metrics, extra acceptances."""
    from vllm import SamplingParams

    from .metrics import dropmatch_stats, request_metrics

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    arms = {"sd": {"enabled": False}, "sd+dm": {"enabled": True}}
    results = {name: {"tokens": [], "wall": 0.0, "metrics": [], "extra": 0} for name in arms}
    for settings in arms.values():  # warm-up at this batch size
        llm.collective_rpc("dropmatch_set", kwargs=settings)
        llm.generate(prompts[:batch], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        for name, settings in arms.items():
            llm.collective_rpc("dropmatch_set", kwargs=settings)
            dropmatch_stats(llm, reset=True)
            t0 = time.perf_counter()
            outputs = llm.generate(chunk, params, use_tqdm=False)
            results[name]["wall"] += time.perf_counter() - t0
            results[name]["tokens"] += [list(o.outputs[0].token_ids) for o in outputs]
            results[name]["metrics"] += [request_metrics(o.outputs[0]) for o in outputs]
            results[name]["extra"] += dropmatch_stats(llm)["extra_accepted"]
    return results


def table_rows(batch: int, results: dict[str, dict]) -> dict:
    from .metrics import aggregate

    sd, dm = results["sd"], results["sd+dm"]
    tps = {name: sum(map(len, r["tokens"])) / r["wall"] for name, r in results.items()}
    tau = {name: aggregate(r["metrics"])["mean_acceptance_length"] for name, r in results.items()}
    same = sum(a == b for a, b in zip(sd["tokens"], dm["tokens"], strict=True)) / len(sd["tokens"])
    paper = PAPER_TABLE5.get(batch)
    return {"batch": batch, "SD tok/s": tps["sd"], "SD+DM tok/s": tps["sd+dm"],
            "ratio": tps["sd+dm"] / tps["sd"], "paper ratio": f"{paper:.2f}x" if paper else "-",
            "SD tau": tau["sd"], "SD+DM tau": tau["sd+dm"], "tau ratio": tau["sd+dm"] / tau["sd"],
            "extra accepted": dm["extra"], "same tokens": same}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from ..benchmarks.common import format_table, gsm8k_fewshot_prompts

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = gsm8k_fewshot_prompts(args.prompts, shots=2)
    llm = build_llm(args, max(sizes))
    rows = [table_rows(b, measure(llm, prompts, b, args.max_tokens)) for b in sizes]
    import torch
    import vllm

    print(f"\nvLLM {vllm.__version__} ({args.device}, TP {args.tp}), torch {torch.__version__}, "
          f"{platform.machine()}; n-gram SD L={args.draft_len}, DropMatch K={args.k} p_drop={args.p_drop} "
          f"{args.criterion}; {len(prompts)} GSM8K prompts (2-shot), {args.max_tokens} new tokens, greedy")
    print(format_table(rows, list(rows[0])))
    print("paper ratio: Table 5, SD + DM over SD (Llama-3.1-70B / 8B draft, GSM8K, L=10, vLLM TP=4, A100)")


if __name__ == "__main__":
    sys.exit(run_command(main))
