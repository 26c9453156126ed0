"""FLy (Li et al., arXiv 2511.22972, ICLR 2026): training-free loosely speculative decoding.

A draft token that the standard rule rejects is kept when two tests pass:

* **entropy gate**: the target's top-3 entropy at that position, ``H3 = -sum_{top 3} p log p``, is
  at least ``entropy_threshold`` (the position admits several plausible tokens);
* **deferred window**: the next ``window`` draft tokens, which the target scored conditioned on the
  mismatched token, are all accepted by the standard rule (the target "self-corrects" onto the draft).

Definitions follow the authors' code (github.com/AMD-AGI/FLy, ``fly/models/FLy.py`` and
``fly_config/FLy_Llama3_70b.json``), read where the paper's text was not at hand:

* ``p`` is the softmax of the raw target logits over the **whole** vocabulary (natural log, no
  temperature, no renormalisation over the three tokens, no division by log 3), so
  ``0 <= H3 <= log 3``; a flat distribution over a large vocabulary also has a small ``H3``.
  The gate only ever looks at mismatches.
* the authors' ``win_len`` counts the mismatched position too: ``win_len = window + 1``. Their
  defaults are ``entropy_thre = 0.3``, ``win_len = 6`` (``window = 5``), draft length 15 to 25.
* the windows are tested on exact (standard) acceptances only: a token kept by FLy does not count
  towards another mismatch's window.
* near the end of the draft: the authors' code resets the last ``win_len`` draft positions to the
  exact decision, so a mismatch at position j (0-based, draft length L) can be kept only when
  ``j + window + 2 <= L``, one position more than the window needs. We keep that. A mismatch
  there is rejected in this step (the target's token replaces it); nothing is carried to the next
  step. ``window = 0`` is the authors' no-window ablation (``abla_no_window``): the gate alone, at
  every position.

Choices where the source differs from this package or is silent:

* "accepted by the standard rule" is this package's standard rule: exact match under greedy
  decoding, speculative sampling (with the step's uniforms) under sampling. The authors' code at
  temperature > 0 instead compares the draft with two target samples, which we do not reproduce.
* the token emitted at the first rejected position and the bonus token come from the standard
  rule (the authors emit the target's argmax, or one target sample, there).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import Verdict, VerifyInput
from .standard import _standard


def top_k_entropy(logits: torch.Tensor, k: int = 3) -> torch.Tensor:
    """``-sum p log p`` over the ``k`` most likely tokens of ``softmax(logits)`` (nats, not renormalised)."""
    log_p = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1).values
    return -(log_p.exp() * log_p).sum(dim=-1)


class FLyVerification:
    """Standard verification that also keeps FLy's mismatches (entropy gate AND deferred window).

    Args:
        entropy_threshold: keep a mismatch only if the target's top-3 entropy there is >= this (nats).
        window: number of following draft tokens the standard rule must accept (authors' ``win_len - 1``).
    """

    def __init__(self, entropy_threshold: float = 0.3, window: int = 5):
        if not 0 <= entropy_threshold < float("inf"):  # NaN too: it would never keep a mismatch
            raise ConfigError(f"FLy's entropy threshold must be a finite number >= 0, got {entropy_threshold}")
        if window < 0:
            raise ConfigError(f"FLy's window must be >= 0, got {window}")
        self.entropy_threshold, self.window = entropy_threshold, window
        self.name = f"fly-{entropy_threshold:g}-{window}"

    def keeps(self, j: int, exact: list[bool], entropy: float) -> bool:
        """Whether the mismatch at position ``j`` is kept, given the exact decisions of the draft."""
        n, w = len(exact), self.window
        if w and j + w + 2 > n:  # the window must end before the draft's last token (authors' code)
            return False
        return entropy >= self.entropy_threshold and all(exact[j + 1 : j + 1 + w])

    def verify(self, inp: VerifyInput) -> Verdict:
        std = _standard(inp)
        exact = std.accepts.tolist()
        extra = evaluations = 0
        for j in range(inp.n_draft):
            if exact[j]:
                continue
            evaluations += 1
            if self.keeps(j, exact, float(top_k_entropy(inp.target_logits[j]))):
                extra += 1
                continue
            return Verdict(j, std.correction(j), extra, evaluations)
        return Verdict(inp.n_draft, std.bonus, extra, evaluations)
