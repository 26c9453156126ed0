"""DropMatch head overhead on the embedded pair: ``make bench-dropmatch``.

    python -m dropmatch.benchmarks.dropmatch_overhead [--prompts 4] [--max-new-tokens 96] [--repeats 3]

1. Greedy standard SD runs on 4-shot GSM8K prompts: once to warm up (first-call reorders), once timed
   (shown beside the table's step), once recording every verify step's draft and target hidden states. The
   recording run is not a timed one: holding ~100 steps' logits made each step allocate fresh memory, which
   put ~20 ms on a 55 ms step of a 2-core AMX Xeon (78 against 55.5 ms) and so understated every overhead
   below (issue 10's figures before 2026-12-06 included). Each pass of step 2 is preceded by another timed
   run, and the overheads divide each pass's extra time by the standard verify steps of the same stretch
   (target trunk + head + rule; before 2026-12-07 one step timed minutes before the replays divided them all,
   on a machine whose speed drifts by tens of % within minutes).
2. The recorded steps are replayed through the head and each rule (interleaved, repeated, identical
   inputs, each timed step after a read of as many bytes as the float32 LM head, so that every rule meets the
   caches as a verify step does and none the state another rule left): standard verification and DropMatch (naive, js+majority; K = 5) at p_drop = 0.032 (the
   equal-noise value of a 640-wide model) and 0.3, masks drawn inside the timed step, exact decisions.
   The head path is DropoutHead's and DropMatch's choice (``DropMatch.fuses``, ``DropMatch.heads_for``), named
   after the requested head dtype in each row: "bfloat16 rows fused" (every position's rows in the screened
   verification GEMM: greedy steps at large K p_drop), "exact rows" (float32 through oneDNN, where it
   runs: the dtype does not apply), "bfloat16 rows" (the same pass in bfloat16 for argmax votes on CPUs with
   native bfloat16, certified), else sparse dropped-column heads ("sparse 8-bit" on x86 at small p_drop, "sparse
   int8 GEMM" past K p_drop 0.5), all inexact ones with certified decisions (the exact fallbacks per step are
   shown). Head overhead = extra head + rule time per step,
   as a percentage of the standard verify step. The engine's standard step cuts its draft at a position the
   target certainly rejects (``engine.cut_draft``: fewer head rows, the same verdict); DropMatch cannot, since
   it may keep what exact matching rejects. So the overhead counts the rows DropMatch's head runs past that
   cut, and ``vs whole-draft step`` measures it against a standard step on the whole draft instead, as
   before 2026-12-07. The standard step's head is screened (bfloat16 with an
   exact argmax, where the CPU has native bfloat16), and so is DropMatch's; the row "standard (float32
   head)" shows what a rule that needs the float32 head pays (DropMatch's JS rules did, on float32
   sparse heads, until 2026-12-06). Goal (issue 10): js+majority at
   most 5 % at p = 0.032 and 15 % at p = 0.3.
3. The floor of each head path on this machine: the bytes a position's K heads must read (rows: the
   whole weight in the rows' dtype; sparse heads: the K p_drop d dropped rows of W^T in the greedy corrections'
   dtype, 8-bit by default on x86, in expectation; fused rows: none of their own, so their cost shows in the
   measured time only), the time of
   one streaming read of that many bytes (``torch.sum``, measured here), and the overhead that read alone
   would cost at the measured positions with heads per step. A goal below that floor is out of reach
   of any kernel for that path on this machine.
4. End to end: tau and tokens/s of SD and SD + DropMatch on the same prompts, same process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import pandas as pd
import torch

from .. import kernels
from ..drafters import Draft, ModelDrafter
from ..engine import cut_draft, generate, verify_step
from ..errors import run_command
from ..heads.byte_columns import BYTE_ROWWISE
from ..heads.dropout import DropoutHead, expected_union_fraction
from ..methods import Decoder, MethodConfig, build_rule
from ..models import ModelPair, load_pair
from ..provenance import machine_line
from ..rules import StandardVerification, VerifyInput
from ..sampling import SamplingConfig
from .common import format_table, gsm8k_fewshot_prompts

WHOLE_DRAFT = "standard (whole draft)"  # the table's row of standard verification on uncut drafts


class _Float32Standard(StandardVerification):
    """Standard verification on the float32 head (what a rule that cannot take screened logits gets)."""

    screened_logits_ok = False


class _Recorder(StandardVerification):
    """Standard verification that keeps every step's input, on whole drafts (DropMatch replays need every row)."""

    exact_match_when_greedy = False

    def __init__(self) -> None:
        self.steps: list[VerifyInput] = []
        self.seen: list[torch.Tensor] = []  # each step's context: the prompt and the tokens emitted before it

    def record_contexts(self, prompt: list[int], output: list[int], accepted_per_step: list[int]) -> None:
        """The context of each step of the generation just recorded (the prefill emitted ``output[0]``, step i
        ``accepted_per_step[i]`` draft tokens and one target token)."""
        emitted = 1
        for accepted in accepted_per_step:
            self.seen.append(torch.unique(torch.tensor(prompt + output[:emitted])))
            emitted += accepted + 1

    def verify(self, inp: VerifyInput):
        self.steps.append(inp)
        return super().verify(inp)


