"""Named decoding methods: one configuration object turned into a drafter and a verification rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from .criteria import DivergenceThreshold, TopK, TypicalAcceptance
from .drafters import Drafter, ModelDrafter, NgramDrafter
from .dropmatch_criteria import CRITERIA, MAJORITY_RULES, DropMatch
from .dropout_head import DropoutHead, check_dropout_args
from .engine import GenerationResult, generate
from .errors import ConfigError
from .models import CausalLM, ModelPair, _dtype
from .sampling import SamplingConfig
from .screened_head import bf16_matmul_supported
from .verification import Criterion, RelaxedVerification, StandardVerification, VerificationRule

METHODS = ("ar", "sd", "dropmatch", "topk", "typical", "divergence", "judge", "judge+dropmatch")
DRAFTERS = ("model", "ngram")


@dataclass
class MethodConfig:
    """Everything that names a decoding method. Parameters of other methods are ignored."""

    method: str = "sd"
    draft: str = "model"
    draft_len: int = 5
    # DropMatch
    k: int = 5
    p_drop: float = 0.3
    criterion: str = "js+majority"
    majority: str = "strict"
    literal: bool = False
    head_dtype: str | None = None
    # rivals
    topk: int = 2
    typical_eps: float = 0.09
    typical_delta: float = 0.3
    divergence: str = "js"
    divergence_threshold: float = 0.1
    # trained judge (AutoJudge-style)
    judge_path: str | None = None
    judge_threshold: float = 0.1
    # n-gram drafter
    ngram_max: int = 3
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.draft not in DRAFTERS:
            raise ConfigError(f"unknown drafter {self.draft!r}; choose model or ngram")
        if self.draft_len < 1:
            raise ConfigError(f"draft length must be >= 1, got {self.draft_len}")
        if self.method.startswith("judge") and not self.judge_path:
            raise ConfigError("--method judge needs --judge PATH (train one with `python -m dropmatch judge train`)")
        if "dropmatch" in self.method:
            check_dropout_args(self.k, self.p_drop)
            if self.criterion not in CRITERIA:
                raise ConfigError(f"unknown DropMatch criterion {self.criterion!r}; choose one of {', '.join(CRITERIA)}")
            if self.majority not in MAJORITY_RULES:
                raise ConfigError(f"unknown majority rule {self.majority!r}; choose strict or plurality")

    @property
    def speculative(self) -> bool:
        return self.method != "ar"

    @property
    def label(self) -> str:
        """Short human-readable name, e.g. ``dropmatch(js+majority,K=5,p=0.3)``."""
        if self.method == "ar":
            return "ar"
        dropmatch = f"{self.criterion},K={self.k},p={self.p_drop:g}"
        base = {"sd": "sd", "topk": f"topk(K={self.topk})",
                "typical": f"typical(eps={self.typical_eps:g},delta={self.typical_delta:g})",
                "divergence": f"divergence({self.divergence}<={self.divergence_threshold:g})",
                "dropmatch": f"dropmatch({dropmatch})", "judge": f"judge(t={self.judge_threshold:g})",
                "judge+dropmatch": f"judge+dropmatch(t={self.judge_threshold:g},{dropmatch})"}[self.method]
        draft = "" if self.draft == "model" else "+ngram"
        return f"{base}{draft}@L{self.draft_len}"

    def to_dict(self) -> dict:
        return asdict(self)


def default_head_dtype(target: CausalLM) -> torch.dtype:
    """bfloat16 (float16 for float16 models), except float32 on CPUs without native bfloat16 GEMMs."""
    weight = target.head_weight
    if weight.dtype == torch.float16:
        return torch.float16
    if weight.device.type == "cpu" and not bf16_matmul_supported():
        return torch.float32
    return torch.bfloat16


def build_criterion(target: CausalLM, config: MethodConfig) -> Criterion | None:
    if config.method.startswith("judge"):
        from .judge import AnyOf, Judge, JudgeCriterion

        judge = JudgeCriterion(Judge.load(config.judge_path), config.judge_threshold)
        if config.method == "judge":
            return judge
        return AnyOf([judge, build_criterion(target, MethodConfig(**{**config.to_dict(), "method": "dropmatch"}))])
    if config.method == "dropmatch":
        dtype = _dtype(config.head_dtype, target.device) if config.head_dtype else None
        if dtype is None:
            dtype = default_head_dtype(target)
        head = DropoutHead(target.head_weight, config.k, config.p_drop, compute_dtype=dtype,
                           softcap=target.softcap, weight_in_compute_dtype=target.head_weight_as(dtype))
        return DropMatch(head, config.criterion, config.majority)
    if config.method == "topk":
        return TopK(config.topk)
    if config.method == "typical":
        return TypicalAcceptance(config.typical_eps, config.typical_delta)
    if config.method == "divergence":
        return DivergenceThreshold(config.divergence, config.divergence_threshold)
    return None


def build_rule(target: CausalLM, config: MethodConfig) -> VerificationRule:
    criterion = build_criterion(target, config)
    if criterion is None:
        return StandardVerification()
    return RelaxedVerification(criterion, keep_standard_accepts=not config.literal)


def build_drafter(pair: ModelPair, config: MethodConfig) -> Drafter | None:
    if not config.speculative:
        return None
    if config.draft == "ngram":
        return NgramDrafter(max_ngram=config.ngram_max)
    if pair.draft is None:
        raise ConfigError("this method needs a draft model: load the pair with a draft, or use --draft ngram")
    return ModelDrafter(pair.draft)


class Decoder:
    """A model pair, a method and sampling settings, ready to decode prompts.

    >>> decoder = Decoder(load_pair("tiny"), MethodConfig("dropmatch", k=5, p_drop=0.3))
    >>> result = decoder.generate("Question: 2 + 2 =", max_new_tokens=16)
    """

    def __init__(self, pair: ModelPair, config: MethodConfig | None = None, sampling: SamplingConfig | None = None):
        self.pair = pair
        self.config = config or MethodConfig()
        self.sampling = sampling or SamplingConfig()
        self.rule = build_rule(pair.target, self.config)
        self.drafter = build_drafter(pair, self.config)

    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 64, seed: int = 0,
                 stop: Sequence[str] = ()) -> GenerationResult:
        """Decode after ``prompt`` (text or token ids); ``stop`` strings end generation after the step
        that produced them (the caller cuts the text)."""
        ids = self.pair.encode(prompt) if isinstance(prompt, str) else prompt
        return generate(self.pair.target, ids, drafter=self.drafter, rule=self.rule,
                        draft_len=self.config.draft_len, max_new_tokens=max_new_tokens,
                        sampling=self.sampling, seed=seed, eos_token_ids=self.pair.eos_token_ids,
                        should_stop=StopOnText(self.pair.decode, stop) if stop else None)


class StopOnText:
    """Stop strings for :func:`~dropmatch.engine.generate`: once the decoded tail of the output (its
    last ``window`` tokens, enough for any stop string plus one speculative step) contains one of
    ``stop``, returns the length of the shortest output prefix that does; else ``None``."""

    def __init__(self, decode, stop: Sequence[str], window: int = 48):
        self.decode, self.stop, self.window = decode, tuple(s for s in stop if s), window

    def _contains(self, ids: Sequence[int]) -> bool:
        tail = self.decode(list(ids))
        return any(s in tail for s in self.stop)

    def __call__(self, output_ids: list[int]) -> int | None:
        start = max(0, len(output_ids) - self.window)
        if not self._contains(output_ids[start:]):
            return None
        low, high = start, len(output_ids)  # output[start:high] contains a stop, output[start:low] does not
        while high - low > 1:
            mid = (low + high) // 2
            if self._contains(output_ids[start:mid]):
                high = mid
            else:
                low = mid
        return high
