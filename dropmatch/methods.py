"""Named decoding methods: one configuration object turned into a drafter and a verification rule."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch

from .drafters import (
    Drafter,
    FeatureDrafter,
    LookupFirstDrafter,
    ModelDrafter,
    NgramDrafter,
    check_stop_below,
)
from .drafters.lookup_first import check_lookup_guide
from .engine import GenerationResult, generate
from .errors import ConfigError
from .heads import DropoutHead, check_dropout_args, default_head_dtype
from .heads.byte_columns import BYTE_ROWWISE, byte_columns_supported
from .models import CausalLM, ModelPair, _dtype
from .prompt_cache import PromptPrefix
from .rules import (
    AnyOf,
    Criterion,
    DivergenceThreshold,
    DropMatch,
    FLyVerification,
    RelaxedVerification,
    StandardVerification,
    StaticEnsembleVerification,
    TopK,
    TypicalAcceptance,
    VerificationRule,
)
from .rules.dropmatch import check_criterion_args
from .rules.judge import Judge, JudgeCriterion
from .sampling import SamplingConfig
from .stopping import StopOnText

METHODS = ("ar", "sd", "dropmatch", "topk", "typical", "divergence", "fly", "ensemble", "judge", "judge+dropmatch")
DRAFTERS = ("model", "ngram", "eagle3")


_DROPMATCH = ("dropmatch", "judge+dropmatch")
_JUDGE = ("judge", "judge+dropmatch")
_RELAXED = ("dropmatch", "topk", "typical", "divergence", "judge", "judge+dropmatch")  # RelaxedVerification
# Fields that matter to some methods only (a field not named here matters to every method but ``ar``).
FIELD_METHODS: dict[str, tuple[str, ...]] = {
    "k": _DROPMATCH, "p_drop": _DROPMATCH, "criterion": _DROPMATCH, "majority": _DROPMATCH,
    "head_dtype": _DROPMATCH, "literal": _RELAXED, "topk": ("topk",), "typical_eps": ("typical",),
    "typical_delta": ("typical",), "divergence": ("divergence",), "divergence_threshold": ("divergence",),
    "fly_entropy": ("fly",), "fly_window": ("fly",), "ensemble_weight": ("ensemble",),
    "judge_path": _JUDGE, "judge_threshold": _JUDGE,
}
# Fields each method's label names in its own form, e.g. ``dropmatch(js+majority,K=5,p=0.3)``.
LABEL_SHOWN: dict[str, tuple[str, ...]] = {
    "dropmatch": ("k", "p_drop", "criterion"), "topk": ("topk",), "typical": ("typical_eps", "typical_delta"),
    "divergence": ("divergence", "divergence_threshold"), "fly": ("fly_entropy", "fly_window"),
    "ensemble": ("ensemble_weight",), "judge": ("judge_threshold",),
    "judge+dropmatch": ("judge_threshold", "k", "p_drop", "criterion"),
}


EAGLE3_FIELDS = ("draft_head",)  # fields that only the EAGLE-3 drafter reads
STOPPING_DRAFTERS = ("model", "eagle3")  # drafters that read draft_stop (a confidence stop needs a draft distribution)
FOLLOWING_DRAFTERS = ("model", "eagle3")  # drafters that lookup_first can fall back to
LOOKUP_FIELDS = ("lookup_min", "lookup_guide")  # fields that only lookup-first drafting reads
# fields left out of MethodConfig.to_dict at their defaults (added later: older results keep their keys)
KEY_NEUTRAL = ("draft_stop", "lookup_first", "lookup_min", "lookup_guide")


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
    fly_entropy: float = 0.3  # FLy: top-3 entropy gate (nats)
    fly_window: int = 5  # FLy: following draft tokens that must match (the authors' win_len - 1)
    ensemble_weight: float = 0.5  # static ensemble: v = w p + (1 - w) q
    # trained judge (AutoJudge-style)
    judge_path: str | None = None
    judge_threshold: float = 0.1
    # n-gram drafter (and the lookup of lookup_first)
    ngram_max: int = 3
    # EAGLE-3 drafter: a head directory or hub id (None: the committed head of the embedded pair)
    draft_head: str | None = None
    # model and EAGLE-3 drafters: end a proposal after a draft token below this probability (None: always L tokens)
    draft_stop: float | None = None
    # model and EAGLE-3 drafters: n-gram lookup first (n from ngram_max down to lookup_min), the drafter
    # only where no such n-gram occurred before (LookupFirstDrafter)
    lookup_first: bool = False
    lookup_min: int = 2
    # EAGLE-3 with lookup first: the head's first token picks among the lookup matches, and its own chain
    # replaces a disagreeing lookup at this draft probability or more (None: the latest match, head idle)
    lookup_guide: float | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.draft not in DRAFTERS:
            raise ConfigError(f"unknown drafter {self.draft!r}; choose one of {', '.join(DRAFTERS)}")
        if self.draft_len < 1:
            raise ConfigError(f"draft length must be >= 1, got {self.draft_len}")
        check_stop_below(self.draft_stop)
        if self.method == "ar":
            drafting = [name for name, used in (("--draft " + self.draft, self.draft != "model"),
                                                ("--draft-head", self.draft_head is not None),
                                                ("--draft-stop", self.draft_stop is not None),
                                                ("--lookup-first", self.lookup_first)) if used]
            if drafting:
                raise ConfigError(f"--method ar decodes without a draft: {', '.join(drafting)} needs a speculative "
                                  "method (e.g. --method sd)")
        if self.draft_stop is not None and self.draft not in STOPPING_DRAFTERS:
            raise ConfigError(f"--draft-stop needs a drafter with a distribution ({' or '.join(STOPPING_DRAFTERS)}), "
                              f"not {self.draft!r}")
        if self.lookup_first and self.draft not in FOLLOWING_DRAFTERS:
            raise ConfigError(f"--lookup-first puts n-gram lookup before a draft model or an EAGLE-3 head, not before "
                              f"{self.draft!r}")
        if self.lookup_min != _default("lookup_min") and not self.lookup_first:
            raise ConfigError("--lookup-min sets the shortest match of --lookup-first: pass it with --lookup-first")
        if self.lookup_guide is not None and not (self.lookup_first and self.draft == "eagle3"):
            raise ConfigError("--lookup-guide lets the EAGLE-3 head choose between lookup matches: pass it with "
                              "--draft eagle3 --lookup-first")
        check_lookup_guide(self.lookup_guide)
        if not 1 <= self.lookup_min <= self.ngram_max:
            raise ConfigError(f"--lookup-min must be in 1..--ngram-max ({self.ngram_max}), got {self.lookup_min}")
        if self.method.startswith("judge") and not self.judge_path:
            raise ConfigError("--method judge needs --judge PATH (train one with `python -m dropmatch judge train`)")
        if self.method == "fly" and self.fly_window > 0 and self.fly_window + 2 > self.draft_len:
            raise ConfigError(f"FLy with a window of {self.fly_window} keeps a mismatch only where the window ends "
                              f"before the draft's last token, which a draft of {self.draft_len} never allows: it "
                              f"would be standard SD. Pass --draft-len >= {self.fly_window + 2} or a smaller "
                              "--fly-window")
        if "dropmatch" in self.method:
            check_dropout_args(self.k, self.p_drop)
            check_criterion_args(self.criterion, self.majority)

    @property
    def speculative(self) -> bool:
        return self.method != "ar"

    @property
    def label(self) -> str:
        """Short human-readable name, e.g. ``dropmatch(js+majority,K=5,p=0.3)@L5``; non-default settings
        the name does not show follow in brackets: ``dropmatch(js,K=5,p=0.3)[majority=plurality,literal]@L5``."""
        if self.method == "ar":
            return "ar"
        dropmatch = f"{self.criterion},K={self.k},p={self.p_drop:g}"
        base = {"sd": "sd", "topk": f"topk(K={self.topk})",
                "typical": f"typical(eps={self.typical_eps:g},delta={self.typical_delta:g})",
                "divergence": f"divergence({self.divergence}<={self.divergence_threshold:g})",
                "fly": f"fly(H3>={self.fly_entropy:g},W={self.fly_window})",
                "ensemble": f"ensemble(w={self.ensemble_weight:g})",
                "dropmatch": f"dropmatch({dropmatch})", "judge": f"judge(t={self.judge_threshold:g})",
                "judge+dropmatch": f"judge+dropmatch(t={self.judge_threshold:g},{dropmatch})"}[self.method]
        draft = "" if self.draft == "model" else f"+{self.draft}"
        return f"{base}{draft}{self._label_extras()}@L{self.draft_len}"

    def _label_extras(self) -> str:
        """``[name=value,...]``: every field that differs from its default, matters for this method and
        is not already in the label's name (empty at the defaults, so default labels are unchanged)."""
        shown = LABEL_SHOWN.get(self.method, ())
        extras = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("method", "draft", "draft_len") or f.name in shown or value == _default(f.name):
                continue
            if f.name in FIELD_METHODS and self.method not in FIELD_METHODS[f.name]:
                continue
            if (f.name == "ngram_max" and self.draft != "ngram" and not self.lookup_first) \
                    or (f.name in EAGLE3_FIELDS and self.draft != "eagle3") \
                    or (f.name in LOOKUP_FIELDS and not self.lookup_first):
                continue
            if f.name == "draft_head" and value is not None:
                value = Path(value).name
            if f.name == "judge_path":
                value = Path(value).stem
            if isinstance(value, dict):
                extras += [f"{k}={v}" for k, v in sorted(value.items())]
            elif value is True:
                extras.append(f.name)
            else:
                extras.append(f"{f.name}={value:g}" if isinstance(value, float) else f"{f.name}={value}")
        return f"[{','.join(extras)}]" if extras else ""

    def to_dict(self) -> dict:
        """All fields, except those added later at their default (``KEY_NEUTRAL``), so that the results of
        configurations that do not use them keep their keys (resumable caches stay valid)."""
        raw = asdict(self)
        return {k: v for k, v in raw.items() if not (k in KEY_NEUTRAL and v == _default(k))}


