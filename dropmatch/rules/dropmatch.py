"""DropMatch acceptance criteria (paper Sec. 3.2, Algorithm 1) on K dropout heads.

For a draft token x at a position, the K heads give logits l_1..l_K (K, V):

* ``naive``: x equals the token of at least one head (its argmax; under sampling, the token the
  head samples at the run's temperature / top-p).
* ``majority``: x is the heads' majority token. ``strict`` (default): more than K/2 heads pick x.
  ``plurality``: x is picked by strictly more heads than any other token (a tie rejects).
* ``js``: JS(q || c) <= max_i JS(p_i || c), with c = softmax(mean_i l_i) the centroid, p_i the
  heads' distributions and q the draft distribution (one-hot for drafters without one).
* ``js+majority`` (Algorithm 1, the default): js OR majority.

Distributions are untempered under greedy decoding and tempered / top-p under sampling.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..heads.dropout import DropoutHead
from ..sampling import SamplingConfig, sample_with_uniform
from .base import PositionTest, Prefetch, VerifyInput
from .divergence import js_divergence

CRITERIA = ("naive", "js", "majority", "js+majority")
MAJORITY_RULES = ("strict", "plurality")


def check_criterion_args(criterion: str, majority: str = "strict") -> None:
    """Refuse an unknown criterion or majority rule with a clear error."""
    if criterion not in CRITERIA:
        raise ConfigError(f"unknown DropMatch criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")
    if majority not in MAJORITY_RULES:
        raise ConfigError(f"unknown majority rule {majority!r}; choose strict or plurality")


def head_tokens(head_logits: torch.Tensor, sampling: SamplingConfig, uniforms: torch.Tensor | None) -> torch.Tensor:
    """Token of each head (K,): argmax under greedy decoding, else a sample with ``uniforms`` (K,)."""
    if sampling.greedy:
        return head_logits.argmax(dim=-1)
    return sample_with_uniform(sampling.probs(head_logits), uniforms)


def majority_accepts(tokens: torch.Tensor, draft_token: int, rule: str = "strict") -> bool:
    """Whether ``draft_token`` is the majority of the heads' ``tokens`` (K,)."""
    votes = int((tokens == draft_token).sum())
    if rule == "strict":
        return 2 * votes > tokens.numel()
    others = tokens[tokens != draft_token]
    return votes > 0 and (others.numel() == 0 or votes > int(others.unique(return_counts=True)[1].max()))


def js_accepts(head_logits: torch.Tensor, draft_dist: torch.Tensor, sampling: SamplingConfig) -> bool:
    """JS(q || c) <= max_i JS(p_i || c) with c = softmax of the mean head logits (Eqs. 5-6)."""
    # mean of the logits, written so that K identical heads give exactly that head (JS radius 0)
    centroid = sampling.probs(head_logits[0] + (head_logits - head_logits[0]).mean(dim=0))
    radius = js_divergence(sampling.probs(head_logits), centroid).max()
    return bool(js_divergence(draft_dist, centroid) <= radius)


def decide(criterion: str, head_logits: torch.Tensor, draft_token: int, draft_dist: torch.Tensor,
           sampling: SamplingConfig, uniforms: torch.Tensor | None, majority: str = "strict") -> bool:
    """One DropMatch decision from the K head logits (K, V) at one position."""
    if criterion == "js":
        return js_accepts(head_logits, draft_dist, sampling)
    tokens = head_tokens(head_logits, sampling, uniforms)
    if criterion == "naive":
        return bool((tokens == draft_token).any())
    if majority_accepts(tokens, draft_token, majority):
        return True
    return criterion == "js+majority" and js_accepts(head_logits, draft_dist, sampling)


class DropMatch:
    """The DropMatch criterion: K dropout heads computed only at the positions it is asked about.

    All randomness of a step (the K x L x d masks, and under sampling the K x L head uniforms) is
    drawn up front, so the decisions do not depend on which positions are evaluated: computing every
    head at every position gives the same decisions (tested).

    Cost: a head GEMM is one pass over the whole LM-head weight (335 MB in bfloat16 on the embedded
    pair), and extra rows in a pass cost far less than a second pass. So the dropout rows of the first
    ``prefetch`` positions (default: all L) ride in the verification GEMM itself (:meth:`prefetch`),
    while the criteria (argmaxes, JS) run only where the standard rule rejects, until DropMatch
    rejects. Positions beyond ``prefetch`` that need heads compute them ``prefetch`` at a time.
    Measured on the embedded pair, L = 5 (head + rule per verify step, standard: 40 ms):
    prefetch 1: 76 ms, 2: 73 ms, 3: 71 ms, 5: 65 ms.
    """

    def __init__(self, head: DropoutHead, criterion: str = "js+majority", majority: str = "strict",
                 prefetch: int = 16):
        check_criterion_args(criterion, majority)
        self.head, self.criterion, self.majority = head, criterion, majority
        self.prefetch_positions = max(1, prefetch)
        self.name = f"dropmatch-{criterion}"

    def _draw(self, n_draft: int, sampling: SamplingConfig, generator: torch.Generator):
        masks = self.head.draw_masks(n_draft, generator)
        uniforms = None if sampling.greedy else torch.rand((n_draft, self.head.k), generator=generator)
        return masks, uniforms

    def draw(self, inp: VerifyInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Masks (L, K, d) and head uniforms (L, K) or ``None`` under greedy decoding."""
        if inp.prefetch is not None:
            return inp.prefetch.state
        return self._draw(inp.n_draft, inp.sampling, inp.generator)

    def prefetch(self, hidden: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> Prefetch:
        """Draw the step's randomness now and ask for the first ``prefetch`` positions' perturbation
        rows to ride in the verification GEMM (``hidden``: the L + 1 verified positions)."""
        masks, uniforms = self._draw(hidden.shape[0] - 1, sampling, generator)
        n = min(self.prefetch_positions, masks.shape[0])
        fusable = n and not self.head.softcap and self.head.compute_dtype == torch.bfloat16  # the screened GEMM's dtype
        rows = self.head.perturbation_inputs(hidden[:n], masks[:n]) if fusable else None
        return Prefetch(rows, (masks, uniforms))

    def prepare(self, inp: VerifyInput) -> PositionTest:
        masks, uniforms = self.draw(inp)
        heads: dict[int, torch.Tensor] = {}
        fused = inp.prefetch.products if inp.prefetch is not None else None
        if fused is not None:
            n = fused.shape[0] // self.head.k
            logits = self.head.logits(inp.hidden[:n], inp.target_logits[:n], masks[:n], products=fused)
            heads.update(enumerate(logits))

        def test(j: int) -> bool:
            if j not in heads:
                # The GEMM reads the whole head weight; a few more rows cost almost nothing, so the
                # next ``prefetch - 1`` positions are computed with this one (the next test is likely there).
                rows = slice(j, min(j + self.prefetch_positions, inp.n_draft))
                logits = self.head.logits(inp.hidden[rows], inp.target_logits[rows], masks[rows])
                heads.update({j + i: row for i, row in enumerate(logits)})
            return decide(self.criterion, heads[j], int(inp.draft_tokens[j]), inp.draft_distribution(j),
                          inp.sampling, None if uniforms is None else uniforms[j], self.majority)

        return test
