"""Where speculative decoding's speedup goes on this machine: what a verify step costs by its rows, and what
the steps of lookup-first + EAGLE-3 drafting (the ``make bench-engine`` row) propose and keep.

    python -m dropmatch.benchmarks.verify_rows [--rounds 15] [--prompts 4] [--max-new-tokens 96]
                                               [--lookup-len 8] [--draft-stop 0.4] [--lookup-guide 0.5] [--goal 2.0]

1. **Cost by rows.** On the KV cache of the first bench-engine prompt, the target's trunk (with the EAGLE-3
   head's feature layers, as SD runs it) and its greedy head run on n = 1 .. lookup-len + 1 rows (ids drawn
   from the vocabulary; the cache is rolled back after each), every n once per round in a shuffled order,
   after a warm-up round. Per n: median ms of the trunk and the head, their sum over the 1-row sum (pooled
   over rounds, 95 % paired bootstrap interval over rounds), and ``tau for goal``: the tokens a step of n
   rows must emit for SD's decode to run ``--goal`` x AR's with free drafting, ``goal x cost(n) / cost(1)``.
   Not priced: the rule, the rollback and the drafter's commit (~1 ms a step).
2. **The steps.** The bench-engine prompts decoded greedily by our AR and by lookup-first + EAGLE-3, plain
   and guided by the head (``--lookup-guide``, see :class:`~dropmatch.drafters.LookupFirstDrafter`), and
   guided with drafts not cut at a certain rejection (``generate(..., cut_drafts=False)``, see
   :func:`~dropmatch.engine.cut_draft`), interleaved. For each drafting, per proposer (n-gram lookup, the
   EAGLE-3 head where nothing matched or where the guide chose it, or none on a last step with no room for a
   draft): its steps, the tokens it drafted, the rows its head ran on and the tokens the target kept per step,
   and the share of its steps that kept none. Then the decode speedup over AR that the steps predict (AR's
   measured time a token, times each step's cost over a 1-row step: the trunk on the drafted rows and the
   head on its own, from table 1's medians; plus the measured drafting) beside the measured one: a check of
   the cost model before it is believed. Prefill is left out of both.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..drafters import Draft, LookupFirstDrafter
from ..drafters.eagle3 import Eagle3Drafter, committed_head, drafting_dtype, load_head
from ..drafters.lookup_first import check_lookup_guide
from ..engine import clock, generate
from ..errors import ConfigError, run_command
from ..intervals import paired_ratio_ci
from ..models import CausalLM, load_pair, rollback
from ..provenance import machine_line
from ..runner import merge_stats
from ..sampling import SamplingConfig
from .common import format_table, gsm8k_fewshot_prompts


class StepTimes(NamedTuple):
    """Seconds of the trunk and of the greedy head, one entry per round."""

    trunk_s: list[float]
    head_s: list[float]


class Step(NamedTuple):
    """One verify step: who proposed its draft, how many tokens it drafted, how many the target kept, and the
    rows its head ran on (``drafted + 1``, fewer where the engine cut the draft at a certain rejection)."""

    proposer: str
    drafted: int
    kept: int
    head_rows: int


def verify_cost_by_rows(target: CausalLM, prompt: Sequence[int], rows: Sequence[int], rounds: int,
                        layers: Sequence[int] = (), seed: int = 0) -> dict[int, StepTimes]:
    """The trunk (returning the states of ``layers`` too) and the greedy head on n rows after ``prompt``, per n
    in ``rows``: ``{n: StepTimes}``. Each round times every n once, in a shuffled order; a first round is not
    kept (warm-up)."""
    generator = torch.Generator().manual_seed(seed)
    device = target.device
    times = {n: StepTimes([], []) for n in rows}
    with torch.inference_mode():
        cache, _, _ = target.new_cache_with_features(torch.as_tensor(list(prompt), device=device), layers)
        for round_ in range(rounds + 1):
            for i in torch.randperm(len(rows), generator=generator).tolist():
                n = rows[i]
                ids = torch.randint(0, target.vocab_size, (n,), generator=generator).to(device)
                start = clock(device)
                hidden, _ = target.hidden_and_features(ids, cache, layers)
                middle = clock(device)
                target.head(hidden, exact=False)
                end = clock(device)
                rollback(cache, n)
                if round_:
                    times[n].trunk_s.append(middle - start)
                    times[n].head_s.append(end - middle)
    return times


def cost_table(times: dict[int, StepTimes], goal: float) -> list[dict]:
    """Table 1's rows from :func:`verify_cost_by_rows` (which must include n = 1)."""
    base = [t + h for t, h in zip(*times[1], strict=True)]
    table = []
    for n, (trunk, head) in times.items():
        total = [t + h for t, h in zip(trunk, head, strict=True)]
        ratio = sum(total) / sum(base)
        lo, hi = paired_ratio_ci(total, [1.0] * len(total), base, [1.0] * len(base))
        table.append({"rows": n, "trunk ms": 1e3 * statistics.median(trunk), "head ms": 1e3 * statistics.median(head),
                      "step ms": 1e3 * statistics.median(total), "x 1 row": ratio, "95% CI": f"[{lo:.2f}, {hi:.2f}]",
                      f"tau for {goal:g}x": goal * ratio})
    return table