def _default(name: str):
    """A :class:`MethodConfig` field's default value (a fresh one for fields with a default factory)."""
    f = MethodConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default_factory is not MISSING else f.default


def dropout_head(target: CausalLM, k: int, p_drop: float, head_dtype: str | None = None) -> DropoutHead:
    """K dropout heads on ``target``'s LM head, sharing its weight copy in the compute dtype. On a CPU with
    oneDNN and a float32 head the heads take sparse columns at small K p_drop (greedy corrections in 8 bits
    on x86, else bfloat16 where native), else K-row passes (see :class:`~dropmatch.heads.dropout.DropoutHead`)."""
    dtype = _dtype(head_dtype, target.device) if head_dtype else default_head_dtype(target.head_weight)
    # greedy corrections of sparse heads on a float32 head on an x86 CPU: 8-bit columns, unless float32 heads were
    # asked for (default_head_dtype's float32 on CPUs without native bfloat16 asks nothing: fbgemm runs there too).
    # Their bound is against float32 products, the reference precision of a float32 head only
    eight_bit = (byte_columns_supported(target.head_weight) and not target.softcap
                 and (head_dtype is None or dtype in (torch.bfloat16, torch.float16)))
    return DropoutHead(target.head_weight, k, p_drop, compute_dtype=dtype, softcap=target.softcap,
                       weight_in_compute_dtype=target.head_weight_as(dtype),
                       sparse_dtype=BYTE_ROWWISE if eight_bit else None)


