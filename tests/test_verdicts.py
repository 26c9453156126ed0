"""The verdict engine on synthetic result tables and records: every verdict is reachable, and the
interval test can fail."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from dropmatch import verdicts
from dropmatch.experiments import slug
from dropmatch.report import Estimate
from dropmatch.verdicts import Claim, Measurement

GEMMA = 640
P_EQUAL = 0.0324  # analysis.equal_noise_p_drop(0.3, 8192, 640)
SPEEDUP = Claim("Table 6", "speed-up", 1.10, 1.10, "x", 0.05, null=1.0, p_drop=0.3)


def measured(value, lo, hi, p=P_EQUAL, n=20):
    return Measurement(Estimate(value, lo, hi, n, "test"), p)


@pytest.mark.parametrize("ci, expected", [
    ((1.12, 1.05, 1.20), verdicts.REPRODUCED),  # meets the band [1.05, 1.15], excludes 1
    ((1.40, 1.30, 1.50), verdicts.NOT_REPRODUCED),  # above the band
    ((0.95, 0.90, 0.99), verdicts.NOT_REPRODUCED),  # below it
    ((1.05, 0.95, 1.20), verdicts.NOT_TESTABLE),  # holds both the band and no effect
])
def test_effect_claim_at_equal_noise(ci, expected):
    outcome, reason = verdicts.verdict(SPEEDUP, measured(*ci), GEMMA)
    assert outcome == expected, reason


@pytest.mark.parametrize("ci, expected", [
    ((1.10, 1.01, 1.20), verdicts.REPRODUCED),
    ((1.00, 1.00, 1.00), verdicts.NOT_REPRODUCED),  # touches the band [1, inf] only at no effect
    ((0.95, 0.90, 1.00), verdicts.NOT_REPRODUCED),
    ((1.00, 0.90, 1.10), verdicts.NOT_TESTABLE),
])
def test_directional_claim(ci, expected):
    right_of = Claim("Fig. 5", "tau ratio > 1", 1.0, math.inf, "x", null=1.0, kind="effect", p_drop=0.3)
    assert verdicts.verdict(right_of, measured(*ci), GEMMA)[0] == expected


def test_p_drop_0_3_on_a_640_wide_model_is_another_regime():
    outcome, reason = verdicts.verdict(SPEEDUP, measured(1.12, 1.05, 1.20, p=0.3), GEMMA)
    assert outcome == verdicts.DIFFERENT_REGIME and "12.8x" in reason and "reproduced" in reason
    assert verdicts.verdict(SPEEDUP, measured(1.12, 1.05, 1.20, p=0.3), 8192)[0] == verdicts.REPRODUCED


def test_level_claim_needs_the_interval_inside_the_band():
    share = Claim("Table 2", "all agree", 0.984, 0.984, "share", 0.02, p_drop=0.3)
    assert verdicts.verdict(share, measured(0.98, 0.97, 0.99), GEMMA)[0] == verdicts.REPRODUCED
    assert verdicts.verdict(share, measured(0.96, 0.90, 0.99), GEMMA)[0] == verdicts.NOT_TESTABLE
    outcome, reason = verdicts.verdict(share, measured(0.60, 0.55, 0.65), GEMMA)
    assert outcome == verdicts.NOT_REPRODUCED and "below" in reason


def test_missing_data_too_few_prompts_no_interval_and_size_bound_results():
    assert verdicts.verdict(SPEEDUP, Measurement(missing="no run"), GEMMA) == (verdicts.NOT_TESTABLE, "no run")
    assert verdicts.verdict(SPEEDUP, measured(1.1, 1.06, 1.14, n=3), GEMMA)[0] == verdicts.NOT_TESTABLE
    no_ci = Measurement(Estimate(1.1, source="no columns"), P_EQUAL)
    assert verdicts.verdict(SPEEDUP, no_ci, GEMMA) == (verdicts.NOT_TESTABLE, "no 95 % interval: no columns")
    judge = Claim("Table 7", "GPT-4 score", 8.45, 8.45, "score", untestable="needs a GPT-4 judge")
    assert verdicts.verdict(judge, measured(8.4, 8.3, 8.5), GEMMA)[0] == verdicts.NOT_TESTABLE
    overhead = Claim("Table 4", "overhead", 0.0, 1.64, "%", 1.0, p_drop=0.3, scale_bound=True)
    outcome, reason = verdicts.verdict(overhead, measured(1.0, 0.8, 1.2), GEMMA)
    assert outcome == verdicts.DIFFERENT_REGIME and "size-bound" in reason
    assert verdicts.verdict(overhead, measured(1.0, 0.8, 1.2, p=0.3), 8192)[0] == verdicts.REPRODUCED


def test_regimes_are_the_papers_p_and_the_equal_noise_one():
    rows = verdicts.regimes(SPEEDUP, GEMMA, lambda p: Measurement(p_drop=p))
    assert [m.p_drop for _, m in rows] == [0.3, pytest.approx(P_EQUAL, rel=0.01)]
    assert len(verdicts.regimes(SPEEDUP, 8192, lambda p: Measurement(p_drop=p))) == 1  # the paper's width


# --- whole tables from synthetic results -------------------------------------------------------------

def _write_run(results, task, model, name, method, n, *, tokens, steps, seconds, scores, outputs, key):
    """A run_methods summary row and its per-example records (decode totals per prompt)."""
    path = results / f"{task}__{slug(model)}__{slug(method)}.jsonl"
    with path.open("w") as f:
        for i in range(n):
            stats = {"new_tokens": tokens(i) + 1, "target_calls": steps(i) + 1, "generations": 1,
                     "wall_s": seconds(i) + 0.1, "prefill_s": 0.1}
            f.write(json.dumps({"id": f"{task}/{i}", "task": task, "method": method, "output": outputs(i),
                                "score": {key: scores(i)}, "stats": stats}) + "\n")
    tok, stp, sec = (sum(fn(i) for i in range(n)) for fn in (tokens, steps, seconds))
    mean = sum(scores(i) for i in range(n)) / n
    return {"task": task, "name": name, "method": method, "model": model, "n": n, "paper_tau": tok / stp,
            "decode tokens/s": tok / sec, "score": key, "mean": mean, "ci95": f"[{mean:.3f}, {mean:.3f}]"}


def _gsm8k_runs(results, n=12, sd_score=0.5):
    """SD, SD+DM at p_drop 0.3 and at the equal-noise 0.032: DM's speed-up ~1.10 (paper: 1.10), its tau
    ratio ~1.5 (paper: 1.107), the same answers as SD."""
    def jitter(i):
        return 1 + 0.01 * ((i % 3) - 1)

    def score(i):
        return float(i < sd_score * n)

    def answer(i):
        return f"so the answer is #### {i}"

    common = dict(scores=score, outputs=answer, key="exact_match")
    rows = [_write_run(results, "gsm8k", "tiny", "SD L=5", "sd@L5", n, tokens=lambda i: 40, steps=lambda i: 10,
                       seconds=lambda i: 1.0, **common)]
    for p in (0.3, 0.032):
        rows.append(_write_run(results, "gsm8k", "tiny", f"SD+DM L=5 p={p}", f"dropmatch(js+majority,K=5,p={p})@L5",
                               n, tokens=lambda i: 60, steps=lambda i: 10, seconds=lambda i: 60 / 44 * jitter(i),
                               **common))
    pd.DataFrame(rows).to_csv(results / "table6_main.csv", index=False)


def _rows(table, comparison):
    return table[table["comparison"] == comparison].set_index("regime")


def test_table6_rows_from_records(tmp_path):
    _gsm8k_runs(tmp_path)
    table = verdicts.verdict_table(tmp_path, P_EQUAL, "tiny: ours")
    speed = _rows(table, "speed-up SD+DM / SD (decode tokens/s), gsm8k, L=5")
    equal, paper = speed.loc["equal noise"], speed.loc["paper's p_drop"]
    assert equal["ours"] == pytest.approx(1.10, abs=0.01) and equal["n"] == 12
    assert equal["ours_lo"] < equal["ours"] < equal["ours_hi"] and "paired bootstrap" in equal["source"]
    assert equal["verdict"] == verdicts.REPRODUCED and equal["p_drop"] == 0.032
    assert paper["verdict"] == verdicts.DIFFERENT_REGIME
    tau = _rows(table, "tau ratio SD+DM / SD (paper tau), gsm8k, L=5").loc["equal noise"]
    assert tau["ours"] == pytest.approx(1.5) and tau["verdict"] == verdicts.NOT_REPRODUCED  # the CI misses 1.107
    # no prompt's score moved, but 12 prompts cannot bound a change of a few points: a 0-1 score's change
    # lies within +-26 points (the exact bound on the share of prompts that could move), not in 0 [0, 0]
    quality = _rows(table, "score change SD+DM - SD, gsm8k, L=5").loc["equal noise"]
    assert quality["ours"] == 0.0 and quality["agreement"] == 1.0 and quality["verdict"] == verdicts.NOT_TESTABLE
    assert quality["ours_lo"] == pytest.approx(-26.4, abs=0.1) and "underpowered" in quality["reason"]
    mmlu = _rows(table, "speed-up SD+DM / SD (decode tokens/s), mmlu, L=5")
    assert set(mmlu["verdict"]) == {verdicts.NOT_TESTABLE} and "no SD+DM L=5 and SD L=5 in table6_main.csv" in mmlu["reason"].iloc[0]


def test_enough_prompts_with_no_score_change_reproduce_a_quality_claim(tmp_path):
    _gsm8k_runs(tmp_path, n=400)
    table = verdicts.verdict_table(tmp_path, P_EQUAL, "ours")
    quality = _rows(table, "score change SD+DM - SD, gsm8k, L=5").loc["equal noise"]
    assert quality["ours_lo"] > -1 and quality["verdict"] == verdicts.REPRODUCED


def test_a_score_at_the_floor_is_not_testable_but_agreement_is_shown(tmp_path):
    _gsm8k_runs(tmp_path, sd_score=0.0)
    table = verdicts.verdict_table(tmp_path, P_EQUAL, "ours")
    quality = _rows(table, "score change SD+DM - SD, gsm8k, L=5").loc["equal noise"]
    assert quality["verdict"] == verdicts.NOT_TESTABLE and "floor" in quality["reason"]
    assert quality["agreement"] == 1.0 and "answer agreement with it 1" in quality["reason"]


def test_without_records_the_summary_intervals_are_used_unpaired(tmp_path):
    _gsm8k_runs(tmp_path)
    for f in tmp_path.glob("*.jsonl"):
        f.unlink()
    main = pd.read_csv(tmp_path / "table6_main.csv")
    main.assign(paper_tau_lo=main.paper_tau * 0.99, paper_tau_hi=main.paper_tau * 1.01).to_csv(
        tmp_path / "table6_main.csv", index=False)
    table = verdicts.verdict_table(tmp_path, P_EQUAL, "ours")
    tau = _rows(table, "tau ratio SD+DM / SD (paper tau), gsm8k, L=5").loc["equal noise"]
    assert "unpaired" in tau["source"] and tau["ours_lo"] == pytest.approx(1.5 * 0.99 / 1.01)
    speed = _rows(table, "speed-up SD+DM / SD (decode tokens/s), gsm8k, L=5").loc["equal noise"]
    assert speed["verdict"] == verdicts.NOT_TESTABLE and "no 95 % interval" in speed["reason"]


def _judge_runs(results, n=10):
    """SD, Auto-Judge and AJ+DM (p_drop 0.032) on gsm8k and ifeval at one threshold: AJ+DM 1.2x AJ's speed;
    on ifeval AJ+DM passes like SD on every prompt, AJ on half of them."""
    rows = []
    for task, key in (("gsm8k", "exact_match"), ("ifeval", "prompt_level_strict_acc")):
        runs = {"SD": ("sd@L5", 1.0, lambda i: float(i % 2)),
                "AJ t=0.2": ("judge(t=0.2)@L5", 1.0, lambda i: float(i % 2) if i < n // 2 else 1 - float(i % 2)),
                "AJ+DM t=0.2": ("judge+dropmatch(t=0.2,js+majority,K=5,p=0.032)@L5", 1 / 1.2, lambda i: float(i % 2))}
        for name, (method, sec, score) in runs.items():
            rows.append(_write_run(results, task, "tiny", name, method, n, tokens=lambda i: 50, steps=lambda i: 10,
                                   seconds=lambda i, sec=sec: sec * (1 + 0.01 * (i % 2)), scores=score,
                                   outputs=lambda i: f"#### {i}", key=key))
    pd.DataFrame(rows).to_csv(results / "judge_study.csv", index=False)


def test_judge_study_rows(tmp_path):
    _judge_runs(tmp_path)
    table = verdicts.verdict_table(tmp_path, P_EQUAL, "ours")
    speed = _rows(table, "speed-up AJ+DM / AJ (decode tokens/s), gsm8k, threshold 0.2 (ours)")
    assert speed.loc["equal noise", "ours"] == pytest.approx(1.2, abs=0.01)
    assert speed.loc["equal noise", "verdict"] == verdicts.REPRODUCED  # Table 8: 1.06-1.29
    paper = speed.loc["paper's p_drop"]
    assert paper["verdict"] == verdicts.NOT_TESTABLE and "at p_drop ~ 0.3" in paper["reason"]  # no AJ+DM run there
    gain = table[table["comparison"].str.startswith("answer agreement with SD, AJ+DM minus AJ")]
    gain = gain.set_index("regime").loc["equal noise"]
    assert gain["ours"] == pytest.approx(0.5) and gain["verdict"] == verdicts.REPRODUCED
    fig1a = _rows(table, "score change Auto-Judge - SD, ifeval, most permissive threshold").loc["no dropout"]
    assert fig1a["ours"] == pytest.approx(-10.0)  # 100 * (AJ - SD) per prompt: 0 on half, -1 / +1 on the rest
    assert fig1a["verdict"] == verdicts.NOT_TESTABLE and "underpowered" in fig1a["reason"]


def test_each_tasks_most_permissive_threshold_scores_its_own_rows(tmp_path):
    """gsm8k's and ifeval's most permissive thresholds differ (0.5 and 0.2): the Table 8 score change reads
    gsm8k's t=0.5 runs and Fig. 6's ifeval's t=0.2 runs, whatever order the claims are measured in."""
    from dropmatch.paper import P_DROP
    from dropmatch.verdicts import claims

    rows = [("gsm8k", "sd@L5", 3.0, 0.50), ("gsm8k", "judge(t=0.2)", 3.5, 0.48), ("gsm8k", "judge(t=0.5)", 4.0, 0.46),
            ("gsm8k", "judge+dropmatch(js,t=0.5,p=0.3)", 4.3, 0.40),
            ("gsm8k", "judge+dropmatch(js,t=0.2,p=0.3)", 3.8, 0.47), ("ifeval", "sd@L5", 3.0, 0.50),
            ("ifeval", "judge(t=0.2)", 3.6, 0.49), ("ifeval", "judge+dropmatch(js,t=0.2,p=0.3)", 3.9, 0.45)]
    table = pd.DataFrame(rows, columns=["task", "method", "paper_tau", "mean"])
    table.assign(mean_lo=table["mean"] - 0.05, mean_hi=table["mean"] + 0.05, n=50).to_csv(
        tmp_path / "judge_study.csv", index=False)
    measures = {claim.comparison: measure for claim, measure in claims.judge_claims(tmp_path)}
    gsm8k = measures["score change AJ+DM - AJ, gsm8k, most permissive threshold"](P_DROP)
    ifeval = measures["score change AJ+DM - AJ, ifeval, most permissive threshold"](P_DROP)
    assert gsm8k.estimate.value == pytest.approx(100 * (0.40 - 0.46))
    assert ifeval.estimate.value == pytest.approx(100 * (0.45 - 0.49))


