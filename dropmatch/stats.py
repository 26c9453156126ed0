"""Statistics of one generation."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """Counts and timings of one ``generate`` call.

    Every target forward pass is a *step*: the prefill (0 drafted, 0 accepted) and each verify
    step. Each step emits its accepted draft tokens plus one target token (the correction or
    bonus), except where EOS or the token budget cuts it short. Hence
    ``new_tokens == sum(accepted_per_step) + target_tokens`` and tau = new_tokens / target_calls
    (plain decoding: 1.00).

    The paper's tau ("mean acceptance length") counts what each *verify* step emits: the tokens after
    the prefill's first one over the steps after the prefill, ``paper_tau = (new_tokens - generations)
    / (target_calls - generations)`` (``generations``: how many ``generate`` calls these statistics
    cover, i.e. how many prefills; plain decoding: 1.00; SD with L = 5 at most 6). Speeds come two
    ways: end to end (``tokens_per_s``, the user's view, prefill included) and after the prefill
    (``decode_tokens_per_s``: the tokens after the first over ``wall_s - prefill_s``), which is what
    methods that only change verification should be compared on. The draft model's prefill (in
    ``draft_s``) is part of the decode time.
    """

    new_tokens: int = 0
    target_calls: int = 0
    target_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)
    extra_accepts: int = 0
    criterion_evaluations: int = 0
    head_rows_per_step: list[int] = field(default_factory=list)  # verify steps' head rows: L + 1, fewer where cut
    cached_prompt_tokens: int = 0  # prompt positions copied from a cached prefix, not prefilled (prompt_cache)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0
    generations: int = 1

    @property
    def tau(self) -> float:
        """Ours: new tokens per target forward, the prefill included."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def decode_tokens(self) -> int:
        """New tokens after the first of each generation (the ones verify or decode steps emitted)."""
        return max(self.new_tokens - self.generations, 0)

    @property
    def decode_steps(self) -> int:
        """Target forwards after the prefills (verify steps; plain decoding: decode steps)."""
        return max(self.target_calls - self.generations, 0)

    @property
    def paper_tau(self) -> float:
        """The paper's tau: tokens emitted per verify step, bonus / correction token included."""
        return self.decode_tokens / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_s(self) -> float:
        """Wall time after the target's prefill (and its first token)."""
        return max(self.wall_s - self.prefill_s, 0.0)

    @property
    def tokens_per_s(self) -> float:
        """End to end: new tokens over the whole wall time."""
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """After the prefill: ``decode_tokens`` over ``decode_s`` (0.0 when nothing was decoded)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def verify_steps(self) -> int:
        return len(self.accepted_per_step)

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Share of drafts reaching position k (1-based) whose token k was accepted."""
        longest = max(self.drafted_per_step, default=0)
        rates = []
        for k in range(1, longest + 1):
            drafted = sum(1 for d in self.drafted_per_step if d >= k)
            accepted = sum(1 for d, a in zip(self.drafted_per_step, self.accepted_per_step, strict=True)
                           if d >= k and a >= k)
            rates.append(accepted / drafted)
        return rates

    @property
    def draft_acceptance_rate(self) -> float:
        drafted = sum(self.drafted_per_step)
        return sum(self.accepted_per_step) / drafted if drafted else 0.0

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "tau": round(self.tau, 4),
            "paper_tau": round(self.paper_tau, 4),
            "generations": self.generations,
            "accepted_per_step": self.accepted_per_step,
            "drafted_per_step": self.drafted_per_step,
            "target_tokens": self.target_tokens,
            "extra_accepts": self.extra_accepts,
            "criterion_evaluations": self.criterion_evaluations,
            "head_rows_per_step": self.head_rows_per_step,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "draft_acceptance_rate": round(self.draft_acceptance_rate, 4),
            "acceptance_rate_per_position": [round(r, 4) for r in self.acceptance_rate_per_position],
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "wall_s": round(self.wall_s, 4),
            "decode_s": round(self.decode_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
        }