NO_DRAFT = "none (no room for a draft)"


class ProposerLog:
    """Wraps a :class:`~dropmatch.drafters.LookupFirstDrafter` and records who made each proposal: ``n-gram
    lookup``, the wrapped drafter's name, or :data:`NO_DRAFT` where the engine asked for none (a last step).
    The engine's statistics hold what each step drafted and kept (:func:`steps_of`)."""

    def __init__(self, drafter: LookupFirstDrafter):
        self.drafter, self.name = drafter, drafter.name
        if hasattr(drafter, "feature_layers"):
            self.feature_layers = drafter.feature_layers
        self.proposers: list[str] = []

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.drafter.start(prompt_ids, features)

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        before = self.drafter.lookup_steps
        draft = self.drafter.propose(last_token, n, sampling, generator)
        if self.drafter.lookup_steps > before:
            self.proposers.append("n-gram lookup")
        else:
            self.proposers.append(self.drafter.drafter.name if draft.tokens.numel() else NO_DRAFT)
        return draft

    def commit(self, n_accepted: int, features: torch.Tensor | None = None) -> None:
        self.drafter.commit(n_accepted, features)


def steps_of(log: ProposerLog, stats) -> list[Step]:
    """The steps of one generation: ``log``'s proposers beside the engine's drafted, kept (cut at an EOS, as in
    the output) and head-row counts."""
    return [Step(*step) for step in zip(log.proposers, stats.drafted_per_step, stats.accepted_per_step,
                                        stats.head_rows_per_step, strict=True)]


def census_table(steps: Sequence[Step]) -> list[dict]:
    """Table 2's rows: per proposer and over all steps, the steps, drafted and kept tokens per step, the tokens a
    step emits (kept + the target's own; one too many on a step that ended at an EOS) and the share of steps
    that kept none."""
    groups = {name: [s for s in steps if s.proposer == name] for name in sorted({s.proposer for s in steps})}
    groups["all steps"] = list(steps)
    return [{"proposer": name, "steps": len(group), "drafted/step": sum(s.drafted for s in group) / len(group),
             "head rows/step": sum(s.head_rows for s in group) / len(group),
             "kept/step": sum(s.kept for s in group) / len(group),
             "tokens/step": 1 + sum(s.kept for s in group) / len(group),
             "kept none": sum(s.kept == 0 for s in group) / len(group)}
            for name, group in groups.items() if group]


