"""Fidelity of a lossy method to the target's own greedy output.

For each prompt: whether the whole output equals the target's greedy output, the index of the first
generated token where they differ, and the target's mean negative log-likelihood (nats per
generated token, teacher-forced in the model's own precision) of both outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from .models import CausalLM
from .prompt_cache import PromptPrefix


@dataclass(frozen=True)
class Fidelity:
    exact_match: bool
    first_divergence: int | None  # index into the generated tokens; None when identical
    nll: float  # target NLL per token of the method's output
    greedy_nll: float  # the same for the target's greedy output
    length: int
    greedy_length: int

    def to_dict(self) -> dict:
        return asdict(self)


def token_nlls(target: CausalLM, prompt_ids: Sequence[int], generated_ids: Sequence[int],
               prefix: PromptPrefix | None = None) -> torch.Tensor:
    """Negative log-likelihood (nats) of each of ``generated_ids`` after ``prompt_ids`` under the target, (n,).
    ``prefix``: the target's cached prefix of the prompt (:meth:`~dropmatch.models.CausalLM.cache_prefix`), whose
    positions are copied rather than run, as when the output was decoded from it (not where it would reach
    past the prompt's last token, whose row is needed)."""
    ids = torch.tensor([*prompt_ids, *generated_ids], device=target.device)
    if prefix is not None and prefix.usable_length(ids) > len(prompt_ids) - 1:
        prefix = None
    with torch.inference_mode():
        _, hidden = target.new_cache(rollback=False, prompt_ids=ids, prefix=prefix)
        first = len(prompt_ids) - 1 - (ids.numel() - hidden.shape[0])  # hidden starts after the copied positions
        logits = target.head(hidden[first:-1])  # row i predicts generated token i
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(-1, torch.tensor(list(generated_ids), device=logp.device).view(-1, 1))
    return -picked.squeeze(-1).cpu()


def target_nll(target: CausalLM, prompt_ids: Sequence[int], generated_ids: Sequence[int],
               prefix: PromptPrefix | None = None) -> float:
    """Mean negative log-likelihood (nats/token) of ``generated_ids`` after ``prompt_ids`` under the target
    (``prefix``: see :func:`token_nlls`)."""
    if not generated_ids:
        return float("nan")
    return float(token_nlls(target, prompt_ids, generated_ids, prefix).mean())


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_to_greedy(target: CausalLM, prompt_ids: Sequence[int], output_ids: Sequence[int],
                      greedy_ids: Sequence[int], greedy_nll: float | None = None,
                      prefix: PromptPrefix | None = None) -> Fidelity:
    """Fidelity of ``output_ids`` to ``greedy_ids`` (``greedy_nll``: the latter's NLL, if known; ``prefix``: the
    target's cached prefix of the prompt, see :func:`token_nlls`)."""
    output_ids, greedy_ids = list(output_ids), list(greedy_ids)
    if greedy_nll is None:
        greedy_nll = target_nll(target, prompt_ids, greedy_ids, prefix)
    return Fidelity(
        exact_match=output_ids == greedy_ids,
        first_divergence=first_divergence(output_ids, greedy_ids),
        nll=greedy_nll if output_ids == greedy_ids else target_nll(target, prompt_ids, output_ids, prefix),
        greedy_nll=greedy_nll,
        length=len(output_ids),
        greedy_length=len(greedy_ids),
    )


def summarize_fidelity(items: Sequence[Fidelity]) -> dict:
    """Exact-match rate, mean first divergence (over diverging outputs) and mean NLLs."""
    n = len(items)
    diverging = [f.first_divergence for f in items if f.first_divergence is not None]
    return {
        "prompts": n,
        "exact_match_rate": sum(f.exact_match for f in items) / n if n else float("nan"),
        "mean_first_divergence": sum(diverging) / len(diverging) if diverging else None,
        "nll": sum(f.nll for f in items) / n if n else float("nan"),
        "greedy_nll": sum(f.greedy_nll for f in items) / n if n else float("nan"),
    }