def measure_overhead(pair: ModelPair, prompts: Sequence[list[int]], *, max_new_tokens: int = 96,
                     repeats: int = 3, draft_len: int = 5, k: int = 5, p_drops: Sequence[float] = (0.032, 0.3),
                     criteria: Sequence[str] = ("naive", "js+majority"),
                     head_dtypes: Sequence[str] = ("bfloat16",)) -> pd.DataFrame:
    """One row per rule: head + rule time per step (mask generation included: it happens inside
    ``verify_step``), positions with heads per step, exact fallbacks per step, overhead in % of the
    standard verify step (column ``verify step (ms)`` holds that step's mean). The standard step is timed in
    each of the ``repeats`` passes, by SD generations of ``prompts`` run just before that pass's replays, and
    each overhead pools the passes: its extra head + rule time over the standard steps of the same stretches
    (``per pass (%)``: each pass's own; ``verify step before recording (ms)``: one pass timed before any step
    was recorded, to show the held recording does not slow the steps)."""
    recorder = _Recorder()
    pair.target.prepare()  # the head's weight copies are built before any timed step

    def run(rule: StandardVerification, ids: list[int]):
        return generate(pair.target, ids, drafter=ModelDrafter(pair.draft), rule=rule, draft_len=draft_len,
                        max_new_tokens=max_new_tokens, eos_token_ids=pair.eos_token_ids)

    def standard_step_ms() -> float:
        """The mean verify step (ms) of standard SD over ``prompts``, timed now."""
        timed = [run(StandardVerification(), ids).stats for ids in prompts]
        return 1000 * sum(s.verify_s for s in timed) / sum(s.verify_steps for s in timed)

    with torch.inference_mode():
        run(StandardVerification(), prompts[0])  # warm-up: first-call reorders of the trunk's GEMMs
        before_recording_ms = standard_step_ms()
        for ids in prompts:
            result = run(recorder, ids)
            recorder.record_contexts(ids, result.token_ids, result.stats.accepted_per_step)
    # "standard" is the engine's standard step, its draft cut at a certain rejection (engine.cut_draft); the
    # DropMatch rows cannot cut (they may keep what exact matching rejects) and run on whole drafts
    rules = {"standard": build_rule(pair.target, MethodConfig("sd")),
             WHOLE_DRAFT: build_rule(pair.target, MethodConfig("sd")),
             "standard (float32 head)": _Float32Standard()}
    for p_drop in p_drops:
        for criterion in criteria:
            for dtype in head_dtypes:
                rules[f"dropmatch {criterion} p={p_drop:g} ({dtype})"] = build_rule(pair.target, MethodConfig(
                    "dropmatch", k=k, p_drop=p_drop, criterion=criterion, head_dtype=dtype))
    seconds = {name: [0.0] * repeats for name in rules}  # per pass
    evaluations = dict.fromkeys(rules, 0)
    step_ms: list[float] = []  # the standard verify step of each pass (ms)
    with torch.inference_mode():
        for rule in rules.values():  # untimed: builds what a rule builds once (transposed weight, reorders)
            for inp in recorder.steps[:4]:
                draft = Draft(inp.draft_tokens, inp.draft_probs, inp.draft_logits)
                verify_step(pair.target, rule, inp.hidden, draft, inp.sampling, torch.Generator().manual_seed(0))
            criterion = getattr(rule, "criterion", None)
            if hasattr(criterion, "counters"):
                criterion.counters = type(criterion.counters)()  # count the timed steps only
        # every timed step starts from the same cache state: after a read of as many bytes as the float32 LM head
        # (at most 1 GiB, more than any cache), as the target's trunk and the draft's passes leave the caches between
        # two verify steps (left to the rule before it, a step's head GEMM took ~0.8 ms less after a step on the
        # same bfloat16 weight than after the float32 head rule's pass, which favoured the rows run after a
        # bfloat16 one: "standard" among them)
        weight = pair.target.head_weight
        evict = torch.ones(min(weight.numel(), 2**28), device=weight.device)
        for repeat in range(repeats):
            # the denominator timed in the same stretch as the replays it divides: the machine's speed drifts by
            # tens of % within minutes, and a step timed minutes apart put the same DropMatch cost (~6 ms) at 4.7
            # to 6.8 % of steps of 85 to 131 ms in three runs (2026-12-07)
            step_ms.append(standard_step_ms())
            for i, inp in enumerate(recorder.steps):
                draft = Draft(inp.draft_tokens, inp.draft_probs, inp.draft_logits)
                for name, rule in rules.items():
                    evict.sum()
                    start = time.perf_counter()
                    hidden, step_draft = inp.hidden, draft
                    if name == "standard":
                        hidden, step_draft = cut_draft(pair.target, hidden, draft, recorder.seen[i])
                    verdict = verify_step(pair.target, rule, hidden, step_draft, inp.sampling,
                                          torch.Generator().manual_seed(i))
                    seconds[name][repeat] += time.perf_counter() - start
                    if repeat == 0:
                        evaluations[name] += verdict.criterion_evaluations
    n = len(recorder.steps)
    pass_ms = {name: [1000 * t / n for t in times] for name, times in seconds.items()}  # per step, each pass
    base, whole = pass_ms["standard"], pass_ms[WHOLE_DRAFT]
    whole_step_ms = [s - b + w for s, b, w in zip(step_ms, base, whole, strict=True)]  # had drafts not been cut
    rows = []
    for name in rules:
        ms = pass_ms[name]
        overhead, per_pass = pooled_overhead(ms, base, step_ms)
        counters = getattr(getattr(rules[name], "criterion", None), "counters", None)
        criterion = getattr(rules[name], "criterion", None)
        head = getattr(criterion, "head", None)
        path = "" if head is None else f" {head_path(criterion)}"
        rows.append({"rule": name + path,
                     "head + rule / step (ms)": statistics.fmean(ms),
                     "exact fallbacks / step": 0.0 if counters is None else counters.exact_fallbacks / (n * repeats),
                     "positions with heads / step": evaluations[name] / n,
                     "head overhead (% of verify step)": overhead, "per pass (%)": per_pass,
                     "vs whole-draft step (%)": pooled_overhead(ms, whole, whole_step_ms)[0],
                     "verify step (ms)": statistics.fmean(step_ms), "steps": n,
                     "verify step before recording (ms)": before_recording_ms})
    return add_floors(pd.DataFrame(rows), rules)


