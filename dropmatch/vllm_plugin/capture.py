"""Model-runner patches: hand the LM-head input of the verify positions to DropMatch.

vLLM 0.32 has two runner generations. The V1 runner (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``,
which the CPU runner ``vllm.v1.worker.cpu_model_runner.CPUModelRunner`` subclasses) keeps
``sample_hidden_states`` (the rows ``compute_logits`` was applied to) in ``execute_model_state``
until ``sample_tokens``; the patch opens a :class:`~.sampler.VerifyContext` around that call. The V2
runner (``vllm.v1.worker.gpu.model_runner``) has its own rejection sampler and is not patched:
with DropMatch configured the plugin selects V1 (``VllmConfig.use_v2_model_runner``), and an
explicit ``VLLM_USE_V2_MODEL_RUNNER=1`` is refused in ``guards.py``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from .config import DropMatchVllmConfig, from_additional_config
from .patch import wrap_once
from .sampler import DropMatchState, VerifyContext, close_step, open_step, wrap_rejection_sample

log = logging.getLogger("vllm.dropmatch")  # a child of vLLM's configured logger
_MARK = "__dropmatch_wrapped__"


def _wrap(owner: Any, name: str, make) -> None:
    """Replace ``owner.name`` by ``make(original)`` once (re-entrant)."""
    wrap_once(owner, name, make, _MARK)


def _runner_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        config = from_additional_config(getattr(vllm_config, "additional_config", None))
        self._dropmatch = DropMatchState(config) if config is not None else None
        if config is not None:
            log.info("DropMatch on: K=%d p_drop=%.3g criterion=%s seed=%d", config.k, config.p_drop,
                     config.criterion, config.seed)
    return __init__


def verify_context(runner: Any) -> VerifyContext | None:
    """The context of the step waiting in ``runner.execute_model_state``, or ``None`` (no drafts)."""
    state = getattr(runner, "_dropmatch", None)
    step = getattr(runner, "execute_model_state", None)
    if state is None or step is None or step.spec_decode_metadata is None or not state.config.enabled:
        return None
    batch = runner.input_batch
    req_ids = list(batch.req_ids)
    requests = runner.requests
    return VerifyContext(
        state=state,
        compute_logits=runner.model.compute_logits,
        sample_hidden_states=step.sample_hidden_states,
        target_logits_indices=step.spec_decode_metadata.target_logits_indices,
        req_ids=req_ids,
        prompt_token_ids=[getattr(requests.get(r), "prompt_token_ids", None) for r in req_ids],
        first_positions=[int(n) for n in batch.num_tokens_no_spec[:len(req_ids)]],
    )


def _sample_tokens(original):
    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        ctx = verify_context(self)
        if ctx is None:
            return original(self, *args, **kwargs)
        token = open_step(ctx)
        try:
            return original(self, *args, **kwargs)
        finally:
            close_step(token)
    return sample_tokens


def _use_v2_model_runner(original: property) -> property:
    @functools.wraps(original.fget)
    def use_v2_model_runner(self) -> bool:
        if from_additional_config(getattr(self, "additional_config", None)) is not None:
            return False  # DropMatch patches the V1 runner; guards.py refuses an explicit V2 request
        return original.fget(self)
    return property(use_v2_model_runner)


def _runner_state(worker: Any) -> DropMatchState | None:
    return getattr(getattr(worker, "model_runner", None), "_dropmatch", None)


def dropmatch_stats(worker: Any, reset: bool = False) -> dict[str, Any] | None:
    """Worker RPC: this rank's counters (``None`` when DropMatch is not configured)."""
    state = _runner_state(worker)
    if state is None:
        return None
    stats = state.stats.as_dict()
    if reset:
        state.reset_stats()
    return stats


def dropmatch_set(worker: Any, **changes: Any) -> dict[str, Any] | None:
    """Worker RPC: change the settings at run time (k, p_drop, criterion, majority, seed, enabled)."""
    state = _runner_state(worker)
    if state is None:
        return None
    state.config = state.config.updated(**changes)
    return {name: getattr(state.config, name) for name in DropMatchVllmConfig.__dataclass_fields__}


def install_runner_patches() -> None:
    """Patch the V1 runner, the rejection-sample core, the runner selection and the worker RPCs."""
    from vllm.config import VllmConfig
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker import gpu_model_runner, worker_base

    runner_cls = gpu_model_runner.GPUModelRunner
    _wrap(runner_cls, "__init__", _runner_init)
    _wrap(runner_cls, "sample_tokens", _sample_tokens)
    _wrap(rejection_sampler, "rejection_sample", wrap_rejection_sample)
    prop = VllmConfig.__dict__["use_v2_model_runner"]
    if not getattr(prop.fget, _MARK, False):
        new = _use_v2_model_runner(prop)
        setattr(new.fget, _MARK, True)
        VllmConfig.use_v2_model_runner = new
    for name, fn in (("dropmatch_stats", dropmatch_stats), ("dropmatch_set", dropmatch_set)):
        if not hasattr(worker_base.WorkerBase, name):
            setattr(worker_base.WorkerBase, name, fn)
