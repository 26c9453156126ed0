"""Greedy DropMatch relaxation of one verify step over vLLM's flattened batch (pure tensor code).

Glossary as in vLLM's ``RejectionSampler``: *accepted* draft tokens, the *recovered* token (the
target's choice at the first rejected position) and the *bonus* token (after L accepted drafts).
Exact match accepts draft token j of a request while it equals the target argmax; where it stops,
DropMatch asks the criterion; an accepted position continues the walk (exact match first, then the
criterion again), a rejected one ends the row with the recovered token. One ``accept`` call per
round covers every request still walking, so the K dropout heads of a round are one batched GEMM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

PLACEHOLDER_TOKEN_ID = -1  # vLLM's padding in the (batch, max_spec_len + 1) output buffer

AcceptFn = Callable[[list[int]], list[bool]]
"""Criterion over flat draft positions (indices into the N flattened draft tokens) -> accept each."""


@dataclass
class RelaxResult:
    """What a relaxation step did: the rewritten output and its counters."""

    output: torch.Tensor  # (B, max_spec_len + 1) int32
    extra_accepted: list[int]  # (B,) draft tokens accepted beyond exact match, per row
    positions_tested: int  # criterion evaluations (one per request per round)


def exact_prefix(drafts: Sequence[int], argmax: Sequence[int]) -> int:
    """Number of leading positions where the draft equals the target argmax."""
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return n


def relax_greedy(output: torch.Tensor, draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int],
                 target_argmax: torch.Tensor, bonus_token_ids: torch.Tensor, accept: AcceptFn,
                 rows: Sequence[int] | None = None) -> RelaxResult:
    """Extend exact-match acceptance with ``accept`` for the batch rows ``rows`` (default: all).

    Args:
        output: vLLM's greedy output buffer (B, S), S = max_spec_len + 1, padded with -1.
        draft_token_ids: flattened draft tokens (N,).
        num_draft_tokens: drafts per request (B,), summing to N.
        target_argmax: target's (processed) argmax at every draft position (N,).
        bonus_token_ids: the bonus token of each request (B,) or (B, 1).
        accept: the criterion, called once per round with the flat positions to judge.
        rows: the rows DropMatch may change (greedy requests); others keep vLLM's output.
    Returns:
        the new buffer (a copy when a row changed), per-row extra acceptances and the number of tests.
    """
    drafts = draft_token_ids.tolist()
    argmax = target_argmax.tolist()
    bonus = bonus_token_ids.reshape(-1).tolist()
    starts = [0]
    for n in num_draft_tokens:
        starts.append(starts[-1] + n)
    batch = len(num_draft_tokens)
    extra = [0] * batch
    # walking rows: row -> position of its current exact-match rejection
    walking = {}
    for r in (range(batch) if rows is None else rows):
        n, s = num_draft_tokens[r], starts[r]
        j = exact_prefix(drafts[s:s + n], argmax[s:s + n])
        if j < n:
            walking[r] = j
    end: dict[int, int] = {}  # row -> accepted count once DropMatch accepted something
    tested = 0
    while walking:
        order = sorted(walking)
        decisions = accept([starts[r] + walking[r] for r in order])
        tested += len(order)
        next_walking = {}
        for r, ok in zip(order, decisions, strict=True):
            j = walking[r]
            if not ok:
                if extra[r]:
                    end[r] = j
                continue
            extra[r] += 1
            n, s = num_draft_tokens[r], starts[r]
            j += 1 + exact_prefix(drafts[s + j + 1:s + n], argmax[s + j + 1:s + n])
            if j < n:
                next_walking[r] = j
            else:
                end[r] = n
        walking = next_walking
    if not end:
        return RelaxResult(output, extra, tested)
    output = output.clone()
    for r, j in end.items():
        s, n = starts[r], num_draft_tokens[r]
        row = drafts[s:s + j] + [bonus[r] if j == n else argmax[s + j]]
        output[r].fill_(PLACEHOLDER_TOKEN_ID)
        output[r, :len(row)] = torch.tensor(row, dtype=output.dtype)
    return RelaxResult(output, extra, tested)