def test_every_numbered_result_has_a_row_and_nothing_crashes_without_results(tmp_path):
    table = verdicts.verdict_table(tmp_path / "missing", P_EQUAL, "ours")
    assert list(table.columns) == verdicts.COLUMNS
    assert set(verdicts.RESULT_ORDER) == set(table["result"])
    assert set(table["verdict"]) == {verdicts.NOT_TESTABLE} and table["reason"].str.len().min() > 0
    assert {"Table 3"} <= set(table.loc[table["comparison"].str.contains("radius"), "result"])


def test_write_verdicts(tmp_path):
    _gsm8k_runs(tmp_path, n=400)  # enough prompts for the quality row to be reproduced too
    table = verdicts.verdict_table(tmp_path, P_EQUAL, "tiny: ours")
    csv, md = verdicts.write_verdicts(table, tmp_path / "out")
    assert pd.read_csv(csv).shape == table.shape
    text = md.read_text()
    assert "## How a verdict is reached" in text and "RATIO_TOLERANCE = 0.05" in text and "tiny: ours" in text
    assert verdicts.REPRODUCED in text and "| Table 6 " in text
    counts = verdicts.counts(table)
    assert counts.loc["Table 6", verdicts.REPRODUCED] >= 2 and counts.values.sum() == len(table)
    assert not math.isnan(table["ours"].dropna().iloc[0])


