"""Where speculative decoding's speedup goes on this machine: what a verify step costs by its rows, and what
the steps of lookup-first + EAGLE-3 drafting (the ``make bench-engine`` row) propose and keep.

    python -m dropmatch.benchmarks.verify_rows [--rounds 15] [--prompts 4] [--max-new-tokens 96]
                                               [--lookup-len 8] [--draft-stop 0.4] [--goal 2.0]

1. **Cost by rows.** On the KV cache of the first bench-engine prompt, the target's trunk and its greedy
   head run on n = 1 .. lookup-len + 1 rows (ids drawn from the vocabulary; the cache is rolled back after
   each), every n once per round, interleaved, after a warm-up round. Per n: median ms of the trunk and the
   head, their sum over the 1-row sum (pooled over rounds, 95 % paired bootstrap interval over rounds), and
   ``tau for goal``: the tokens a step of n rows must emit for SD's decode to run ``--goal`` x AR's with
   free drafting, ``goal x cost(n) / cost(1)``.
2. **The steps.** The bench-engine prompts decoded greedily by our AR and by lookup-first + EAGLE-3,
   interleaved. Per proposer (n-gram lookup, or the EAGLE-3 head where nothing matched): its steps, the
   tokens it drafted and the target kept per step, and the share of its steps that kept none. Then the
   decode speedup over AR the steps predict from table 1 (AR: cost(1) a token; SD: cost(rows) a step plus
   the measured drafting) beside the measured one, so the cost model can be checked before it is believed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from ..drafters import Draft, LookupFirstDrafter
from ..drafters.eagle3 import Eagle3Drafter, committed_head, drafting_dtype, load_head
from ..engine import generate
from ..errors import ConfigError
from ..intervals import paired_ratio_ci
from ..models import CausalLM, load_pair, rollback
from ..provenance import machine_line
from ..sampling import SamplingConfig
from .common import format_table, gsm8k_fewshot_prompts


def verify_cost_by_rows(target: CausalLM, prompt: Sequence[int], rows: Sequence[int], rounds: int,
                        seed: int = 0) -> dict[int, tuple[list[float], list[float]]]:
    """Seconds of the trunk and of the greedy head on n rows after ``prompt``, per n: ``{n: (trunk s, head s)}``,
    one entry per round (rows interleaved within a round; one warm-up round first, not kept)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    times: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in rows}
    with torch.inference_mode():
        cache, _ = target.new_cache(prompt_ids=torch.as_tensor(list(prompt), device=target.device))
        for round_ in range(rounds + 1):
            for n in rows:
                ids = torch.randint(0, vocab, (n,), generator=generator).to(target.device)
                start = time.perf_counter()
                hidden = target.hidden(ids, cache)
                middle = time.perf_counter()
                target.head(hidden, exact=False)
                end = time.perf_counter()
                rollback(cache, n)
                if round_:
                    times[n][0].append(middle - start)
                    times[n][1].append(end - middle)
    return times


def cost_table(times: dict[int, tuple[list[float], list[float]]], goal: float) -> list[dict]:
    """Table 1's rows from :func:`verify_cost_by_rows` (which must include n = 1)."""
    trunk_1, head_1 = times[1]
    base = [t + h for t, h in zip(trunk_1, head_1, strict=True)]
    table = []
    for n, (trunk, head) in times.items():
        total = [t + h for t, h in zip(trunk, head, strict=True)]
        ratio = sum(total) / sum(base)
        lo, hi = paired_ratio_ci(total, [1.0] * len(total), base, [1.0] * len(base))
        table.append({"rows": n, "trunk ms": 1e3 * statistics.median(trunk), "head ms": 1e3 * statistics.median(head),
                      "step ms": 1e3 * statistics.median(total), "x 1 row": ratio, "95% CI": f"[{lo:.2f}, {hi:.2f}]",
                      f"tau for {goal:g}x": goal * ratio})
    return table


class StepCensus:
    """Wraps a :class:`~dropmatch.drafters.LookupFirstDrafter`: records for each proposal who made it (``lookup``
    or the wrapped drafter's name) and how many tokens it drafted, and at its commit how many the target kept."""

    def __init__(self, drafter: LookupFirstDrafter):
        self.drafter, self.name = drafter, drafter.name
        if hasattr(drafter, "feature_layers"):
            self.feature_layers = drafter.feature_layers
        self.steps: list[tuple[str, int, int]] = []  # (proposer, drafted, kept)
        self._pending: tuple[str, int] | None = None

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.drafter.start(prompt_ids, features)

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        before = self.drafter.lookup_steps
        draft = self.drafter.propose(last_token, n, sampling, generator)
        proposer = "n-gram lookup" if self.drafter.lookup_steps > before else self.drafter.drafter.name
        self._pending = (proposer, int(draft.tokens.numel()))
        return draft

    def commit(self, n_accepted: int, features: torch.Tensor | None = None) -> None:
        assert self._pending is not None, "commit without a proposal"
        self.steps.append((*self._pending, n_accepted))
        self._pending = None
        self.drafter.commit(n_accepted, features)


