"""The trained-judge baseline: mining, the classifier file, the rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dropmatch.errors import ConfigError
from dropmatch.judge_mining import Miner, Mismatch, mine, mining_settings, thresholds_for_shares, train_judge
from dropmatch.methods import Decoder, MethodConfig
from dropmatch.rules.judge import Judge

from .conftest import random_prompt


def _teacher_forced_argmax(pair, prompt, answer):
    with torch.no_grad():
        logits = pair.draft.model(torch.tensor([prompt + answer])).logits[0]
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_mining_finds_every_mismatch_when_all_are_important(tiny):
    prompt = random_prompt(3).tolist()
    miner = Miner(tiny, answer=lambda text: text, max_new_tokens=24, max_mismatches=50)
    reference = Decoder(tiny, MethodConfig("ar")).generate(prompt, max_new_tokens=24).token_ids
    expected = [i for i, (d, t) in enumerate(zip(_teacher_forced_argmax(tiny, prompt, reference), reference,
                                                   strict=True)) if d != t]
    found = miner.mine("p", prompt)
    assert expected, "the constructed example needs disagreements"
    assert [m.position for m in found] == expected
    assert all(m.important for m in found)
    assert [m.target_token for m in found] == [reference[i] for i in expected]
    assert all(len(m.features) == 2 * 64 for m in found)  # scoring state + state after the draft token


def test_mining_swaps_in_unimportant_tokens(tiny):
    prompt = random_prompt(4).tolist()
    found = Miner(tiny, answer=lambda text: "same", max_new_tokens=24, max_mismatches=3).mine("p", prompt)
    assert 1 <= len(found) <= 3 and not any(m.important for m in found)
    positions = [m.position for m in found]
    assert positions == sorted(set(positions))
    # the first mismatch is the first teacher-forced disagreement with the greedy answer
    reference = Decoder(tiny, MethodConfig("ar")).generate(prompt, max_new_tokens=24).token_ids
    first = next(i for i, (d, t) in enumerate(zip(_teacher_forced_argmax(tiny, prompt, reference), reference,
                                                    strict=True)) if d != t)
    assert positions[0] == first


def test_mining_is_resumable(tiny, tmp_path):
    problems = [(f"p{i}", tiny.decode(random_prompt(i).tolist())) for i in range(3)]
    out = tmp_path / "mined.jsonl"
    first = mine(tiny, problems[:2], out, answer=lambda t: t[:5], max_new_tokens=16, max_mismatches=2, progress=False)
    again = mine(tiny, problems, out, answer=lambda t: t[:5], max_new_tokens=16, max_mismatches=2, progress=False)
    assert len(out.read_text().splitlines()) == 3
    assert [m.position for m in again[: len(first)]] == [m.position for m in first]


def test_a_bare_stop_string_is_one_stop_string_not_its_characters(tiny):
    """``stop="Answer"`` must not stop at every 'A', 'n', 's', ... nor key the records by characters."""
    assert Miner(tiny, lambda text: text, stop="Answer").stop == ("Answer",)
    assert mining_settings(tiny, "Answer", 10, 1)["stop"] == ["Answer"]


def _separable(n=200, d=16, seed=0, problems=20):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n).astype(bool)
    x = rng.normal(size=(n, d)) + 1.5 * y[:, None]
    return [Mismatch(f"p{i % problems}", i, 0, 1, bool(label), row.tolist())
            for i, (row, label) in enumerate(zip(x, y, strict=True))]


def test_judge_round_trips_through_its_file(tmp_path):
    mismatches = _separable()
    judge = train_judge(mismatches)
    assert judge.info["val_auc"] > 0.9 and judge.info["C"] in judge.info["val_auc_by_C"]
    path = tmp_path / "judge.joblib"
    judge.save(path)
    loaded = Judge.load(path)
    x = torch.tensor([m.features for m in mismatches[:20]])
    np.testing.assert_array_equal(loaded.p_important(x), judge.p_important(x))
    assert loaded.info == judge.info


def test_judge_trains_with_few_labels():
    """Validation copes with folds that hold one class, or train on one, instead of failing on them."""
    judge = train_judge(_separable(n=40)[:7] + [Mismatch("p98", 99, 0, 1, True, [3.0] * 16),
                                                 Mismatch("p99", 98, 0, 1, False, [-3.0] * 16)])
    assert 0.0 <= judge.info["val_auc"] <= 1.0 and judge.info["problems"] == 9


def test_judge_validation_holds_out_whole_problems():
    """Mismatches of one problem share its context. Here each problem's features carry its own signature
    and its label, drawn per problem, is all they tell: a fold that split a problem would let the judge
    recognise it (validation AUC near 1); holding out whole problems shows it has learnt nothing (~0.5)."""
    rng = np.random.default_rng(0)
    problems, per_problem, d = 40, 4, 64
    signatures, labels = rng.normal(size=(problems, d)), rng.integers(0, 2, problems).astype(bool)
    mismatches = [Mismatch(f"p{i}", j, 0, 1, bool(labels[i]), (signatures[i] + 0.1 * rng.normal(size=d)).tolist())
                  for i in range(problems) for j in range(per_problem)]
    judge = train_judge(mismatches)
    assert max(judge.info["val_auc_by_C"].values()) < 0.75
    assert judge.info["problems"] == problems
    with pytest.raises(ConfigError, match="at least 2 problems"):
        train_judge([Mismatch("p", i, 0, 1, bool(i % 2), [float(i % 2), 1.0]) for i in range(10)])


def test_thresholds_for_shares_accept_those_shares_of_the_mined_mismatches():
    mismatches = _separable()
    judge = train_judge(mismatches)
    p = judge.p_important(np.asarray([m.features for m in mismatches], dtype=np.float32))
    shares = [0.0, 0.1, 0.5, 0.9, 1.0]
    thresholds = thresholds_for_shares(judge, mismatches, shares)
    assert thresholds[0] == 0.0 and thresholds == sorted(thresholds)
    for share, t in zip(shares, thresholds, strict=True):
        accepted = float(np.mean(p < t))
        assert share <= accepted <= share + 1.5 / len(p)  # ties aside, exactly the share rounded up
    with pytest.raises(ConfigError, match="shares"):
        thresholds_for_shares(judge, mismatches, [1.5])


def test_judge_errors(tmp_path):
    with pytest.raises(ConfigError, match="important"):
        train_judge([Mismatch("p", i, 0, 1, True, [0.0, 1.0]) for i in range(10)])
    with pytest.raises(ConfigError, match="no judge file"):
        Judge.load(tmp_path / "missing.joblib")
    (tmp_path / "text.joblib").write_text("not a pickle")
    with pytest.raises(ConfigError, match="is not a judge file"):
        Judge.load(tmp_path / "text.joblib")
    import joblib

    joblib.dump({"weights": [1, 2]}, tmp_path / "other.joblib")
    with pytest.raises(ConfigError, match="no pipeline and info"):
        Judge.load(tmp_path / "other.joblib")
    with pytest.raises(ConfigError, match="--judge"):
        MethodConfig("judge")


@pytest.fixture(scope="module")
def tiny_judge_path(tiny, tmp_path_factory):
    """A judge trained on features of the tiny target's own hidden size."""
    rng = np.random.default_rng(1)
    mismatches = [Mismatch(f"p{i // 4}", i, 0, 1, bool(i % 2), (rng.normal(size=128) + (i % 2)).tolist())
                  for i in range(80)]
    path = tmp_path_factory.mktemp("judge") / "tiny.joblib"
    train_judge(mismatches).save(path)
    return str(path)


def test_threshold_zero_is_exact_match(tiny, tiny_judge_path):
    for seed in range(3):
        prompt = random_prompt(seed)
        sd = Decoder(tiny, MethodConfig("sd")).generate(prompt, max_new_tokens=32)
        for method in ("judge", "judge+dropmatch"):
            config = MethodConfig(method, judge_path=tiny_judge_path, judge_threshold=0.0, p_drop=0.0)
            out = Decoder(tiny, config).generate(prompt, max_new_tokens=32)
            assert out.token_ids == sd.token_ids
            assert out.stats.accepted_per_step == sd.stats.accepted_per_step and out.stats.extra_accepts == 0


def test_threshold_one_accepts_more(tiny, tiny_judge_path):
    prompt = random_prompt(1)
    sd = Decoder(tiny, MethodConfig("sd")).generate(prompt, max_new_tokens=32).stats
    loose = Decoder(tiny, MethodConfig("judge", judge_path=tiny_judge_path, judge_threshold=1.0))
    stats = loose.generate(prompt, max_new_tokens=32).stats
    assert stats.tau > sd.tau and stats.extra_accepts > 0