def pooled_overhead(rule_ms: Sequence[float], base_ms: Sequence[float], step_ms: Sequence[float]
                    ) -> tuple[float, tuple[float, ...]]:
    """A rule's overhead over ``base_ms`` in % of the verify step, from passes timed side by side: each pass's
    head + rule time per step (ms) of the rule and of the base, and the verify step (ms) timed beside that pass.
    Returns (the pooled overhead: the passes' extra time over their steps, each pass's own)."""
    extra = [r - b for r, b in zip(rule_ms, base_ms, strict=True)]
    per_pass = tuple(100 * e / s for e, s in zip(extra, step_ms, strict=True))
    return 100 * sum(extra) / sum(step_ms), per_pass


def head_path(criterion) -> str:
    """The head path a DropMatch criterion takes on greedy steps: "exact rows", "bfloat16 rows"
    (certified), sparse heads in their corrections' dtype, or dense heads in their compute dtype; "fused": the
    rows ride in the verification GEMM (:meth:`~dropmatch.rules.dropmatch.DropMatch.fuses`)."""
    dtype = criterion.heads_dtype(SamplingConfig())
    name = "8-bit" if dtype == BYTE_ROWWISE else str(dtype).removeprefix("torch.")
    if criterion.fuses(SamplingConfig()):
        return f"{name} rows fused" if criterion.head.exact_rows else f"dense {name} fused"
    head = criterion.heads_for(SamplingConfig())
    if dtype == BYTE_ROWWISE and head.corrections_by_gemm:
        return "sparse int8 GEMM"
    if head.exact_rows:
        return "exact rows" if dtype == head.weight.dtype else f"{name} rows"
    return f"{'sparse' if head.sparse else 'dense'} {name}"