def test_without_records_the_tables_paired_columns_are_used(tmp_path):
    _gsm8k_runs(tmp_path)
    for f in tmp_path.glob("*.jsonl"):
        f.unlink()
    main = pd.read_csv(tmp_path / "table6_main.csv")
    main = main.assign(speedup=[1.0, 1.1, 1.1], speedup_lo=[1.0, 1.08, 1.08], speedup_hi=[1.0, 1.12, 1.12],
                       tau_gain=[0.0, 0.5, 0.5], tau_gain_lo=[0.0, 0.45, 0.45], tau_gain_hi=[0.0, 0.55, 0.55])
    main.to_csv(tmp_path / "table6_main.csv", index=False)
    table = verdicts.verdict_table(tmp_path, P_EQUAL, "ours")
    speed = _rows(table, "speed-up SD+DM / SD (decode tokens/s), gsm8k, L=5").loc["equal noise"]
    assert speed["verdict"] == verdicts.REPRODUCED and "paired interval of column speedup" in speed["source"]
    tau = _rows(table, "tau ratio SD+DM / SD (paper tau), gsm8k, L=5").loc["equal noise"]
    assert (tau["ours"], tau["ours_lo"]) == (pytest.approx(1.5), pytest.approx(1.45))


def test_analysis_tables(tmp_path):
    """Table 2, Fig. 3, Table 3 and Table 4 from their tables; Table 1 from the dropout paths."""
    pd.DataFrame({"p_drop": [0.3, 0.3, 0.0324, 0.0324], "agreeing_heads": [4, 5, 4, 5],
                  "share": [0.3, 0.6, 0.02, 0.975], "share_lo": [0.2, 0.5, 0.01, 0.97],
                  "share_hi": [0.4, 0.7, 0.03, 0.98], "n": 6}).to_csv(tmp_path / "table2_head_agreement.csv", index=False)
    pd.DataFrame({"p_drop": [0.0324], "mean off-diagonal cosine": [0.9], "cosine_lo": [0.85], "cosine_hi": [0.95],
                  "n": [6]}).to_csv(tmp_path / "fig3_path_similarity.csv", index=False)
    pd.DataFrame({"p_drop": [0.0324] * 2, "case": ["dispersed", "concentrated"], "js_heads": [0.03, 0.05],
                  "js_heads_lo": [0.025, 0.04], "js_heads_hi": [0.035, 0.06], "n": [6, 6]}).to_csv(
        tmp_path / "table3_js_radii.csv", index=False)
    pd.DataFrame({"rule": ["standard", "dropmatch js+majority p=0.0324 (bfloat16) dense",
                           "dropmatch js+majority p=0.3 (bfloat16) dense"],
                  "head overhead (% of verify step)": [0.0, 30.0, 31.0]}).to_csv(tmp_path / "overhead.csv", index=False)
    with (tmp_path / "dropout_paths__humaneval__tiny__64__seed0.jsonl").open("w") as f:
        for i in range(6):
            for p, passed in ((0.0, [1.0] * 5), (0.0324, [1.0, 1.0, 1.0, 1.0, 0.0])):
                for head in range(5):
                    f.write(json.dumps({"id": f"he/{i}", "p_drop": p, "head": head,
                                        "score": {"pass@1": passed[head] if i % 2 else 0.0}}) + "\n")
    table = verdicts.verdict_table(tmp_path, P_EQUAL, "ours").set_index(["comparison", "regime"])
    agree = table.loc[("share of positions where all 5 heads agree", "equal noise")]
    assert agree["ours"] == 0.975 and agree["verdict"] == verdicts.REPRODUCED  # inside 0.984 +- 0.02
    assert table.loc[("share of positions where all 5 heads agree", "paper's p_drop"), "verdict"] == (
        verdicts.DIFFERENT_REGIME)
    cosine = table.loc[("mean pairwise sentence cosine of the K=5 paths (paper p_drop 0.3)", "equal noise")]
    assert cosine["verdict"] == verdicts.REPRODUCED
    radius = table.loc[("radius JS(c, heads), concentrated positions", "equal noise")]
    assert radius["verdict"] == verdicts.NOT_REPRODUCED and "above" in radius["reason"]  # 0.0014 +- 50 %
    assert table.loc[("JS(c, draft), concentrated positions", "equal noise"), "verdict"] == verdicts.NOT_TESTABLE
    overhead = table.loc[("head overhead, K=5 js+majority (% of the forward / verify step)", "equal noise")]
    assert overhead["ours"] == 30.0 and overhead["verdict"] == verdicts.DIFFERENT_REGIME  # size-bound
    heads = table.loc[("mean per-head pass@1 minus the dropout-free baseline, humaneval", "equal noise")]
    assert heads["ours"] == pytest.approx(-10.0) and heads["n"] == 6  # -20 points on half the prompts


