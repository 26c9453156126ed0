"""A prompt prefix computed once: few-shot exemplars shared by every prompt of a task or benchmark.

``make bench-engine``'s 4-shot GSM8K prompts share 565 tokens of exemplars and differ in a 29-67-token
question; on the embedded pair (2 cores) the trunk takes 1.2-1.45 s to prefill a prompt, for every prompt
and every method.
:meth:`CausalLM.cache_prefix <dropmatch.models.CausalLM.cache_prefix>` runs the trunk over the shared tokens
once and keeps their keys and values (and the features an EAGLE-3 drafter reads);
:func:`~dropmatch.engine.generate` given that prefix copies the
states of the positions it shares with its prompt into a fresh cache and prefills only the rest, as
serving engines' prefix caches do (vLLM's automatic prefix caching).

The states of position i depend only on tokens 0..i, so the result is the same computation; the
rows are split differently between GEMM calls, so the float32 values may differ in their last bits
from a whole-prompt prefill (what a near-tie could show). Greedy SD and AR given the same prefix
start from the same states and stay identical token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)  # tensors: identity, not elementwise ==
class PromptPrefix:
    """Prompt tokens whose target states are computed.

    ``model`` the :class:`~dropmatch.models.CausalLM` that computed them (only it may use them); ``ids``
    (n,) int64; ``states`` per cache layer its keys and values (1, kv_heads, n, head_dim); ``layers`` the
    feature layers recorded (``hidden_states`` indices, as
    :meth:`~dropmatch.models.CausalLM.hidden_and_features` takes them) and ``features`` (n, len(layers) * d),
    ``None`` without layers.
    """

    model: object  # a dropmatch.models.CausalLM (not imported: models builds on this module)
    ids: torch.Tensor
    states: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    layers: tuple[int, ...] = ()
    features: torch.Tensor | None = None

    def usable_length(self, prompt_ids: torch.Tensor) -> int:
        """How many leading positions of ``prompt_ids`` (m,) this prefix serves: the tokens they share,
        at most m - 1 (the prompt's last position is run to get its hidden state)."""
        n = min(self.ids.numel(), prompt_ids.numel() - 1)
        if n <= 0:
            return 0
        differ = (self.ids[:n] != prompt_ids[:n].to(self.ids.device)).nonzero()
        return int(differ[0, 0]) if differ.numel() else n


def shared_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    """The longest token prefix common to all ``prompts`` (empty for none, or for a single prompt: a
    prefix shared with nothing saves nothing)."""
    if len(prompts) < 2:
        return []
    first = list(prompts[0])
    n = min(len(p) for p in prompts)
    for p in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], p[:n], strict=True)) if a != b), n)
    return first[:n]