def streaming_read_ms(tensor: torch.Tensor, repeats: int = 15) -> float:
    """Median time (ms) of one ``torch.sum`` over ``tensor``: a streaming read of its bytes."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tensor.sum()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def read_floor(head: DropoutHead, rows_dtype: torch.dtype | None = None) -> tuple[float, float]:
    """(MB, ms): the bytes one position's K heads read on ``head``'s path and one streaming read of that
    many bytes. Rows read the whole weight in ``rows_dtype`` (default the head's); sparse heads ~K p_drop
    d rows of W^T (each head's dropped columns, in expectation; their union, d (1 - (1 - p_drop)^K), where the
    native 8-bit kernel runs), or all of W in int8 where their corrections
    are one int8 GEMM (:attr:`DropoutHead.corrections_by_gemm`); dense heads ride in the verification
    GEMM: (0, 0)."""
    if head.exact_rows:
        data = head.weight_in(rows_dtype or head.rows_dtype)
    elif head.sparse:  # that many columns of W (rows of W^T) over the whole vocabulary: each head's, or their
        # union where the native 8-bit kernel reads a column that several heads drop once
        union = head.sparse_dtype == BYTE_ROWWISE and kernels.available()
        share = expected_union_fraction(head.k, head.p_drop) if union else head.k * head.p_drop
        columns = max(1, round(share * head.weight.shape[1]))
        if head.sparse_dtype == BYTE_ROWWISE:  # greedy corrections in 8 bits: all of W for the int8 GEMM, else
            # a column's rows of every block; as many bytes in float32 (an integer sum is no streaming read)
            if head.corrections_by_gemm:
                n_bytes = head.weight.numel()
            else:
                packed = head.byte_blocks().packed
                n_bytes = columns * (packed.shape[0] // head.weight.shape[1]) * packed.shape[1]
            data = torch.ones(n_bytes // 4)
        else:
            data = head.blocks_in(head.sparse_dtype).view(-1)[: columns * head.weight.shape[0]]
    else:
        return 0.0, 0.0
    return data.numel() * data.element_size() / 1e6, streaming_read_ms(data)


def add_floors(table: pd.DataFrame, rules: dict) -> pd.DataFrame:
    """``table`` (from :func:`measure_overhead`) with each DropMatch row's read floor: MB and ms per
    position with heads, the measured head + rule time per such position (above the :data:`WHOLE_DRAFT` rule's,
    which ``rules`` must name: standard verification on the whole drafts DropMatch verifies), and the overhead
    the read alone costs at the measured positions per step (% of the standard verify step); NaN elsewhere."""
    base = table["head + rule / step (ms)"].iloc[list(rules).index(WHOLE_DRAFT)]
    floors = []
    for rule, row in zip(rules.values(), table.to_dict("records"), strict=True):
        criterion = getattr(rule, "criterion", None)
        head = getattr(criterion, "head", None)
        per_step = row["positions with heads / step"]
        if head is None or not per_step:
            floors.append({})
            continue
        greedy = SamplingConfig()
        if criterion.fuses(greedy):  # rows in the verification GEMM: no read of their own
            megabytes, read_ms = 0.0, 0.0
        else:
            megabytes, read_ms = read_floor(criterion.heads_for(greedy), criterion.rows_dtype(greedy))
        floors.append({"MB read / position": megabytes, "streaming read (ms)": read_ms,
                       "head + rule / position (ms)": (row["head + rule / step (ms)"] - base) / per_step,
                       "read floor (% of verify step)": 100 * per_step * read_ms / row["verify step (ms)"]})
    return table.join(pd.DataFrame(floors, index=table.index))


def end_to_end(pair: ModelPair, prompts: Sequence[list[int]], *, max_new_tokens: int, draft_len: int = 5,
               k: int = 5, p_drop: float = 0.3) -> pd.DataFrame:
    rows = []
    for label, config in (("SD", MethodConfig("sd", draft_len=draft_len)),
                          ("SD + DropMatch js+majority", MethodConfig("dropmatch", draft_len=draft_len, k=k,
                                                                      p_drop=p_drop))):
        decoder = Decoder(pair, config)
        tokens = wall = calls = 0
        for ids in prompts:
            s = decoder.generate(ids, max_new_tokens=max_new_tokens).stats
            tokens, wall, calls = tokens + s.new_tokens, wall + s.wall_s, calls + s.target_calls
        rows.append({"method": label, "tau": tokens / calls, "tokens/s": tokens / wall})
    table = pd.DataFrame(rows)
    table["vs SD"] = table["tokens/s"] / table["tokens/s"].iloc[0]
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-len", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--p-drop", type=float, nargs="+", default=[0.032, 0.3])
    args = parser.parse_args(argv)

    pair = load_pair("gemma-3-270m")
    prompts = [pair.encode(p) for p in gsm8k_fewshot_prompts(args.prompts)]
    overhead = measure_overhead(pair, prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                                draft_len=args.draft_len, k=args.k, p_drops=args.p_drop)
    e2e = end_to_end(pair, prompts, max_new_tokens=args.max_new_tokens, draft_len=args.draft_len, k=args.k,
                     p_drop=args.p_drop[-1])
    print(f"# DropMatch overhead: {int(overhead.steps.iloc[0])} recorded verify steps from {len(prompts)} 4-shot "
          f"GSM8K prompts (L={args.draft_len}, K={args.k}, p_drop={args.p_drop}), x{args.repeats}; {machine_line()}")
    print("masks are drawn inside each timed step; end-to-end below at p_drop =", args.p_drop[-1])
    first = overhead.iloc[0]
    print(f"mean standard verify step (target trunk + head + rule), timed beside each pass of replays: "
          f"{first['verify step (ms)']:.1f} ms ({first['verify step before recording (ms)']:.1f} ms before recording)")
    columns = ["rule", "head + rule / step (ms)", "positions with heads / step", "exact fallbacks / step",
               "head overhead (% of verify step)", "per pass (%)", "vs whole-draft step (%)"]
    records = [{**row, "per pass (%)": ", ".join(f"{v:.1f}" for v in row["per pass (%)"])}
               for row in overhead.to_dict("records")]
    print(format_table(records, columns))
    print()
    print("floor per head path: one streaming read of the bytes a position's K heads read")
    floors = overhead.dropna(subset=["streaming read (ms)"])
    print(format_table(floors.to_dict("records"), ["rule", "MB read / position", "streaming read (ms)",
                                                   "head + rule / position (ms)", "read floor (% of verify step)",
                                                   "head overhead (% of verify step)"]))
    print()
    print(format_table(e2e.to_dict("records"), ["method", "tau", "tokens/s", "vs SD"]))


if __name__ == "__main__":
    sys.exit(run_command(main))