def census_table(steps: Sequence[tuple[str, int, int]]) -> list[dict]:
    """Table 2's rows: per proposer and in all, steps, drafted and kept tokens per step, share keeping none,
    and the verify rows (drafted + 1) per step."""
    groups = {name: [s for s in steps if s[0] == name] for name in sorted({s[0] for s in steps})}
    groups["all steps"] = list(steps)
    return [{"proposer": name, "steps": len(group), "drafted/step": sum(d for _, d, _ in group) / len(group),
             "kept/step": sum(k for _, _, k in group) / len(group),
             "tokens/step": 1 + sum(k for _, _, k in group) / len(group),
             "kept none": sum(k == 0 for _, _, k in group) / len(group)}
            for name, group in groups.items() if group]


def predicted_speedup(steps: Sequence[tuple[str, int, int]], step_ms: dict[int, float], ar_tokens: int,
                      draft_s: float) -> float:
    """Decode speedup over AR by the cost model: AR spends ``step_ms[1]`` on each of its ``ar_tokens`` decode
    tokens; SD ``step_ms[drafted + 1]`` on each verify step plus ``draft_s`` of drafting in all."""
    sd_s = sum(step_ms[d + 1] for _, d, _ in steps) / 1e3 + draft_s
    return ar_tokens * step_ms[1] / 1e3 / sd_s


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds over the row counts")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--lookup-len", type=int, default=8, help="draft length of lookup-first (as bench-engine)")
    parser.add_argument("--draft-stop", type=float, default=0.4, help="the EAGLE-3 head's confidence stop")
    parser.add_argument("--goal", type=float, default=2.0, help="the decode speedup over AR table 1 prices in tau")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.prompts < 1 or args.lookup_len < 1:
        raise ConfigError("--rounds, --prompts and --lookup-len must be at least 1")

    pair = load_pair("gemma-3-270m")
    target = pair.target
    target.prepare()  # the head's copies, built before any clock starts
    head_dir = committed_head(pair.name)
    if head_dir is None:
        raise ConfigError(f"no committed EAGLE-3 head for {pair.name} (make train-draft)")
    head = load_head(head_dir, target, dtype=drafting_dtype(target))
    prompts = [pair.encode(p) for p in gsm8k_fewshot_prompts(args.prompts)]
    rows = list(range(1, args.lookup_len + 2))

    times = verify_cost_by_rows(target, prompts[0], rows, args.rounds)
    costs = cost_table(times, args.goal)
    print(f"# verify step cost by rows: a {len(prompts[0])}-token prompt's cache, {args.rounds} rounds; "
          f"{machine_line()}")
    print(format_table(costs, list(costs[0])))

    def lookup_first() -> StepCensus:
        return StepCensus(LookupFirstDrafter(Eagle3Drafter(head, target, args.draft_stop)))

    generate(target, prompts[0][:64], drafter=lookup_first(), draft_len=args.lookup_len, max_new_tokens=8)
    steps: list[tuple[str, int, int]] = []
    ar_s = sd_s = draft_s = 0.0
    ar_tokens = sd_tokens = 0
    for ids in prompts:  # interleaved prompt by prompt
        ar = generate(target, ids, max_new_tokens=args.max_new_tokens, eos_token_ids=pair.eos_token_ids)
        census = lookup_first()
        sd = generate(target, ids, drafter=census, draft_len=args.lookup_len, max_new_tokens=args.max_new_tokens,
                      eos_token_ids=pair.eos_token_ids)
        if sd.token_ids != ar.token_ids:
            raise SystemExit("lookup-first + EAGLE-3 differs from greedy decoding")
        steps += census.steps
        ar_s += ar.stats.wall_s - ar.stats.prefill_s
        sd_s += sd.stats.wall_s - sd.stats.prefill_s
        draft_s += sd.stats.draft_s
        ar_tokens += ar.stats.decode_tokens
        sd_tokens += sd.stats.decode_tokens
    step_ms = {row["rows"]: row["step ms"] for row in costs}
    print(f"\n# the steps of lookup-first + EAGLE-3 (L<={args.lookup_len}, stop below p={args.draft_stop:g}): "
          f"{len(prompts)} bench-engine prompts x {args.max_new_tokens} new tokens, greedy")
    census_rows = census_table(steps)
    print(format_table(census_rows, list(census_rows[0])))
    measured = (sd_tokens / sd_s) / (ar_tokens / ar_s)
    print(f"\ndecode speedup over AR: measured {measured:.2f}x, predicted by table 1 "
          f"{predicted_speedup(steps, step_ms, ar_tokens, draft_s):.2f}x "
          f"(drafting {1e3 * draft_s / max(len(steps), 1):.1f} ms a step; prefill excluded)")


if __name__ == "__main__":
    main()