def test_a_table_it_cannot_read_makes_rows_not_testable_instead_of_failing(tmp_path):
    pd.DataFrame({"p_drop": [0.3], "mean_prob": [0.5]}).to_csv(tmp_path / "table2_head_agreement.csv", index=False)
    table = verdicts.verdict_table(tmp_path, P_EQUAL, "ours")
    row = table[table["result"] == "Table 2"].iloc[0]
    assert row["verdict"] == verdicts.NOT_TESTABLE and "could not read" in row["reason"]


def test_five_prompts_with_no_score_change_do_not_refute_a_small_effect():
    # Fig. 6's claim (+7.8 points) against 5 prompts whose scores all stay the same: the bootstrap alone
    # gives 0 [0, 0] and "not reproduced", but one prompt moves a 0-1 score by 20 points
    from dropmatch import report
    from dropmatch.verdicts.rules import NOT_TESTABLE, Claim, interval_test

    pairs = [({"score": {"prompt_level_strict_acc": 0.0}}, {"score": {"prompt_level_strict_acc": 0.0}})] * 5
    estimate = report.score_difference(pairs, "prompt_level_strict_acc")
    assert estimate.value == 0 and estimate.lo < -40 and estimate.hi > 40
    claim = Claim("Fig. 6", "score change", 7.8, 7.8, "points", tolerance=3.0, null=0.0)
    assert interval_test(claim, estimate)[0] == NOT_TESTABLE
    agree = report.agreement("ifeval", [({"output": "a", "score": {"prompt_level_strict_acc": 1.0}},
                                         {"output": "b", "score": {"prompt_level_strict_acc": 1.0}})] * 5)
    assert agree.value == 1 and agree.lo == pytest.approx(0.478, abs=1e-3) and agree.hi == 1
