"""An EAGLE-3 draft head (Li et al., 2025) and the drafter that runs it behind the engine's protocol.

The head sees the target's own hidden states. At the root of a draft, ``fc`` (bias-free, 3 d_t -> d)
fuses the inputs to three target layers (low, middle, high: by default 2, L // 2 and L - 3, i.e.
``hidden_states[i]`` of a Hugging Face trunk run with ``output_hidden_states=True``). One decoder
layer then takes, per row, the normed embedding of the token concatenated with the normed feature
(so q/k/v see 2 d), a final norm and an LM head over a reduced draft vocabulary give the next token.
Deeper draft steps feed the layer's own output state (d wide: ``fc`` is skipped) instead of target
features. ``d2t`` (draft id -> target id offsets) and ``t2d`` (target-vocabulary mask) map the draft
vocabulary into the target's.

Row convention (inference and training alike): row p pairs the target feature of position p with the
token at position p + 1, sits at rotary position p, and predicts the token at position p + 2.

Checkpoints are laid out as the public EAGLE-3 heads (``config.json`` with ``draft_vocab_size``, weights
``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``); the SpecForge /
``speculators`` spellings (``layers.0.*``, a ``model.`` prefix, ``transformer_layer_config``) load too.
A head trained here may leave ``lm_head.weight`` out (``"tie_lm_head_to_target": true``): its rows are
then the target's output-embedding rows of the draft vocabulary, rebuilt at load time.

Which target layers a config names depends on who wrote it (:meth:`Eagle3Config.from_dict`): EAGLE's
reference code hard-codes the inputs to layers 2, L // 2 and L - 3 and writes no ids; ``speculators``
and vLLM write those indices as they are (top-level ``eagle_aux_hidden_state_layer_ids``); SpecForge
and SGLang write the *outputs* of layers 1, L // 2 - 1 and L - 4 under ``eagle_config`` (the same
states: SGLang adds one when it captures them). Read without that shift, a SpecForge head would get
every feature one layer early: lower acceptance, silently.

A checkpoint's own ``embed_tokens.weight`` is used where it differs from the target's input embedding
(as vLLM does; SGLang always takes the target's), and must be where the head is narrower or wider than
the target (EAGLE-3's 70B heads); one equal to the target's is dropped and the target's is shared.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ModelNotFoundError
from ..kv_cache import KVBuffer
from ..models import CausalLM
from ..onednn_linear import bf16_matmul_supported, pack_linears
from ..sampling import SamplingConfig, sample_with_uniform
from .base import Draft, check_stop_below, draft_confidence

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_NAME = "model.safetensors"


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers: the inputs to layers 2, L // 2 and L - 3."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


def feature_layer_ids(raw: dict) -> tuple[int, ...]:
    """The target layers a head's ``config.json`` names, as ``hidden_states`` indices (the input to layer
    i; empty: EAGLE-3's default). In order: our ``feature_layers``; the top-level
    ``eagle_aux_hidden_state_layer_ids`` of ``speculators`` and vLLM, the same indices; SpecForge's /
    SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids``, which name layer *outputs* (SpecForge's
    default [1, L // 2 - 1, L - 4] is EAGLE-3's [2, L // 2, L - 3]), so one is added. vLLM reads the
    top-level key first too."""
    eagle = raw.get("eagle_config") or {}
    for ids, shift in ((raw.get("feature_layers"), 0), (raw.get("eagle_aux_hidden_state_layer_ids"), 0),
                       (eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None, 1)):
        if ids:
            if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in ids):
                raise ConfigError(f"EAGLE-3 layer ids must be a list of integers, got {ids!r}")
            return tuple(i + shift for i in ids)
    return ()


@dataclass
class Eagle3Config:
    """Shape of an EAGLE-3 head. ``vocab_size`` is the target's; ``feature_layers`` index the
    trunk's ``hidden_states`` (empty: EAGLE-3's default for the target's depth).

    The variants ``speculators`` trains (each off in EAGLE's and SpecForge's heads): ``norm_before_residual``
    (the layer's residual is the normed input state), ``norm_before_fc`` (one RMSNorm over the three
    concatenated features before ``fc``; weight ``input_norm``), ``fc_norm`` (one RMSNorm per feature;
    ``fc_norm.0-2``), ``norm_output`` (the final norm's output is both the LM head's input and the state
    fed to the next draft step, where EAGLE feeds the pre-norm state) and ``sliding_window`` (each row
    attends to the rows of the last ``sliding_window`` positions only).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    head_dim: int | None = None
    target_hidden_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    sliding_window: int | None = None
    feature_layers: tuple[int, ...] = ()
    tie_lm_head_to_target: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        self.feature_layers = tuple(int(i) for i in self.feature_layers)
        if self.feature_layers and len(self.feature_layers) != 3:
            raise ConfigError(f"an EAGLE-3 head fuses 3 target layers, got {list(self.feature_layers)}")
        if self.norm_before_fc and self.fc_norm:
            raise ConfigError("an EAGLE-3 head normalizes its features either together (norm_before_fc) or one by "
                              "one (fc_norm), not both")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or int(self.sliding_window) < 1):
            raise ConfigError(f"sliding_window must be a positive number of positions, got {self.sliding_window!r}")

    @classmethod
    def from_dict(cls, raw: dict) -> Eagle3Config:
        """From a public ``config.json`` (EAGLE-3, SpecForge or ``speculators`` spelling)."""
        raw = {**raw.get("transformer_layer_config", {}), **raw}
        rope = raw.get("rope_parameters") or {}
        if isinstance(rope, dict):  # transformers >= 5 spelling: theta and scaling in one dict
            if "rope_theta" not in raw and "rope_theta" in rope:
                raw["rope_theta"] = rope["rope_theta"]
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            if not raw.get("rope_scaling") and scaling.get("rope_type", scaling.get("type", "default")) != "default":
                raw["rope_scaling"] = scaling
        layers = feature_layer_ids(raw)
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        raw.setdefault("norm_before_fc", eagle.get("norm_before_fc"))  # NVIDIA's heads keep it there
        if "norm_before_residual" not in raw and "speculators_model_type" in raw:
            raw["norm_before_residual"] = True  # what vLLM assumes of a speculators config without the key
        types = raw.get("layer_types") or ()
        if not (types and types[0] == "sliding_attention"):  # speculators trains windowed drafts by default
            raw["sliding_window"] = None
        known = {f for f in cls.__dataclass_fields__ if f not in ("feature_layers", "extra")}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
                   if k not in raw]
        if missing:
            raise ConfigError(f"EAGLE-3 config lacks {', '.join(missing)}")
        kwargs = {k: raw[k] for k in known if raw.get(k) is not None}
        kwargs.setdefault("num_key_value_heads", raw["num_attention_heads"])
        kwargs.setdefault("draft_vocab_size", raw["vocab_size"])
        return cls(**kwargs, feature_layers=tuple(layers))

    def to_dict(self) -> dict:
        """The public layout: ``architectures``, ``draft_vocab_size``, the layer ids in each reader's
        convention (ours and vLLM's as they are, SGLang's ``eagle_config`` as layer outputs)..."""
        out = {k: v for k, v in asdict(self).items() if k not in ("feature_layers", "extra")}
        if self.feature_layers:
            out["feature_layers"] = out["eagle_aux_hidden_state_layer_ids"] = list(self.feature_layers)
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.feature_layers]}
        if self.sliding_window is not None:  # transformers' spelling, which from_dict reads
            out["layer_types"] = ["sliding_attention"]
        return {"architectures": [ARCHITECTURE], "model_type": "llama", **out, **self.extra}

    def llama_config(self):
        """A ``LlamaConfig`` of the same shape, for transformers' rotary embedding."""
        from transformers import LlamaConfig

        scaling = dict(self.rope_scaling or {})
        if "type" in scaling:  # the older spelling (EAGLE's own configs): {"type": "linear", "factor": 4}
            scaling.setdefault("rope_type", scaling.pop("type"))
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, **scaling}
        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           max_position_embeddings=self.max_position_embeddings, rope_parameters=rope)


