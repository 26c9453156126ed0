"""DropMatch as a vLLM plugin (``vllm.general_plugins`` entry point ``dropmatch``).

Configured per engine with ``additional_config={"dropmatch": {"k": 5, "p_drop": 0.3,
"criterion": "js+majority", "seed": 0}}`` (``vllm serve ... --additional-config '{"dropmatch": {...}}'``);
inert without it. vLLM calls :func:`register` in every process it starts; it imports vLLM lazily,
patches at most once per process, and on an untested vLLM version patches only the front-end guard
that refuses a DropMatch configuration.

Modules: ``config`` (settings), ``guards`` (front-end checks, version), ``capture`` (runner patch:
hidden states of the verify positions), ``sampler`` (vLLM batch -> rule -> output buffer), ``relax``
(pure greedy relaxation), ``heads`` (masks, K heads via ``compute_logits``), ``metrics``, ``bench``.
"""

from __future__ import annotations

import logging

from .config import DropMatchVllmConfig, from_additional_config
from .guards import SUPPORTED_VLLM_VERSIONS, UnsupportedVllmVersion, check_vllm_version

__all__ = ["SUPPORTED_VLLM_VERSIONS", "DropMatchVllmConfig", "UnsupportedVllmVersion", "check_vllm_version",
           "from_additional_config", "register"]

log = logging.getLogger("vllm.dropmatch")  # a child of vLLM's configured logger
_registered = False


def register() -> None:
    """vLLM's plugin hook: install the guards, and on a tested version the runner patches."""
    global _registered
    if _registered:
        return
    import vllm

    from .guards import install_frontend_guards

    install_frontend_guards()
    if vllm.__version__ in SUPPORTED_VLLM_VERSIONS:
        from .capture import install_runner_patches

        install_runner_patches()
    else:
        log.warning("dropmatch plugin: vLLM %s is untested (tested: %s); DropMatch configurations will be refused",
                    vllm.__version__, ", ".join(SUPPORTED_VLLM_VERSIONS))
    _registered = True
