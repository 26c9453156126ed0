"""A draft model with its own KV cache (e.g. the embedded int8 self-draft, or Llama-3.1-8B)."""

from __future__ import annotations

import torch

from ..errors import PromptTooLongError
from ..models import CausalLM, rollback
from ..prompt_cache import PromptPrefix
from ..sampling import SamplingConfig, argmax, sample_with_uniform
from .base import Draft, check_stop_below, draft_confidence


class ModelDrafter:
    """A small causal LM with its own KV cache.

    Invariant between steps: the cache holds every context token except ``pending`` ones, which
    the next ``propose`` feeds in one forward pass together with ``last_token``.
    Greedy drafts take the argmax; under sampling the draft samples from its own tempered /
    top-p distribution (needed for speculative sampling to stay lossless).

    ``stop_below`` gives a dynamic draft length: a proposal ends after a token whose draft probability
    is below it (see :func:`~dropmatch.drafters.base.draft_confidence`), so a draft that costs a
    sizeable share of a target forward (the embedded int8 self-draft: ~0.5) spends fewer forwards on
    tokens the target is likely to reject. ``None``: always the ``n`` tokens asked for (the paper's fixed
    L). The stop depends on the draft alone, so greedy SD still equals AR and speculative sampling stays
    lossless.

    Context length: the draft never runs past its ``max_positions``. Near the end of its context it
    proposes fewer tokens, then none (the target then emits one token per step, still exactly); a
    prompt longer than that context is a :class:`~dropmatch.errors.PromptTooLongError`.

    ``prefix``: the draft model's own :class:`~dropmatch.prompt_cache.PromptPrefix` (``model.cache_prefix(ids)``),
    whose positions ``start`` copies instead of prefilling them. A dynamically quantized draft (the int8 self-draft)
    scales activations per call, so its states, and so its drafts, may differ from a whole-prompt prefill's; the
    target's tokens do not.
    """

    name = "model"

    def __init__(self, model: CausalLM, stop_below: float | None = None, prefix: PromptPrefix | None = None):
        check_stop_below(stop_below)
        self.model, self.stop_below, self.prefix = model, stop_below, prefix
        self.cache = None
        self._pending: list[int] = []
        self._proposed: list[int] = []
        self._following = False  # the last step's proposal came from another drafter (``follow``)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        if prompt_ids.numel() > self.model.max_positions:
            raise PromptTooLongError(
                f"prompt of {prompt_ids.numel()} tokens exceeds the draft model's context of "
                f"{self.model.max_positions} tokens; shorten the prompt or use a draft with a longer context"
            )
        self.cache, _ = self.model.new_cache(rollback=True, prompt_ids=prompt_ids, prefix=self.prefix)
        self._pending, self._proposed, self._following = [], [], False

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        device = self.model.device
        feed = self._pending + [last_token]
        # feeding ``feed`` and then n - 1 proposals takes positions up to cache + len(feed) + n - 2
        n = min(n, self.model.max_positions - self.cache.get_seq_length() - len(feed) + 1)
        if n <= 0:
            self._pending, self._proposed = feed, []
            return Draft(torch.empty(0, dtype=torch.long, device=device))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(n):
            logits = self.model.logits(torch.tensor(feed, device=device), self.cache)
            if sampling.greedy:
                token, row = int(argmax(logits)), logits
            else:
                row = sampling.probs(logits)
                token = int(sample_with_uniform(row, torch.rand((), generator=generator)))
            tokens.append(token)
            rows.append(row)
            feed = [token]
            if self.stop_below is not None and draft_confidence(row, token, sampling) < self.stop_below:
                break
        # The cache now holds the context, last_token and all proposals but the newest one.
        self._pending = []
        self._proposed = tokens
        stacked = torch.stack(rows)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        return Draft(ids, logits=stacked) if sampling.greedy else Draft(ids, probs=stacked)

    def follow(self, last_token: int, tokens: list[int]) -> None:
        """Another drafter proposes ``tokens`` this step: the draft runs nothing; ``last_token`` and then
        the kept ones (``commit``) wait for the next ``propose``, which feeds them in one forward."""
        self._pending.append(last_token)
        self._proposed, self._following = list(tokens), True

    def commit(self, n_accepted: int, features: torch.Tensor | None = None) -> None:
        if self._following:
            self._pending += self._proposed[:n_accepted]
            self._proposed, self._following = [], False
            return
        n = len(self._proposed)
        if n == 0:
            return
        if n_accepted == n:
            self._pending = [self._proposed[-1]]  # never fed: goes in with the next token
        rollback(self.cache, max(n - 1 - n_accepted, 0))