def _warn_if_dtype_unused(rule: DropMatch, head_dtype: str | None) -> None:
    """Say so where a CPU float32 head computes a greedy step's dropout heads in float32 although
    ``head_dtype`` asked for another dtype (sparse columns on CPUs with neither fbgemm nor native bfloat16;
    float32 rows for JS criteria). A reduced dtype asked for and 8-bit sparse columns used is no surprise:
    both trade precision for bytes, and the decisions are certified either way."""
    used, asked = rule.heads_dtype(SamplingConfig()), _dtype(head_dtype, rule.head.weight.device) if head_dtype else None
    if head_dtype and used != asked and not (used == BYTE_ROWWISE and asked != torch.float32):
        warnings.warn(f"--head-dtype {head_dtype} does not apply here: a CPU float32 head computes these dropout "
                      f"heads exactly in {str(used).removeprefix('torch.')} (the method's label still names the "
                      "dtype)", stacklevel=3)


def build_criterion(target: CausalLM, config: MethodConfig) -> Criterion | None:
    if config.method.startswith("judge"):
        judge = JudgeCriterion(Judge.load(config.judge_path), config.judge_threshold)
        if config.method == "judge":
            return judge
        return AnyOf([judge, build_criterion(target, MethodConfig(**{**config.to_dict(), "method": "dropmatch"}))])
    if config.method == "dropmatch":
        rule = DropMatch(dropout_head(target, config.k, config.p_drop, config.head_dtype), config.criterion,
                         config.majority)
        _warn_if_dtype_unused(rule, config.head_dtype)
        return rule
    if config.method == "topk":
        return TopK(config.topk)
    if config.method == "typical":
        return TypicalAcceptance(config.typical_eps, config.typical_delta)
    if config.method == "divergence":
        return DivergenceThreshold(config.divergence, config.divergence_threshold)
    return None