class RMSNorm(nn.Module):
    """Llama's RMSNorm: x / rms(x) * weight, computed in float32."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(self.weight.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, H, T, hd) with cos/sin (B, T, hd)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


# An attention strategy: (q (B, H, T, hd), k, v (B, Hkv, T, hd)) -> context (B, H, T, hd).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        c, hd = config, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x (B, T, 2d) -> (B, T, d); ``attend`` decides which keys each query sees."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        ctx = attend(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
        return self.o_proj(ctx.transpose(1, 2).reshape(b, t, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's ``midlayer``: attention over [normed embedding, normed feature] (2d), then an MLP."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        """embeds, hidden (B, T, d) -> output state (B, T, d) (before the final norm)."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """``fc`` + ``midlayer`` + ``norm`` + ``lm_head`` over the draft vocabulary, with ``d2t``/``t2d``.

    The token embedding is the target's (callers pass its embeddings), unless the checkpoint brings its
    own (:attr:`embed_tokens`, set by :func:`load_head`).
    """

    def __init__(self, config: Eagle3Config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        d_t = config.target_hidden_size
        self.input_norm = RMSNorm(3 * d_t, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(d_t, config.rms_norm_eps) for _ in range(3)) if config.fc_norm else None
        self.fc = nn.Linear(3 * d_t, config.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.rotary = LlamaRotaryEmbedding(config=config.llama_config())
        self.embed_tokens: nn.Embedding | None = None  # the checkpoint's own, where it differs from the target's

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of every draft id, (N,) int64."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Draft vocabulary = ``target_ids`` (N,), sorted ascending (as EAGLE-3's ``scandata``)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values.to(self.d2t.device)
        if ids.numel() != self.config.draft_vocab_size:
            raise ConfigError(f"need {self.config.draft_vocab_size} draft ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def rope(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, T, hd) for integer positions (B, T)."""
        return self.rotary(like, positions)

    def state(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              attend: Attend) -> torch.Tensor:
        """Output states (B, T, d) from token embeddings (B, T, d) and features (B, T, 3 d_t) at the
        root or the head's own states (B, T, d) deeper; ``positions`` (B, T) are rotary positions. The
        states are what the next draft step takes: pre-norm, or normed with ``norm_output``."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fuse(hidden.to(self.fc.weight.dtype))
        embeds = embeds.to(hidden.dtype)
        cos, sin = self.rope(positions, hidden)
        out = self.midlayer(embeds, hidden, cos.to(hidden.dtype), sin.to(hidden.dtype), attend)
        return self.norm(out) if self.config.norm_output else out

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``fc`` over the three target features (..., 3 d_t) -> (..., d), after their norms if any."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norm is not None:
            features = torch.cat([norm(f) for norm, f in zip(self.fc_norm, features.chunk(3, dim=-1), strict=True)], -1)
        return self.fc(features)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (..., N) float32 from output states (..., d) (already normed with
        ``norm_output``)."""
        return self.lm_head(state if self.config.norm_output else self.norm(state)).float()


