"""What every verification rule sees and returns, and the two protocols rules implement.

Glossary (one verify step with L draft tokens; vLLM's terms):

* **accepted** tokens: the prefix of the draft that the rule keeps (``Verdict.n_accepted``);
* **recovered** token: the token emitted at the first rejected position (the correction: the
  target's argmax under greedy decoding, a sample of the residual under speculative sampling);
* **bonus** token: the token emitted after a fully accepted draft, from the target's last row;
* ``Verdict.next_token`` is the recovered or the bonus token, whichever the step ends with.

Rules are pure tensor code: this package imports no model, engine or task code.

**Screened logits.** Under greedy decoding the engine may compute the verify step's target logits with
a screened head (exact argmax, float32 values near the top, bounded bfloat16 error elsewhere; faster on
CPUs with native bfloat16), but only for a rule whose ``screened_logits_ok`` is true (see
:func:`screened_logits_ok`): the rule then decides on them exactly as on float32 logits. Every other
rule gets float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..sampling import SamplingConfig


@dataclass
class Prefetch:
    """Extra LM-head rows a rule wants computed in the verification GEMM, and its state for the step.

    The engine asks ``rule.prefetch(hidden, sampling, generator)`` before running the head, fills
    ``products`` (``W @ rows.T``, (m, V) in the GEMM's dtype) when it can fuse them, and hands the object back in
    :attr:`VerifyInput.prefetch`. Rules must not depend on ``products`` being filled.
    """

    rows: torch.Tensor | None
    state: object
    products: torch.Tensor | None = None


@dataclass(frozen=True)
class VerifyInput:
    """Everything a rule may look at for one verify step with L draft tokens.

    Attributes:
        draft_tokens: (L,) int64.
        draft_probs: (L, V) float32 draft distributions after the sampling transforms (given when
            sampling), or ``None``.
        target_logits: (L + 1, V) float32 dropout-free target logits; row j scores draft token j,
            row L gives the bonus token.
        hidden: (L + 1, d) target last hidden states at the same positions.
        sampling: temperature / top-p.
        generator: CPU generator for every random draw of the step.
        draft_logits: (L, V) draft logits, given under greedy decoding instead of ``draft_probs``.
            Drafters with neither (n-gram lookup) count as one-hot.
        prefetch: what the rule's ``prefetch`` asked for this step, if anything.
        logits_screened: ``target_logits`` come from a screened head (greedy decoding): exact argmax and
            exact values near the top, bounded bfloat16 error elsewhere; otherwise they are float32.
    """

    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    target_logits: torch.Tensor
    hidden: torch.Tensor
    sampling: SamplingConfig
    generator: torch.Generator
    draft_logits: torch.Tensor | None = None
    prefetch: Prefetch | None = None
    logits_screened: bool = False

    @property
    def n_draft(self) -> int:
        return int(self.draft_tokens.shape[0])

    def draft_logits_at(self, j: int) -> torch.Tensor | None:
        """The draft logits (V,) at position j when the draft distribution is given by them (its
        ``sampling.probs``), else ``None`` (given probabilities, or a one-hot draft)."""
        return self.draft_logits[j] if self.draft_probs is None and self.draft_logits is not None else None

    def draft_distributions(self) -> torch.Tensor:
        """(L, V) draft distributions, float32: ``draft_probs``, else the sampling transform of
        ``draft_logits``, else one-hot (row j of this is :meth:`draft_distribution` (j))."""
        if self.draft_probs is not None:
            return self.draft_probs.float()
        if self.draft_logits is not None:
            return self.sampling.probs(self.draft_logits)
        one_hot = torch.zeros(self.n_draft, self.target_logits.shape[-1], device=self.target_logits.device)
        return one_hot.scatter_(1, self.draft_tokens.view(-1, 1), 1.0)

    def draft_token_probs(self) -> torch.Tensor:
        """q_j(x_j) (L,) float32 on the CPU: each draft token's probability under its draft distribution
        (:meth:`draft_distributions`; 1 for deterministic drafts, without building their one-hot rows)."""
        if self.draft_probs is None and self.draft_logits is None:
            return torch.ones(self.n_draft)
        q = self.draft_distributions()
        rows = torch.arange(self.n_draft, device=q.device)
        return q[rows, self.draft_tokens.to(q.device)].cpu()

    def draft_distribution(self, j: int) -> torch.Tensor:
        """Draft distribution (V,) at position j; one-hot for deterministic drafts."""
        if self.draft_probs is not None:
            return self.draft_probs[j]
        logits = self.draft_logits_at(j)
        if logits is not None:
            return self.sampling.probs(logits)
        one_hot = torch.zeros(self.target_logits.shape[-1], device=self.target_logits.device)
        one_hot[self.draft_tokens[j]] = 1.0
        return one_hot


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verify step.

    Attributes:
        n_accepted: draft tokens kept (a prefix of the draft).
        next_token: the token emitted after them (correction or bonus).
        extra_accepts: kept tokens that the standard rule would have rejected.
        criterion_evaluations: positions at which a lossy criterion had to be evaluated.
    """

    n_accepted: int
    next_token: int
    extra_accepts: int = 0
    criterion_evaluations: int = 0


class VerificationRule(Protocol):
    name: str

    def verify(self, inp: VerifyInput) -> Verdict: ...


PositionTest = Callable[[int], bool]


class Criterion(Protocol):
    """A lossy acceptance test. ``prepare`` draws all randomness for the step up front and
    returns a test ``position -> accept?`` that computes lazily what it needs. A criterion may also
    define ``prefetch(hidden, sampling, generator) -> Prefetch`` (see :class:`Prefetch`)."""

    name: str

    def prepare(self, inp: VerifyInput) -> PositionTest: ...


def screened_logits_ok(rule: object) -> bool:
    """Whether ``rule`` (a rule or a criterion) takes screened target logits under greedy decoding
    (attribute ``screened_logits_ok``; absent: no, it gets float32 logits)."""
    return bool(getattr(rule, "screened_logits_ok", False))


def exact_match_when_greedy(rule: object) -> bool:
    """Whether ``rule``, under greedy decoding, keeps a draft token exactly where it is the target's argmax
    and emits the argmax at the first row where it is not (attribute ``exact_match_when_greedy``; absent:
    no). For such a rule the engine may cut the draft at a position the target certainly rejects
    (:func:`~dropmatch.rules.standard.exact_match_prefix`) and run the head on fewer rows."""
    return bool(getattr(rule, "exact_match_when_greedy", False))


@runtime_checkable
class Prefetching(Protocol):
    """Optional capability of a rule or criterion: extra head rows to fuse into the verify GEMM
    (see :class:`Prefetch`). The engine calls ``prefetch`` before the head, when the draft is not empty."""

    def prefetch(self, hidden: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> Prefetch | None: ...
