"""Shared fixtures: tiny random pairs (fast) and the embedded Gemma pair (loaded once per session)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from dropmatch import hub
from dropmatch.models import ByteTokenizer, CausalLM, ModelPair, load_pair, tiny_pair


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test``), each worker, and each process it starts (CLI runs, notebook
    kernels), gets its share of the cores: two workers with two intra-op threads each on two cores would
    oversubscribe them and slow every compute-bound test."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def make_tiny(arch: str = "llama", seed: int = 0, draft_noise: float = 0.05, **kw) -> ModelPair:
    target, draft = tiny_pair(arch=arch, seed=seed, draft_noise=draft_noise, **kw)
    return ModelPair(CausalLM(target), CausalLM(draft), ByteTokenizer(), f"tiny-{arch}")


@pytest.fixture(scope="session")
def tiny() -> ModelPair:
    return make_tiny("llama")


@pytest.fixture(scope="session")
def tiny_gemma() -> ModelPair:
    """Gemma-3 architecture with a sliding window of 8 tokens on two of three layers."""
    return make_tiny("gemma3", draft_noise=0.1)


@pytest.fixture(scope="session")
def gemma() -> ModelPair:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return load_pair("gemma-3-270m")


@contextmanager
def screened_heads(target: CausalLM) -> Iterator[CausalLM]:
    """Greedy heads of any row count through the screened bfloat16 head (as on CPUs without oneDNN)."""
    saved = target.fast_head, target.screen_max_rows
    target.fast_head, target.screen_max_rows = True, 1 << 30
    try:
        yield target
    finally:
        target.fast_head, target.screen_max_rows = saved


def random_prompt(seed: int, low: int = 3, high: int = 259, max_len: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, max_len, (1,), generator=g))
    return torch.randint(low, high, (n,), generator=g)


@pytest.fixture
def one_thread():
    """Tiny models and tensors: one intra-op thread is several times faster on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def offline(monkeypatch):
    """No hub: HF_HUB_OFFLINE set and the cached reachability probe cleared around the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub._probe.cache_clear()
    yield
    hub._probe.cache_clear()
