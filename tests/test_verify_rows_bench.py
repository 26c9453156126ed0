"""The verify-rows benchmark's pieces: the step census is transparent and counts what happened, the cost table
prices rows against one row, and the cost model turns both into a speedup."""

from __future__ import annotations

import pytest
import torch

from dropmatch.benchmarks.verify_rows import (
    StepCensus,
    census_table,
    cost_table,
    predicted_speedup,
    verify_cost_by_rows,
)
from dropmatch.drafters import LookupFirstDrafter, ModelDrafter
from dropmatch.engine import generate

from .conftest import make_tiny


@pytest.fixture(scope="module")
def pair():
    return make_tiny("llama", seed=3, vocab_size=64, layers=3)


def test_the_census_changes_nothing_and_records_each_step_as_the_engine_counted_it(pair):
    prompt = torch.tensor([5, 9, 12, 5, 9, 30, 41, 5, 9, 12, 7, 3])
    plain = generate(pair.target, prompt, drafter=LookupFirstDrafter(ModelDrafter(pair.draft), min_match=1),
                     draft_len=4, max_new_tokens=40)
    inner = LookupFirstDrafter(ModelDrafter(pair.draft), min_match=1)
    census = StepCensus(inner)
    counted = generate(pair.target, prompt, drafter=census, draft_len=4, max_new_tokens=40)
    assert counted.token_ids == plain.token_ids
    assert [d for _, d, _ in census.steps] == counted.stats.drafted_per_step
    assert [k for _, _, k in census.steps] == counted.stats.accepted_per_step
    proposers = [p for p, d, _ in census.steps if d]  # the drafter's count leaves out empty proposals (the last step)
    assert proposers.count("n-gram lookup") == inner.lookup_steps > 0
    assert proposers.count(inner.drafter.name) == inner.drafter_steps > 0


def test_census_table_groups_steps_by_proposer():
    steps = [("a", 4, 0), ("b", 2, 2), ("a", 4, 1), ("a", 4, 2)]
    rows = {row["proposer"]: row for row in census_table(steps)}
    assert rows["a"]["steps"] == 3 and rows["a"]["kept/step"] == 1.0 and rows["a"]["kept none"] == pytest.approx(1 / 3)
    assert rows["b"]["tokens/step"] == 3.0
    assert rows["all steps"]["steps"] == 4 and rows["all steps"]["drafted/step"] == 3.5


def test_cost_table_prices_rows_against_one_row():
    """Steps of n rows that cost n times one row (trunk and head alike) read n x 1 row, within their interval,
    and need goal x n tokens a step."""
    one = [0.010, 0.012, 0.011, 0.013]
    times = {n: ([n * t for t in one], [n * t / 2 for t in one]) for n in (1, 2, 5)}
    for row in cost_table(times, goal=2.0):
        n = row["rows"]
        assert row["x 1 row"] == pytest.approx(n)
        lo, hi = (float(v) for v in row["95% CI"].strip("[]").split(","))
        assert lo <= n <= hi
        assert row["tau for 2x"] == pytest.approx(2.0 * n)
        assert row["step ms"] == pytest.approx(1e3 * n * 1.5 * 0.0115)


def test_predicted_speedup_is_tau_when_every_step_costs_one_token_and_drafting_is_free():
    steps = [("a", 4, 2), ("b", 1, 0), ("a", 8, 8)]
    tokens = sum(k + 1 for _, _, k in steps)
    flat = {n: 50.0 for n in range(1, 10)}
    assert predicted_speedup(steps, flat, tokens, 0.0) == pytest.approx(tokens / len(steps))
    dearer = {n: 50.0 * (1 + (n > 1)) for n in range(1, 10)}  # verify steps at twice a token, plus drafting
    assert predicted_speedup(steps, dearer, tokens, 0.15) == pytest.approx(tokens * 0.05 / (3 * 0.1 + 0.15))


def test_verify_cost_by_rows_times_trunk_and_head_for_every_row_count_in_every_round(pair):
    target = pair.target
    prompt = [5, 9, 12, 7]
    times = verify_cost_by_rows(target, prompt, rows=[1, 3], rounds=2)
    assert set(times) == {1, 3}
    assert all(len(part) == 2 and min(part) > 0 for trunk_head in times.values() for part in trunk_head)
