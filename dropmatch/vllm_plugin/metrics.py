"""Acceptance metrics in vLLM's own schema, plus DropMatch's counter read back from the workers.

vLLM 0.32 reports per-request speculative-decoding metrics when the engine runs with
``per_request_spec_decode_metrics="summary"`` (``CompletionOutput.spec_decode_metrics``, the
``metrics.speculative_decoding`` field of a server response): mean acceptance length (bonus token
included), the draft acceptance rate and the histogram of accepted drafts per verify step. Because
DropMatch rewrites the sampler's output buffer, these count its acceptances too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any


def per_position_acceptance(histogram: Sequence[int]) -> list[float]:
    """P(draft position i accepted) per position, from a histogram of accepted drafts per step."""
    steps = sum(histogram)
    if not steps:
        return [0.0] * max(len(histogram) - 1, 0)
    return [sum(histogram[i + 1:]) / steps for i in range(len(histogram) - 1)]


def request_metrics(completion: Any) -> dict[str, Any] | None:
    """vLLM's per-request metrics of a ``CompletionOutput`` plus ``per_position_acceptance``."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        return None
    out = metrics.to_dict()
    out["per_position_acceptance"] = per_position_acceptance(out["acceptance_histogram"])
    return out


def aggregate(metrics: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    """Totals over requests: mean acceptance length (tau, bonus included) and per-position acceptance."""
    histogram: list[int] = []
    steps = accepted = drafted = 0
    for m in metrics:
        if m is None:
            continue
        steps += m["num_spec_steps"]
        accepted += m["num_accepted_draft_tokens"]
        drafted += m["num_draft_tokens"]
        h = m["acceptance_histogram"]
        histogram = [a + b for a, b in zip(histogram or [0] * len(h), h, strict=True)]
    return {"mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "num_spec_steps": steps, "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted,
            "acceptance_histogram": histogram, "per_position_acceptance": per_position_acceptance(histogram)}


def dropmatch_stats(llm: Any, reset: bool = False) -> dict[str, Any] | None:
    """DropMatch's counters of an ``LLM`` (rank 0; every tensor-parallel rank decides identically):
    ``extra_accepted`` (draft tokens accepted beyond exact match), ``positions_tested``,
    ``verify_steps``, ``per_request`` (engine request id -> extra_accepted)."""
    ranks = llm.collective_rpc("dropmatch_stats", kwargs={"reset": reset})
    return ranks[0] if ranks else None


def extra_accepted_for(stats: dict[str, Any], request_id: str) -> int:
    """A request's extra acceptances. vLLM makes the id it is given unique with ``-`` and 8 hex digits
    (``InputProcessor.assign_request_id``; none with ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``), so only
    those ids match: not another request's whose id merely starts with this one (``q-2`` for ``q``)."""
    engine_id = re.compile(rf"{re.escape(request_id)}(-[0-9a-f]{{8}})?")
    return sum(v for k, v in stats.get("per_request", {}).items() if engine_id.fullmatch(k))