def build_rule(target: CausalLM, config: MethodConfig) -> VerificationRule:
    if config.method == "fly":
        return FLyVerification(config.fly_entropy, config.fly_window)
    if config.method == "ensemble":
        return StaticEnsembleVerification(config.ensemble_weight)
    criterion = build_criterion(target, config)
    if criterion is None:
        return StandardVerification()
    return RelaxedVerification(criterion, keep_standard_accepts=not config.literal)


def build_drafter(pair: ModelPair, config: MethodConfig) -> Drafter | None:
    if not config.speculative:
        return None
    if config.draft == "ngram":
        return NgramDrafter(max_ngram=config.ngram_max)
    if config.draft == "eagle3":
        drafter = _eagle3_drafter(pair, config.draft_head, config.draft_stop)
    elif pair.draft is None:
        raise ConfigError("this method needs a draft model: load the pair with a draft, or use --draft ngram")
    else:
        drafter = ModelDrafter(pair.draft, config.draft_stop)
    if not config.lookup_first:
        return drafter
    return LookupFirstDrafter(drafter, config.ngram_max, config.lookup_min, guide_at=config.lookup_guide)


_EAGLE3_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {source: head}


def _eagle3_drafter(pair: ModelPair, source: str | None, stop_below: float | None = None) -> Drafter:
    """An EAGLE-3 drafter for ``pair.target``; heads are loaded once per (source, target)."""
    from .drafters.eagle3 import Eagle3Drafter, committed_head, drafting_dtype, load_head

    if source is None:
        source = committed_head(pair.name)
        if source is None:
            raise ConfigError(f"no committed EAGLE-3 head for {pair.name!r}: pass --draft-head DIR_OR_HUB_ID "
                              "(e.g. a SpecForge / speculators / EAGLE-3 head for this target)")
    heads = _EAGLE3_HEADS.setdefault(pair.target, {})
    if str(source) not in heads:
        heads[str(source)] = load_head(source, pair.target, dtype=drafting_dtype(pair.target))
    return Eagle3Drafter(heads[str(source)], pair.target, stop_below)


