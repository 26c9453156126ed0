"""Static ensemble verification (DIVERSED's training-free baseline; Wang et al., AISTATS 2026,
arXiv 2604.07622), as Hugging Face transformers ships it (``assistant_ensemble_weight``).

The rule verifies against the mixture ``v = w p + (1 - w) q`` (p target, q draft distribution at
the same position) instead of p; ``w = 1`` is standard verification.

* **sampling**: accept draft token x with probability ``min(1, v(x) / q(x))`` (``u q(x) < v(x)``
  with the step's uniforms, so every token standard speculative sampling accepts is accepted too);
  at the first rejection sample the residual ``[v - q]+``, which normalises to the same
  distribution as ``[p - q]+`` because ``v - q = w (p - q)`` (transformers computes it that way;
  so do we, falling back to p when the residual vanishes). The token emitted at each position is
  then distributed as v exactly. The bonus token is sampled from p: the draft has no distribution
  at that position, so there is no v to mix (transformers does the same).
* **greedy**: the draft token must equal ``argmax v``; the token emitted at the first mismatch is
  ``argmax v`` at that position (not ``argmax p``) and the bonus token is ``argmax p``, as in
  transformers. p and q are the untempered softmaxes; q comes from the draft's logits.

Where the sources differ or are silent:

* transformers refuses the ensemble with prompt lookup (no draft logits); we treat a draft without
  distributions (n-gram lookup) as one-hot, like every rule here. Under greedy decoding the one-hot
  draft token x then wins ``argmax v`` iff ``max_{y != x} p(y) - p(x) < (1 - w) / w`` (ties go to
  the lower token id): a probability-gap rule; for ``w <= 1/2`` every draft token is kept, and a
  rejected one is replaced by ``argmax p``. Under sampling it is kept with probability
  ``1 - w + w p(x)``, else replaced by a sample of p without x.
* DIVERSED's own scripts name the weight on the *draft* (``draft_ensemble_weights`` = 1 - w here).
* transformers requires ``0 < w < 1``; we also allow ``w = 1`` (standard verification, the tests'
  anchor).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..sampling import sample_with_uniform
from .base import Verdict, VerifyInput


class StaticEnsembleVerification:
    """Verify the draft against ``v = w p + (1 - w) q``.

    Args:
        weight: w, the target's weight in the mixture, in (0, 1]; 1 is standard verification.
    """

    def __init__(self, weight: float = 0.5):
        if not 0 < weight <= 1:
            raise ConfigError(f"the ensemble weight must be in (0, 1] (1 = standard verification), got {weight}")
        self.weight = weight
        self.name = f"ensemble-{weight:g}"

    def mixture(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return self.weight * p + (1.0 - self.weight) * q

    def verify(self, inp: VerifyInput) -> Verdict:
        return self._greedy(inp) if inp.sampling.greedy else self._sampling(inp)

    def _greedy(self, inp: VerifyInput) -> Verdict:
        n = inp.n_draft
        draft = inp.draft_tokens.tolist()
        p = inp.sampling.probs(inp.target_logits[:n])
        target = inp.target_logits.argmax(dim=-1).tolist()
        # w = 1: argmax p from the logits, as standard verification (probabilities tie where logits do not)
        choice = target[:n] if self.weight == 1 else self.mixture(p, inp.draft_distributions()).argmax(dim=-1).tolist()
        extra = 0
        for j in range(n):
            if draft[j] != choice[j]:
                return Verdict(j, choice[j], extra, j + 1)
            extra += draft[j] != target[j]
        return Verdict(n, target[n], extra, n)

    def _sampling(self, inp: VerifyInput) -> Verdict:
        n = inp.n_draft
        uniforms = torch.rand(n + 1, generator=inp.generator)  # the standard rule's draws, in its order
        p = inp.sampling.probs(inp.target_logits)  # (L + 1, V)
        q = inp.draft_distributions().to(p.device)
        rows = torch.arange(n, device=p.device)
        p_x, q_x = p[rows, inp.draft_tokens].cpu(), q[rows, inp.draft_tokens].cpu()
        accepts = (uniforms[:n] * q_x < self.mixture(p_x, q_x)).tolist()
        standard = (uniforms[:n] * q_x < p_x).tolist()
        extra = 0
        for j in range(n):
            if not accepts[j]:
                residual = (p[j] - q[j]).clamp_(min=0.0)  # proportional to [v - q]+
                if float(residual.sum()) <= 0.0:
                    residual = p[j]
                return Verdict(j, int(sample_with_uniform(residual, uniforms[n])), extra, j + 1)
            extra += not standard[j]
        return Verdict(n, int(sample_with_uniform(p[n], uniforms[n])), extra, n)