def predicted_speedup(steps: Sequence[Step], costs: dict[int, tuple[float, float]], ar_s_per_token: float,
                      ar_tokens: int, draft_s: float) -> float:
    """Decode speedup over AR by the cost model: AR spends ``ar_s_per_token`` s on each of ``ar_tokens`` tokens, SD
    as much times (trunk on ``drafted + 1`` rows + head on ``head_rows``) / (trunk + head on 1 row) on each verify
    step, from ``costs`` ({rows: (trunk ms, head ms)}), plus ``draft_s`` s of drafting in all."""
    one_row = sum(costs[1])
    relative = sum(costs[s.drafted + 1][0] + costs[s.head_rows][1] for s in steps) / one_row
    return ar_tokens * ar_s_per_token / (ar_s_per_token * relative + draft_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds over the row counts")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--lookup-len", type=int, default=8, help="draft length of lookup-first (as bench-engine)")
    parser.add_argument("--draft-stop", type=float, default=0.4, help="the EAGLE-3 head's confidence stop")
    parser.add_argument("--lookup-guide", type=float, default=0.5,
                        help="the guided rows' threshold: the head's own draft replaces a disagreeing lookup where "
                             "its first token's untempered draft probability is at least this")
    parser.add_argument("--goal", type=float, default=2.0, help="the decode speedup over AR table 1 prices in tau")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.prompts < 1 or args.lookup_len < 1:
        raise ConfigError("--rounds, --prompts and --lookup-len must be at least 1")
    check_lookup_guide(args.lookup_guide)

    pair = load_pair("gemma-3-270m")
    target = pair.target
    target.prepare()  # the head's copies, built before any clock starts
    head_dir = committed_head(pair.name)
    if head_dir is None:
        raise ConfigError(f"no committed EAGLE-3 head for {pair.name} (make train-draft)")
    head = load_head(head_dir, target, dtype=drafting_dtype(target))

    def lookup_first(guide_at: float | None = None) -> ProposerLog:
        return ProposerLog(LookupFirstDrafter(Eagle3Drafter(head, target, args.draft_stop), guide_at=guide_at))

    prompts = [pair.encode(p) for p in gsm8k_fewshot_prompts(args.prompts)]
    times = verify_cost_by_rows(target, prompts[0], range(1, args.lookup_len + 2), args.rounds,
                                lookup_first().feature_layers)
    costs = cost_table(times, args.goal)
    print(f"# verify step cost by rows: a {len(prompts[0])}-token prompt's cache, {args.rounds} rounds; "
          f"{machine_line()}")
    print(format_table(costs, list(costs[0])))

    guided = f"lookup-first + EAGLE-3, guided at p={args.lookup_guide:g}"
    guides = {  # name: (guide, drafts cut at a certain rejection)
        "lookup-first + EAGLE-3": (None, True),
        guided: (args.lookup_guide, True),
        f"{guided}, whole drafts": (args.lookup_guide, False),
    }
    for guide_at, cut in guides.values():  # warm-up
        generate(target, prompts[0][:64], drafter=lookup_first(guide_at), draft_len=args.lookup_len,
                 max_new_tokens=8, cut_drafts=cut)
    steps: dict[str, list[Step]] = {name: [] for name in guides}
    ar_parts, sd_parts = [], {name: [] for name in guides}
    for ids in prompts:  # interleaved prompt by prompt
        ar = generate(target, ids, max_new_tokens=args.max_new_tokens, eos_token_ids=pair.eos_token_ids)
        ar_parts.append(ar.stats)
        for name, (guide_at, cut) in guides.items():
            log = lookup_first(guide_at)
            sd = generate(target, ids, drafter=log, draft_len=args.lookup_len, max_new_tokens=args.max_new_tokens,
                          eos_token_ids=pair.eos_token_ids, cut_drafts=cut)
            if sd.token_ids != ar.token_ids:
                raise SystemExit(f"{name} differs from greedy decoding")
            steps[name] += steps_of(log, sd.stats)
            sd_parts[name].append(sd.stats)
    ar = merge_stats(ar_parts)
    ar_token_s = ar.decode_s / ar.decode_tokens
    for name in guides:
        sd = merge_stats(sd_parts[name])
        print(f"\n# the steps of {name} (L<={args.lookup_len}, stop below p={args.draft_stop:g}): "
              f"{len(prompts)} bench-engine prompts x {args.max_new_tokens} new tokens, greedy")
        census = census_table(steps[name])
        print(format_table(census, list(census[0])))
        predicted = predicted_speedup(steps[name], {row["rows"]: (row["trunk ms"], row["head ms"]) for row in costs},
                                      ar_token_s, ar.decode_tokens, sd.draft_s)
        print(f"\ndecode speedup over AR: measured {sd.decode_tokens_per_s / ar.decode_tokens_per_s:.2f}x, predicted "
              f"{predicted:.2f}x from table 1 and this run's AR token ({1e3 * ar_token_s:.1f} ms) and drafting "
              f"({1e3 * sd.draft_s / len(steps[name]):.1f} ms a step); prefill excluded")


if __name__ == "__main__":
    sys.exit(run_command(main))
