"""Prompt lookup first, a model drafter otherwise (e.g. n-gram lookup + the EAGLE-3 head).

Where the context's last tokens occurred before, what followed them is a nearly free and often long
draft (GSM8K answers copy numbers and phrases from the question and the worked examples); elsewhere
the wrapped drafter proposes. On the embedded pair the two are complementary: lookup alone reaches
tau ~2.3-3.0, the EAGLE-3 head alone ~1.8-1.9, and lookup-first with the head as the fallback more than
either (``make bench-engine``). Lossless like any drafter: lookup drafts carry no distribution, so the
target treats them as one-hot proposals.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..sampling import SamplingConfig
from .base import Draft, Drafter, FeatureDrafter, FollowingDrafter, GuessingDrafter
from .ngram import check_ngram_sizes, lookup_candidates


class LookupFirstDrafter:
    """Propose the tokens that followed the latest earlier occurrence of the context's last n-gram
    (n from ``max_ngram`` down to ``min_match``); where there is none, ``drafter`` proposes.

    ``drafter`` must implement :class:`FollowingDrafter`: on lookup steps it runs nothing and queues the
    context it missed for its next proposal. ``lookup_steps`` / ``drafter_steps`` count the proposals each
    made since construction (across prompts when a ``Decoder`` reuses the drafter).

    ``guide_at`` (a probability; drafters with a :class:`GuessingDrafter` ``first_guess``, i.e. the EAGLE-3
    head): where lookup finds matches, the drafter guesses its first token, and of all the matches (longest
    n-gram first, then the most recent) the first whose next token is that guess is proposed. Where none
    is, the drafter's own chain is proposed if its guess has at least this probability (untempered, whatever
    the sampling), else the latest match as without guidance. On GSM8K the head's guess often chooses well
    among the matches, and is often right where lookup's latest match is wrong (``make bench-verify-rows``).
    The choice depends on the draft alone, so greedy SD still equals AR and speculative sampling stays
    lossless. ``guided_steps`` counts the steps where the guide changed the proposal (an older match, or the
    drafter's own chain, instead of the latest match).
    """

    def __init__(self, drafter: Drafter, max_ngram: int = 3, min_match: int = 2, guide_at: float | None = None):
        if not isinstance(drafter, FollowingDrafter):
            raise ConfigError(f"lookup-first drafting needs a drafter that can follow another's proposals "
                              f"(model or eagle3), not {getattr(drafter, 'name', type(drafter).__name__)!r}")
        if guide_at is not None and not isinstance(drafter, GuessingDrafter):
            raise ConfigError(f"guided lookup needs a drafter that guesses its first token (eagle3), not "
                              f"{getattr(drafter, 'name', type(drafter).__name__)!r}")
        check_ngram_sizes(min_match, max_ngram)
        check_lookup_guide(guide_at)
        self.drafter, self.max_ngram, self.min_match, self.guide_at = drafter, max_ngram, min_match, guide_at
        self.name = f"ngram+{drafter.name}"
        if isinstance(drafter, FeatureDrafter):  # the engine then computes the features the drafter reads
            self.feature_layers = drafter.feature_layers
        self.context: list[int] = []
        self._proposed: list[int] = []
        self.device = torch.device("cpu")
        self.lookup_steps = self.drafter_steps = self.guided_steps = 0

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        self.drafter.start(prompt_ids, features)
        self.context, self._proposed, self.device = prompt_ids.view(-1).tolist(), [], prompt_ids.device

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        self.context.append(last_token)
        tokens = self._lookup(last_token, n)
        if tokens:
            self.drafter.follow(last_token, tokens)
            self.lookup_steps += 1
            self._proposed = tokens
            return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device))
        draft = self.drafter.propose(last_token, n, sampling, generator)
        self.drafter_steps += n > 0
        self._proposed = draft.tokens.tolist()
        return draft

    def _lookup(self, last_token: int, n: int) -> list[int]:
        """This step's lookup proposal (tokens after the context, which ends in ``last_token``); empty where
        the drafter proposes instead."""
        matches = lookup_candidates(self.context, n, self.max_ngram, self.min_match)
        latest = next(matches, [])
        if not latest or self.guide_at is None:
            return latest
        guess, confidence = self.drafter.first_guess(last_token)
        if latest[0] == guess:
            return latest
        agreeing = next((tokens for tokens in matches if tokens[0] == guess), None)
        chosen = agreeing if agreeing is not None else [] if confidence >= self.guide_at else latest
        self.guided_steps += chosen is not latest
        return chosen

    def commit(self, n_accepted: int, features: torch.Tensor | None = None) -> None:
        self.context.extend(self._proposed[:n_accepted])
        self.drafter.commit(n_accepted, features)


def check_lookup_guide(guide_at: float | None) -> None:
    """Refuse a lookup guide that is not a probability in [0, 1] (``None``: no guide)."""
    if guide_at is not None and not 0.0 <= guide_at <= 1.0:
        raise ConfigError(f"the lookup guide (--lookup-guide) is a draft probability in [0, 1], got {guide_at!r}")