# ------------------------------------------------------------------------------------------
# Checkpoints


def _normalize_name(name: str) -> str | None:
    """Public / SpecForge / speculators weight names -> this module's; ``None``: not ours."""
    for prefix in ("model.", "eagle."):
        if name.startswith(prefix) and not name.startswith("model.safetensors"):
            name = name[len(prefix):]
    name = name.replace("layers.0.", "midlayer.")
    if name.startswith("rotary") or "rotary_emb" in name:
        return None
    return name


def save_head(head: Eagle3Head, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16,
              manifest: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ ``manifest.json``) in the public layout.
    A head with ``tie_lm_head_to_target`` leaves ``lm_head.weight`` out."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, value in head.state_dict().items():
        if name.startswith("rotary") or (name == "lm_head.weight" and head.config.tie_lm_head_to_target):
            continue
        state[name] = value.detach().to(dtype if value.is_floating_point() else value.dtype).contiguous()
    save_file(state, out / WEIGHTS_NAME, metadata={"format": "pt"})
    config = head.config.to_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if manifest is not None:
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return out


class _HubSnapshot:
    """``from_pretrained``-shaped access to a hub repository's files (for ``models._from_pretrained``)."""

    @staticmethod
    def from_pretrained(name: str, local_files_only: bool = False) -> Path:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=local_files_only,
                                      allow_patterns=["*.json", *WEIGHT_FILES]))


