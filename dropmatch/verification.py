"""Verification rules: given one verify step's tensors, how many draft tokens to keep and what comes next.

Every rule has one interface, :class:`VerificationRule`, and sees only tensors (no model code):
draft tokens and probabilities, the target's dropout-free logits and last hidden states at the
L + 1 verified positions, the sampling settings and a random generator.

:class:`StandardVerification` is the lossless baseline: greedy exact match at temperature 0,
speculative sampling (accept with min(1, p/q), resample the residual, bonus from p) otherwise.
:class:`RelaxedVerification` adds a lossy acceptance criterion on top: where the standard rule
rejects, the criterion may still accept (DropMatch, top-K, typical acceptance, divergence
thresholds, a trained judge). The token emitted at the first rejected position, and the bonus token,
always come from the standard rule: the dropout-free argmax under greedy decoding, the
speculative-sampling correction under sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .sampling import SamplingConfig, sample_with_uniform


@dataclass
class Prefetch:
    """Extra LM-head rows a rule wants computed in the verification GEMM, and its state for the step.

    The engine asks ``rule.prefetch(hidden, sampling, generator)`` before running the head, fills
    ``products`` (``W @ rows.T``, (m, V) float32) when it can fuse them, and hands the object back in
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
    """

    draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    target_logits: torch.Tensor
    hidden: torch.Tensor
    sampling: SamplingConfig
    generator: torch.Generator
    draft_logits: torch.Tensor | None = None
    prefetch: Prefetch | None = None

    @property
    def n_draft(self) -> int:
        return int(self.draft_tokens.shape[0])

    def draft_distribution(self, j: int) -> torch.Tensor:
        """Draft distribution (V,) at position j; one-hot for deterministic drafts."""
        if self.draft_probs is not None:
            return self.draft_probs[j]
        if self.draft_logits is not None:
            return self.sampling.probs(self.draft_logits[j])
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


@dataclass
class _Standard:
    """Per-step quantities of the standard rule."""

    accepts: torch.Tensor  # (L,) bool
    correction: Callable[[int], int]
    bonus: int


def _standard(inp: VerifyInput) -> _Standard:
    n = inp.n_draft
    draft = inp.draft_tokens
    if inp.sampling.greedy:
        target_tokens = inp.target_logits.argmax(dim=-1).tolist()
        accepts = draft == inp.target_logits[:n].argmax(dim=-1)
        return _Standard(accepts.cpu(), lambda j: target_tokens[j], target_tokens[n])
    uniforms = torch.rand(n + 1, generator=inp.generator)
    p = inp.sampling.probs(inp.target_logits)  # (L + 1, V)
    rows = torch.arange(n, device=p.device)
    p_draft = p[rows, draft].cpu()
    q_draft = inp.draft_probs[rows, draft].cpu() if inp.draft_probs is not None else torch.ones(n)
    accepts = uniforms[:n] * q_draft < p_draft

    def correction(j: int) -> int:
        residual = (p[j] - inp.draft_distribution(j)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:
            residual = p[j]
        return int(sample_with_uniform(residual, uniforms[n]))

    return _Standard(accepts, correction, int(sample_with_uniform(p[n], uniforms[n])))


class StandardVerification:
    """Lossless verification: greedy exact match, or speculative sampling when temperature > 0."""

    name = "standard"

    def verify(self, inp: VerifyInput) -> Verdict:
        std = _standard(inp)
        rejected = (~std.accepts).nonzero()
        if len(rejected) == 0:
            return Verdict(inp.n_draft, std.bonus)
        j = int(rejected[0])
        return Verdict(j, std.correction(j))


class RelaxedVerification:
    """Standard verification plus a lossy criterion at the positions the standard rule rejects.

    Args:
        criterion: the lossy test.
        keep_standard_accepts: accept every position the standard rule accepts (default). With
            ``False`` the criterion alone decides at every position (the paper-literal reading).
    """

    def __init__(self, criterion: Criterion, keep_standard_accepts: bool = True):
        self.criterion = criterion
        self.keep_standard_accepts = keep_standard_accepts
        self.name = criterion.name + ("" if keep_standard_accepts else "-literal")

    def prefetch(self, hidden: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> Prefetch | None:
        ask = getattr(self.criterion, "prefetch", None)
        return ask(hidden, sampling, generator) if ask else None

    def verify(self, inp: VerifyInput) -> Verdict:
        test = self.criterion.prepare(inp)  # first: the same draw order as when the engine prefetched
        std = _standard(inp)
        extra = evaluations = 0
        for j in range(inp.n_draft):
            standard_ok = bool(std.accepts[j])
            if standard_ok and self.keep_standard_accepts:
                continue
            evaluations += 1
            if test(j):
                extra += not standard_ok
                continue
            return Verdict(j, std.correction(j), extra, evaluations)
        return Verdict(inp.n_draft, std.bonus, extra, evaluations)
