"""Bad configurations are refused with clear errors before an engine starts."""

from __future__ import annotations

import importlib.metadata

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make vllm-test` runs these in .venv-vllm")

from dropmatch.errors import ConfigError  # noqa: E402
from dropmatch.vllm_plugin import UnsupportedVllmVersion, register  # noqa: E402

from .conftest import engine_kwargs  # noqa: E402


def engine_config(model_dir: str, **overrides):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**engine_kwargs(model_dir, **overrides)).create_engine_config()


def test_entry_point_is_declared_and_register_is_reentrant():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert names.get("dropmatch") == "dropmatch.vllm_plugin:register"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    register()  # what vLLM does in each process; a second and third call must change nothing
    before = (EngineArgs.create_engine_config, rejection_sampler.rejection_sample, GPUModelRunner.sample_tokens)
    register()
    register()
    after = (EngineArgs.create_engine_config, rejection_sampler.rejection_sample, GPUModelRunner.sample_tokens)
    assert before == after and all(getattr(f, "__wrapped__", None) for f in after)


@pytest.mark.parametrize(("section", "message"), [
    ({"k": 0}, r"K \(number of dropout heads\) must be an integer >= 1"),
    ({"criterion": "jsd"}, r"unknown DropMatch criterion 'jsd'"),
    ({"p_drop": 1.5}, r"p_drop must be in \[0, 1\)"),
    ({"temperature": 1}, r"unknown dropmatch option\(s\) temperature"),
])
def test_bad_dropmatch_settings_are_refused(model_dir, section, message):
    with pytest.raises(ConfigError, match=message):
        engine_config(model_dir, additional_config={"dropmatch": section})


def test_unsupported_vllm_version_is_refused(model_dir, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    with pytest.raises(UnsupportedVllmVersion, match=r"tested on vLLM 0\.32\.0 only .* found vLLM 0\.31\.9"):
        engine_config(model_dir)


def test_dropmatch_without_speculative_decoding_is_refused(model_dir):
    with pytest.raises(ConfigError, match="needs speculative decoding"):
        engine_config(model_dir, speculative_config=None, per_request_spec_decode_metrics="none")


def test_explicit_v2_runner_is_refused(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ConfigError, match="V1 model runner"):
        engine_config(model_dir)


def test_not_configured_is_inert(model_dir):
    config = engine_config(model_dir, additional_config={})
    assert "dropmatch" not in config.additional_config
