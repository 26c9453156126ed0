"""The verify-rows benchmark's pieces: the proposer log is transparent and lines up with the engine's steps, the
cost table prices rows against one row, and the cost model turns both into a speedup."""

from __future__ import annotations

import pytest
import torch

from dropmatch.benchmarks import verify_rows
from dropmatch.benchmarks.verify_rows import (
    NO_DRAFT,
    ProposerLog,
    Step,
    StepTimes,
    census_table,
    cost_table,
    predicted_speedup,
    steps_of,
    verify_cost_by_rows,
)
from dropmatch.drafters import LookupFirstDrafter, ModelDrafter
from dropmatch.engine import generate

from .conftest import make_tiny

PROMPT = torch.tensor([5, 9, 12, 5, 9, 30, 41, 5, 9, 12, 7, 3])


@pytest.fixture(scope="module")
def pair():
    return make_tiny("llama", seed=3, vocab_size=64, layers=3)


def _logged_run(pair, eos: tuple[int, ...] = ()):
    log = ProposerLog(LookupFirstDrafter(ModelDrafter(pair.draft), min_match=1))
    out = generate(pair.target, PROMPT, drafter=log, draft_len=4, max_new_tokens=40, eos_token_ids=eos)
    return log, out, steps_of(log, out.stats)


def test_the_log_changes_nothing_and_names_each_steps_proposer(pair):
    plain = generate(pair.target, PROMPT, drafter=LookupFirstDrafter(ModelDrafter(pair.draft), min_match=1),
                     draft_len=4, max_new_tokens=40)
    log, out, steps = _logged_run(pair)
    assert out.token_ids == plain.token_ids
    inner = log.drafter
    assert sum(s.proposer == "n-gram lookup" for s in steps) == inner.lookup_steps > 0
    assert sum(s.proposer == inner.drafter.name for s in steps) == inner.drafter_steps > 0
    assert all((s.proposer == NO_DRAFT) == (s.drafted == 0) for s in steps)
    # every output token is a kept draft token, a step's own token or the prefill's
    assert sum(s.kept for s in steps) + len(steps) + 1 == len(out.token_ids)


def test_steps_count_only_the_tokens_emitted_when_an_eos_ends_a_draft(pair):
    """A draft token kept as EOS ends the output there: the step's kept count stops at it, and that step emits
    no token of the target's own (the census's tokens/step counts one too many for it)."""
    _, free, steps = _logged_run(pair)
    output, position = free.token_ids, 1
    for step in steps:  # the first kept draft token not seen before it in the output
        for j in range(step.kept):
            if output[position + j] not in output[: position + j]:
                eos = output[position + j]
                break
        else:
            position += step.kept + 1
            continue
        break
    else:
        pytest.skip("no kept draft token that is new to the output")
    _, out, ended = _logged_run(pair, eos=(eos,))
    assert out.token_ids == output[: output.index(eos) + 1]
    assert sum(s.kept for s in ended) + len(ended) + 1 == len(out.token_ids) + 1


def test_census_table_groups_steps_by_proposer():
    steps = [Step("a", 4, 0, 1), Step("b", 2, 2, 3), Step("a", 4, 1, 2), Step("a", 4, 2, 5)]
    rows = {row["proposer"]: row for row in census_table(steps)}
    assert rows["a"]["steps"] == 3 and rows["a"]["kept/step"] == 1.0 and rows["a"]["kept none"] == pytest.approx(1 / 3)
    assert rows["a"]["head rows/step"] == pytest.approx(8 / 3)
    assert rows["b"]["tokens/step"] == 3.0
    assert rows["all steps"]["steps"] == 4 and rows["all steps"]["drafted/step"] == 3.5


def test_cost_table_prices_rows_against_one_row():
    """Steps of n rows that cost n times one row (trunk and head alike) read n x 1 row, within their interval,
    and need goal x n tokens a step."""
    one = [0.010, 0.012, 0.011, 0.013]
    times = {n: StepTimes([n * t for t in one], [n * t / 2 for t in one]) for n in (1, 2, 5)}
    for row in cost_table(times, goal=2.0):
        n = row["rows"]
        assert row["x 1 row"] == pytest.approx(n)
        lo, hi = (float(v) for v in row["95% CI"].strip("[]").split(","))
        assert lo <= n <= hi
        assert row["tau for 2x"] == pytest.approx(2.0 * n)
        assert (row["trunk ms"], row["head ms"]) == pytest.approx((1e3 * n * 0.0115, 1e3 * n * 0.0115 / 2))


def test_predicted_speedup_is_tokens_per_step_over_step_cost_when_drafting_is_free():
    steps = [Step("a", 4, 2, 5), Step("b", 1, 0, 2), Step("a", 8, 8, 9)]
    tokens = sum(s.kept + 1 for s in steps)
    for cost in (1.0, 1.5):
        flat = {1: (0.6, 0.4)} | {n: (0.6 * cost, 0.4 * cost) for n in range(2, 10)}  # each step: cost x one row
        assert predicted_speedup(steps, flat, 0.05, tokens, 0.0) == pytest.approx(tokens / len(steps) / cost)
    free = predicted_speedup(steps, flat, 0.05, tokens, 0.0)
    assert predicted_speedup(steps, flat, 0.05, tokens, 0.1) < free


def test_predicted_speedup_prices_the_trunk_by_the_draft_and_the_head_by_its_rows():
    """The trunk runs on every drafted row, the head only on the rows left after a cut."""
    linear = {n: (3.0 * n, 1.0 * n) for n in range(1, 10)}  # ms: trunk 3 a row, head 1 a row
    whole, cut = [Step("a", 4, 1, 5)], [Step("a", 4, 1, 2)]
    assert predicted_speedup(whole, linear, 1.0, 2, 0.0) == pytest.approx(2 / 5)  # (15 + 5) / 4 one-row steps
    assert predicted_speedup(cut, linear, 1.0, 2, 0.0) == pytest.approx(2 / 4.25)  # (15 + 2) / 4


def test_verify_cost_by_rows_times_each_row_count_every_round_and_rolls_each_back(pair, monkeypatch):
    calls = []
    real = verify_rows.rollback
    monkeypatch.setattr(verify_rows, "rollback", lambda cache, n: (calls.append(n), real(cache, n)))
    times = verify_cost_by_rows(pair.target, [5, 9, 12, 7], rows=[1, 3], rounds=2)
    assert sorted(calls) == [1, 1, 1, 3, 3, 3]  # the warm-up round and two timed ones
    assert set(times) == {1, 3}
    assert all(len(part) == 2 and min(part) > 0 for step in times.values() for part in step)