def resolve_head_dir(source: str | Path) -> Path:
    """A local directory as is; a hub id through the project's clear-error loader."""
    from ..models import _from_pretrained

    local = Path(source).expanduser()
    directory = local if local.is_dir() else _from_pretrained(_HubSnapshot, str(source))
    if not (directory / "config.json").exists():
        raise ModelNotFoundError(f"cannot load the EAGLE-3 head {str(source)!r}: {directory} has no config.json")
    return directory


WEIGHT_FILES = ("model*.safetensors", "pytorch_model*.bin")  # the weights (maybe sharded), not training_args.bin etc.


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The head's tensors from its ``model*.safetensors`` shards, else its ``pytorch_model*.bin`` ones
    (other files, e.g. a Trainer's ``training_args.bin`` or an optimizer state, are not weights)."""
    for pattern in WEIGHT_FILES:
        files = sorted(directory.glob(pattern))
        if files:
            break
    else:
        raise ModelNotFoundError(f"no {' or '.join(WEIGHT_FILES)} weights in {directory}")
    weights = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                weights.update(load_file(file))
            else:
                weights.update(torch.load(file, map_location="cpu", weights_only=True))
        except Exception as err:  # a truncated or foreign file: name it instead of a loader traceback
            raise ConfigError(f"cannot read EAGLE-3 weights {file}: {type(err).__name__}: {err}") from None
    return weights


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same values, compared in either's dtype (a bfloat16 checkpoint of a
    float32 target's embedding, or the reverse)."""
    if a.shape != b.shape or b.device.type == "meta":
        return False
    a = a.to(b.device)
    return torch.equal(a, b.to(a.dtype)) or torch.equal(a.to(b.dtype), b)


def drafting_dtype(target: CausalLM) -> torch.dtype:
    """The dtype a head drafts for ``target`` in: bfloat16 for a float32 target on a CPU with native
    bfloat16 GEMMs (AMX / AVX512-BF16), else the target's. A draft need not be exact (verification is,
    and takes the draft's distributions as computed), and its one-row GEMMs read its weights: bfloat16
    halves that (a 5-token proposal of the embedded pair's head ~20 % faster on a 2-core AMX Xeon)."""
    dtype = target.head_weight.dtype
    if dtype == torch.float32 and target.device.type == "cpu" and bf16_matmul_supported():
        return torch.bfloat16
    return dtype


def load_head(source: str | Path, target: CausalLM | None = None, *, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None) -> Eagle3Head:
    """An EAGLE-3 head from a local directory or hub id (public, SpecForge, ``speculators`` or ours).

    ``target`` supplies the tied LM-head rows of heads saved without ``lm_head.weight`` and checks
    that the head fits it (vocabulary and hidden size); a checkpoint's ``embed_tokens`` equal to the
    target's is then dropped (without a target it is kept). ``dtype`` defaults to the target's; drafting
    callers pass :func:`drafting_dtype`.
    """
    directory = resolve_head_dir(source)
    try:
        raw = json.loads((directory / "config.json").read_text())
    except ValueError as err:
        raise ConfigError(f"EAGLE-3 head {source}: config.json is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"EAGLE-3 head {source}: config.json holds a {type(raw).__name__}, not an object")
    config = Eagle3Config.from_dict(raw)
    weights = {}
    for name, value in _read_weights(directory).items():
        key = _normalize_name(name)
        if key is not None:
            weights[key] = value
    if "d2t" not in weights:  # speculators leaves the maps out of full-vocabulary heads
        if config.draft_vocab_size != config.vocab_size:
            raise ConfigError(f"{source}: draft vocabulary {config.draft_vocab_size} != {config.vocab_size} but no d2t")
        weights["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    if "t2d" not in weights:  # unused at inference; rebuilt from d2t
        ids = torch.arange(weights["d2t"].numel()) + weights["d2t"].long()
        weights["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        weights["t2d"][ids[(ids >= 0) & (ids < config.vocab_size)]] = True
    head = Eagle3Head(config)
    own_embed = weights.pop("embed_tokens.weight", None)
    if target is not None:
        d_t = int(target.head_weight.shape[1])
        if d_t != config.target_hidden_size:
            raise ConfigError(f"EAGLE-3 head {source} expects target hidden size {config.target_hidden_size}, "
                              f"the target has {d_t}")
        target_embed = target.model.get_input_embeddings().weight
        if own_embed is not None and _same_tensor(own_embed, target_embed):
            own_embed = None  # speculators and SpecForge save the target's own: share it
        if own_embed is None and int(target_embed.shape[1]) != config.hidden_size:
            raise ConfigError(f"EAGLE-3 head {source} has hidden size {config.hidden_size} and no embed_tokens of its "
                              f"own; the target's token embeddings are {int(target_embed.shape[1])} wide")
        if own_embed is not None and tuple(own_embed.shape) == tuple(target_embed.shape):
            warnings.warn(f"EAGLE-3 head {source} brings its own embed_tokens, which differ from the target's: "
                          "the head embeds its tokens with them (as vLLM does; SGLang would take the target's)",
                          stacklevel=2)
        if config.vocab_size != target.vocab_size:
            raise ConfigError(f"EAGLE-3 head {source} drafts over a vocabulary of {config.vocab_size} tokens, "
                              f"the target has {target.vocab_size}: it was trained for another target")
    if own_embed is not None:
        if tuple(own_embed.shape) != (config.vocab_size, config.hidden_size):
            raise ConfigError(f"EAGLE-3 head {source}: embed_tokens.weight is {tuple(own_embed.shape)}, its config.json "
                              f"says ({config.vocab_size}, {config.hidden_size})")
        head.embed_tokens = nn.Embedding.from_pretrained(own_embed, freeze=True)  # head.to(dtype) below
    if "lm_head.weight" not in weights:
        if target is None or not config.tie_lm_head_to_target:
            raise ConfigError(f"{source}: no lm_head.weight (and no target to tie it to)")
        ids = (torch.arange(config.draft_vocab_size) + weights["d2t"].long()).to(target.head_weight.device)
        weights["lm_head.weight"] = target.head_weight[ids].detach().float().cpu()
    weights["t2d"], weights["d2t"] = weights["t2d"].bool(), weights["d2t"].long()  # both present (rebuilt above)
    try:
        missing, unexpected = head.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # shapes that disagree with config.json
        raise ConfigError(f"EAGLE-3 head {source}: weights do not fit its config.json: {err}") from None
    missing = [m for m in missing if not m.startswith(("rotary", "embed_tokens."))]  # both set above
    if missing or unexpected:
        raise ConfigError(f"EAGLE-3 head {source}: missing weights {missing}, unexpected {unexpected}")
    if dtype is None:
        dtype = target.head_weight.dtype if target is not None else torch.float32
    device = torch.device(device) if device is not None else (target.device if target is not None else None)
    frequencies = dict(head.rotary.named_buffers())  # float32, as transformers keeps them: a bfloat16 inv_freq
    head = head.to(dtype=dtype)  # turns rotary angles at position 2000 by up to ~3.6 rad (rope_theta 5e5)
    for name, value in frequencies.items():
        setattr(head.rotary, name, value)
    if device is not None:
        head = head.to(device)
    return head.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------
# Inference: a KV cache and the drafter


class Eagle3Cache:
    """The head's own KV cache: keys/values (1, Hkv, C, hd) written in place into a buffer with spare
    capacity (:class:`~dropmatch.kv_cache.KVBuffer`; a ``torch.cat`` per draft token cost ~2 ms of a
    5-token proposal on the embedded pair), and a length to crop back to. Row i sits at rotary position
    i; with a ``window``, a row attends to the rows of the last ``window`` positions only."""

    def __init__(self, window: int | None = None) -> None:
        self.buffer = KVBuffer()
        self.window = window

    def __len__(self) -> int:
        return self.buffer.length

    @property
    def k(self) -> torch.Tensor | None:
        return None if self.buffer.keys is None else self.buffer.view()[0]

    @property
    def v(self) -> torch.Tensor | None:
        return None if self.buffer.values is None else self.buffer.view()[1]

    def crop(self, length: int) -> None:
        self.buffer.drop(max(len(self) - length, 0))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append k, v; new row i sees every cached row and new rows <= i."""
        past = len(self)
        self.buffer.append(k, v)
        keys, values = self.buffer.view()
        t = q.shape[2]
        mask = None
        if t > 1 or (self.window is not None and past + t > self.window):
            mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(diagonal=past)
            if self.window is not None:  # query past + i sees keys past + i - window + 1 .. past + i
                mask &= ~torch.ones_like(mask).tril(diagonal=past - self.window)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1])


class Eagle3Drafter:
    """Chain drafting with an EAGLE-3 head over the target's features (batch size 1).

    Invariant between steps: the head's cache holds one row per context position whose feature and
    following token are both known; ``_feats`` are the target features of the newest positions, still
    waiting for their following tokens (``_tokens`` plus the next ``last_token``). The deeper rows a
    proposal adds (fed with the head's own states) are cropped away at ``commit``. Within a step,
    :meth:`first_guess` may feed the waiting rows first (``_feats`` is then ``None`` and ``_guess`` holds
    the root) until that step's ``propose`` or ``follow``.

    Distributions are mapped into the target vocabulary: under greedy decoding ``Draft.logits`` are
    the draft logits at the draft ids' target positions and -inf elsewhere (so rules that take a
    softmax, e.g. DropMatch's JS, see the draft distribution with zero mass outside the draft
    vocabulary); under sampling ``Draft.probs`` are the tempered / top-p probabilities, zero outside.
    """

    name = "eagle3"

    def __init__(self, head: Eagle3Head, target: CausalLM, stop_below: float | None = None):
        """``stop_below``: end a proposal after a token whose draft probability is below this (a dynamic
        draft length, like the confidence threshold of HF's assisted decoding); ``None``: always the
        ``n`` tokens asked for (the paper's fixed L). The stop depends on the draft alone, so greedy SD
        still equals AR and speculative sampling stays lossless."""
        check_stop_below(stop_below)
        self.head, self.target, self.stop_below = head, target, stop_below
        num_layers = int(getattr(target.model.config, "num_hidden_layers", 0)) or len(target.trunk.layers)
        self.feature_layers: tuple[int, ...] = head.config.feature_layers or default_feature_layers(num_layers)
        if not all(0 <= i <= num_layers for i in self.feature_layers):  # L: the final (normed) state, as in HF
            raise ConfigError(f"EAGLE-3 head wants target hidden states {list(self.feature_layers)}; the target has "
                              f"0..{num_layers} (the input to each of its {num_layers} layers, then its output)")
        own = head.embed_tokens is not None
        self.embed = head.embed_tokens if own else target.model.get_input_embeddings()
        self._embed_device = head.d2t.device if own else target.input_device
        self.vocab = target.vocab_size
        ids = head.draft_to_target
        # draft ids past a padded target vocabulary never get drafted: positions (N',) of the others
        self._keep = (ids < self.vocab).nonzero().squeeze(-1)
        self._ids = ids[self._keep]
        self.cache = Eagle3Cache(head.config.sliding_window)
        # CPU heads: one-row GEMMs through oneDNN (float32: 22 -> 14 ms a 5-token proposal), reordered
        # again if the head's weights change (training takes torch's own path: autograd is on)
        pack_linears(head)
        self._feats: torch.Tensor | None = None
        self._tokens: list[int] = []
        self._proposed: list[int] = []
        self._following = False  # the last step's proposal came from another drafter (``follow``)
        self._rows = 0
        self._guess: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (last token, root state, logits)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor | None = None) -> None:
        """``features`` (n, 3 d_t): the target's chosen-layer states at the prompt positions."""
        if features is None:
            raise ConfigError("the EAGLE-3 drafter needs the target's features (use dropmatch.engine.generate)")
        self.cache = Eagle3Cache(self.head.config.sliding_window)
        self._feats, self._tokens = features, prompt_ids.view(-1)[1:].tolist()
        self._proposed, self._following, self._rows, self._guess = [], False, 0, None

    def _forward(self, tokens: list[int], hidden: torch.Tensor, start: int) -> torch.Tensor:
        """Feed rows at positions start.. into the cache; return the last row's state (1, 1, d)."""
        device = self.head.d2t.device
        ids = torch.tensor(tokens, dtype=torch.long, device=self._embed_device).view(1, -1)
        positions = torch.arange(start, start + ids.shape[1], device=device).view(1, -1)
        embeds = self.embed(ids).to(device)  # the embedding may sit on another GPU (device_map)
        state = self.head.state(embeds, hidden.view(1, ids.shape[1], -1).to(device), positions, self.cache.attend)
        return state[:, -1:]

    def _draft_logits(self, state: torch.Tensor) -> torch.Tensor:
        """Logits (N',) of the draft ids inside the target vocabulary (``self._ids``), from an output
        state (1, 1, d)."""
        return self.head.logits(state[0, 0]).index_select(0, self._keep)

    def _in_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits (n, N') placed at their target ids (n, V), -inf elsewhere."""
        rows = draft_logits.new_full((draft_logits.shape[0], self.vocab), float("-inf"))
        rows[:, self._ids] = draft_logits
        return rows

    def _choose(self, draft_logits: torch.Tensor, depth: int, sampling: SamplingConfig,
                generator: torch.Generator) -> tuple[int, torch.Tensor]:
        """The token at draft step ``depth`` (0 = the root) and what the draft keeps of its distribution:
        under greedy decoding the argmax over the draft ids (ascending target ids, so ties break as over
        the full row) and the draft logits (N',); under sampling a sample and its probabilities (V,)."""
        if sampling.greedy:
            return int(self._ids[draft_logits.argmax()]), draft_logits
        probs = sampling.probs(self._in_target_vocab(draft_logits[None])[0])
        return int(sample_with_uniform(probs, torch.rand((), generator=generator))), probs

    def _root(self, last_token: int) -> torch.Tensor:
        """Feed the waiting rows, the last one with ``last_token``; the root's output state (1, 1, d)."""
        tokens = self._tokens + [last_token]
        assert self._feats is not None and self._feats.shape[0] == len(tokens), "start/commit out of step"
        state = self._forward(tokens, self._feats, self._rows)
        self._rows += len(tokens)
        self._feats, self._tokens = None, []
        return state

    def first_guess(self, last_token: int) -> tuple[int, float]:
        """The head's greedy first draft token after ``last_token`` and its untempered softmax probability
        (whatever the sampling), computed as the start of this step (the root's rows are fed once):
        ``propose`` continues from it (a sampled first token comes from the same logits), or ``follow``
        takes another drafter's tokens instead."""
        state = self._root(last_token)
        logits = self._draft_logits(state)
        self._guess = (last_token, state, logits)
        token = int(self._ids[logits.argmax()])
        return token, draft_confidence(logits, token, SamplingConfig())

    def propose(self, last_token: int, n: int, sampling: SamplingConfig, generator: torch.Generator) -> Draft:
        guess, self._guess = self._guess, None
        if guess is not None:
            assert guess[0] == last_token, "first_guess and propose for different tokens"
            state, first_logits = guess[1], guess[2]
        else:
            state = self._root(last_token)
            first_logits = self._draft_logits(state) if n > 0 else None
        proposed: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(max(n, 0)):
            if i:
                state = self._forward([proposed[-1]], state, self._rows + i - 1)
            draft_logits = self._draft_logits(state) if i else first_logits
            token, row = self._choose(draft_logits, i, sampling, generator)
            rows.append(row)
            proposed.append(token)
            if self.stop_below is not None and draft_confidence(row, token, sampling) < self.stop_below:
                break
        self._proposed = proposed
        device = self.target.device
        if not proposed:
            return Draft(torch.empty(0, dtype=torch.long, device=device))
        ids = torch.tensor(proposed, dtype=torch.long, device=device)
        if sampling.greedy:
            return Draft(ids, logits=self._in_target_vocab(torch.stack(rows)).to(device))
        return Draft(ids, probs=torch.stack(rows).to(device))

    def follow(self, last_token: int, tokens: list[int]) -> None:
        """Another drafter proposes ``tokens`` this step. The head runs nothing: the rows waiting for
        ``last_token`` get it, and ``commit`` queues the kept tokens' rows behind them, so the next
        ``propose`` feeds them all in one forward. After a :meth:`first_guess` those rows are already fed,
        and ``commit`` goes on as after ``propose``."""
        guess, self._guess = self._guess, None
        if guess is not None:
            assert guess[0] == last_token, "first_guess and follow for different tokens"
            self._proposed = list(tokens)
            return
        assert self._feats is not None and self._feats.shape[0] == len(self._tokens) + 1, "start/commit out of step"
        self._tokens.append(last_token)
        self._proposed, self._following = list(tokens), True

    def commit(self, n_accepted: int, features: torch.Tensor | None = None) -> None:
        """``features`` (n_accepted + 1, 3 d_t): target states at the verified newest token and the
        accepted draft tokens, in order."""
        if features is None:
            raise ConfigError("the EAGLE-3 drafter needs the target's features at commit")
        kept = self._proposed[:n_accepted]
        if self._following:  # nothing was fed this step: the new rows queue behind the waiting ones
            self._feats, self._tokens = torch.cat([self._feats, features]), self._tokens + kept
        else:  # drop the rows fed with the head's own states; the kept tokens' rows wait for the next token
            self.cache.crop(self._rows)
            self._feats, self._tokens = features, kept
        self._proposed, self._following = [], False


ASSETS = Path(__file__).resolve().parent.parent / "assets"


def committed_head(pair_name: str) -> Path | None:
    """The head shipped for a named pair (``dropmatch/assets/eagle3-<pair>``), if there is one."""
    path = ASSETS / f"eagle3-{pair_name}"
    return path if (path / "config.json").exists() else None


def eagle3_drafter(source: str | Path, target: CausalLM, dtype: torch.dtype | None = None) -> Eagle3Drafter:
    """Load a head (directory or hub id) in ``dtype`` (default :func:`drafting_dtype`) and wrap it for
    ``target``."""
    return Eagle3Drafter(load_head(source, target, dtype=dtype or drafting_dtype(target)), target)


def init_head(config: Eagle3Config, target: CausalLM, vocabulary: Sequence[int] | torch.Tensor,
              seed: int = 0) -> Eagle3Head:
    """A fresh head for training: random ``midlayer`` (with zero output projections), ``fc`` passing the
    high feature through, ``norm`` = the target's final norm and the LM head = the target's rows of
    ``vocabulary`` (frozen). At initialisation the head is therefore the "logit lens" of the high layer."""
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    head.set_vocabulary(torch.as_tensor(list(vocabulary) if not torch.is_tensor(vocabulary) else vocabulary))
    d, d_t = config.hidden_size, config.target_hidden_size
    with torch.no_grad():
        for lin in (head.midlayer.self_attn.q_proj, head.midlayer.self_attn.k_proj,
                    head.midlayer.self_attn.v_proj, head.midlayer.mlp.gate_proj, head.midlayer.mlp.up_proj):
            nn.init.normal_(lin.weight, std=1 / math.sqrt(lin.in_features))
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.fc.weight.zero_()
        if d == d_t:
            head.fc.weight[:, 2 * d_t:] = torch.eye(d)
        else:
            nn.init.normal_(head.fc.weight, std=1 / math.sqrt(3 * d_t))
        final_norm = getattr(target.trunk, "norm", None)
        if final_norm is not None and d == d_t:
            ones = torch.ones(1, d_t, dtype=target.head_weight.dtype, device=target.device)
            head.norm.weight.copy_(final_norm(ones)[0].float().cpu())
        head.lm_head.weight.copy_(target.head_weight[head.draft_to_target.to(target.device)].float().cpu())
    head.lm_head.weight.requires_grad_(False)
    return head