WARM_UP_PROMPT_TOKENS = 64  # prompt tail a warm-up generation decodes after (Decoder.warm_up)


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
        if self.sampling.greedy:
            pair.target.prepare()  # the screened head, built here rather than in the first timed step

    def warm_up(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 8,
                prompt_tokens: int | None = WARM_UP_PROMPT_TOKENS) -> None:
        """One short generation, discarded, so that first-call costs (lazy buffers, allocator, kernel
        choice) fall outside the timed generations that follow. It decodes after the last
        ``prompt_tokens`` tokens of ``prompt`` (``None``: all of it): the decode steps are the timed
        ones' shapes, and a long few-shot prompt's prefill (seconds for GSM8K's 1358-token 8-shot prompt
        on the embedded pair, 2 cores; the int8 draft's as much again) is not paid once more per method."""
        ids = self.token_ids(prompt)
        self.generate(ids if prompt_tokens is None else ids[-prompt_tokens:], max_new_tokens=max_new_tokens)

    def token_ids(self, prompt: str | Sequence[int] | torch.Tensor) -> Sequence[int] | torch.Tensor:
        """``prompt`` as token ids: text is encoded, ids are passed through."""
        return self.pair.encode(prompt) if isinstance(prompt, str) else prompt

    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 64, seed: int = 0,
                 stop: Sequence[str] = (), prefix: Sequence[int] | None = None) -> GenerationResult:
        """Decode after ``prompt`` (text or token ids); ``stop`` strings end generation after the step
        that produced them (the caller cuts the text). ``prefix``: token ids that this prompt and others
        start with (a task's few-shot exemplars), prefilled once for the target and for a draft model
        (:meth:`prompt_prefix`) and copied into each prompt's caches (:mod:`~dropmatch.prompt_cache`); the
        prompt's positions past them are prefilled as usual."""
        model_drafter = _model_drafter(self.drafter)
        own = model_drafter.prefix if model_drafter is not None else None
        if prefix and model_drafter is not None:  # for this call only
            model_drafter.prefix = shared_prompt_prefix(model_drafter.model, prefix)
        try:
            return generate(self.pair.target, self.token_ids(prompt), drafter=self.drafter, rule=self.rule,
                            draft_len=self.config.draft_len, max_new_tokens=max_new_tokens,
                            sampling=self.sampling, seed=seed, eos_token_ids=self.pair.eos_token_ids,
                            should_stop=StopOnText(self.pair.decode, stop) if stop else None,
                            prefix=self.prompt_prefix(prefix) if prefix else None)
        finally:
            if model_drafter is not None:
                model_drafter.prefix = own

    def prompt_prefix(self, prefix: Sequence[int]) -> PromptPrefix:
        """The target's :class:`~dropmatch.prompt_cache.PromptPrefix` of ``prefix`` (token ids) that
        :meth:`generate` decodes from, with the feature layers an EAGLE-3 drafter reads
        (:func:`shared_prompt_prefix`)."""
        layers = self.drafter.feature_layers if isinstance(self.drafter, FeatureDrafter) else ()
        return shared_prompt_prefix(self.pair.target, prefix, layers)


_PROMPT_PREFIXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {layers: prefix}


def shared_prompt_prefix(model: CausalLM, prefix: Sequence[int], layers: Sequence[int] = ()) -> PromptPrefix:
    """``model.cache_prefix(prefix, layers)``, computed once and shared by every :class:`Decoder` on ``model``
    (the runs of a task's methods and their greedy reference prefill its few-shot exemplars once, not once
    each); a model keeps the latest prefix of each set of feature layers."""
    ids, layers = tuple(int(i) for i in prefix), tuple(layers)
    kept = _PROMPT_PREFIXES.setdefault(model, {})
    if layers not in kept or tuple(kept[layers].ids.tolist()) != ids:
        kept[layers] = model.cache_prefix(ids, layers)
    return kept[layers]


def _model_drafter(drafter: Drafter | None) -> ModelDrafter | None:
    """The draft model's drafter in ``drafter`` (itself, or the one lookup first falls back on), if any."""
    inner = drafter.drafter if isinstance(drafter, LookupFirstDrafter) else drafter
    return inner if isinstance(inner, ModelDrafter) else None
