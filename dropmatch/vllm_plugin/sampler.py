"""vLLM's verify step -> DropMatch's rule -> vLLM's output buffer.

vLLM's ``RejectionSampler.forward`` prepares the target logits (logits processors, penalties) and
calls the module function ``rejection_sample``. :func:`wrap_rejection_sample` wraps that function:
vLLM's own result comes first; when the model runner opened a :class:`VerifyContext` for this step
(``capture.py``) and DropMatch is enabled, greedy rows are then relaxed (``relax.py``) with the
criterion code of :mod:`dropmatch.rules.dropmatch`. Without a context (warm-up, other engines)
the result is vLLM's, untouched.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..rules.dropmatch import decide
from ..sampling import SamplingConfig
from .config import DropMatchVllmConfig
from .heads import draw_masks, dropout_head_logits, position_seed, request_key
from .relax import relax_greedy

GREEDY = SamplingConfig(temperature=0.0)


@dataclass
class DropMatchStats:
    """Counters of one model runner, read back with ``LLM.collective_rpc("dropmatch_stats")``."""

    verify_steps: int = 0  # steps with at least one draft token
    positions_tested: int = 0  # criterion evaluations
    extra_accepted: int = 0  # draft tokens accepted beyond exact match
    per_request: dict[str, int] = field(default_factory=dict)  # engine request id -> extra_accepted

    def as_dict(self) -> dict[str, Any]:
        return {"verify_steps": self.verify_steps, "positions_tested": self.positions_tested,
                "extra_accepted": self.extra_accepted, "per_request": dict(self.per_request)}


class DropMatchState:
    """DropMatch's configuration and counters on one model runner."""

    def __init__(self, config: DropMatchVllmConfig):
        self.config = config
        self.stats = DropMatchStats()
        self.lock = threading.Lock()

    def reset_stats(self) -> None:
        with self.lock:
            self.stats = DropMatchStats()


@dataclass
class VerifyContext:
    """What the runner knows at a verify step and ``rejection_sample`` does not get."""

    state: DropMatchState
    compute_logits: Callable[[torch.Tensor], torch.Tensor]
    sample_hidden_states: torch.Tensor  # (num_tokens + batch_size, d), rows of the logits
    target_logits_indices: torch.Tensor  # (num_tokens,) rows of the draft positions
    req_ids: list[str]  # (batch_size,) in the order of the sampler's rows
    prompt_token_ids: list[list[int] | None]  # (batch_size,)
    first_positions: list[int]  # (batch_size,) absolute position of each row's first draft token


_STEP: contextvars.ContextVar[VerifyContext | None] = contextvars.ContextVar("dropmatch_step", default=None)


def open_step(ctx: VerifyContext) -> contextvars.Token:
    return _STEP.set(ctx)


def close_step(token: contextvars.Token) -> None:
    _STEP.reset(token)


def greedy_rows(sampling_metadata: Any, batch: int) -> list[int]:
    """Rows of greedy requests (vLLM marks them with temperature 0 when the batch is mixed)."""
    if sampling_metadata.all_greedy:
        return list(range(batch))
    temperature = sampling_metadata.temperature
    return [] if temperature is None else (temperature[:batch] == 0).nonzero().flatten().tolist()


def relax_step(ctx: VerifyContext, output: torch.Tensor, draft_token_ids: torch.Tensor,
               num_draft_tokens: list[int], draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
               bonus_token_ids: torch.Tensor, sampling_metadata: Any) -> torch.Tensor:
    """DropMatch on vLLM's greedy output ``output`` (B, max_spec_len + 1); returns the new buffer."""
    config = ctx.state.config
    starts = [0]
    for n in num_draft_tokens:
        starts.append(starts[-1] + n)
    row_of = [r for r, n in enumerate(num_draft_tokens) for _ in range(n)]
    keys = [request_key(p) for p in ctx.prompt_token_ids]
    hidden = ctx.sample_hidden_states[ctx.target_logits_indices]  # (N, d)

    def accept(flat: list[int]) -> list[bool]:
        if config.p_drop == 0:  # every head is the target: the JS radius is 0 and every vote vLLM's own, so
            return [False] * len(flat)  # nothing it rejected is accepted (computed heads carry float32 noise)
        index = torch.tensor(flat, device=hidden.device)
        processed = target_logits[index].float()
        seeds = [position_seed(config.seed, keys[row_of[f]], ctx.first_positions[row_of[f]] + f - starts[row_of[f]])
                 for f in flat]
        masks = draw_masks(seeds, config.k, hidden.shape[-1], config.p_drop, hidden.device)
        heads = dropout_head_logits(ctx.compute_logits, hidden[index], masks, config.p_drop)
        vocab = min(heads.shape[-1], processed.shape[-1])
        # tokens vLLM's logits processors forbid (bad words, min_tokens, allowed ids) stay forbidden
        heads = heads[..., :vocab].masked_fill((processed[:, :vocab] == float("-inf")).unsqueeze(1), float("-inf"))
        decisions = []
        for i, f in enumerate(flat):
            token = int(draft_token_ids[f])
            if token >= vocab or processed[i, token] == float("-inf"):  # forbidden for the target: never accept
                decisions.append(False)
                continue
            if draft_probs is not None:
                dist = draft_probs[f, :vocab].float()
            else:  # n-gram drafts carry no distribution: one-hot
                dist = torch.zeros(vocab, device=heads.device)
                dist[token] = 1.0
            decisions.append(decide(config.criterion, heads[i], token, dist, GREEDY, None, config.majority))
        return decisions

    rows = greedy_rows(sampling_metadata, len(num_draft_tokens))
    result = relax_greedy(output, draft_token_ids, num_draft_tokens, target_logits.argmax(dim=-1),
                          bonus_token_ids, accept, rows)
    with ctx.state.lock:
        stats = ctx.state.stats
        stats.verify_steps += int(sum(num_draft_tokens) > 0)
        stats.positions_tested += result.positions_tested
        for r, extra in enumerate(result.extra_accepted):
            if extra:
                stats.extra_accepted += extra
                stats.per_request[ctx.req_ids[r]] = stats.per_request.get(ctx.req_ids[r], 0) + extra
    return result.output


def wrap_rejection_sample(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """vLLM's ``rejection_sample`` followed by DropMatch when a verify context is open."""

    @functools.wraps(original)
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        output = original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                          target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        ctx = _STEP.get()
        if ctx is None or not ctx.state.config.enabled or kwargs.get("synthetic_mode"):
            return output
        return relax_step(ctx, output, draft_token_ids, list(num_draft_tokens), draft_probs, target_logits,
                          bonus_token_ids, sampling_metadata)

    rejection_sample.__dropmatch_original__ = original
    return rejection_sample
