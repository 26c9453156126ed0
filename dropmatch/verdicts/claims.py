"""The paper's claims, result by result, each with the measurement of ours that tests it (a function of
the p_drop wanted)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from .. import report
from ..paper import (
    FIG1A_AUTOJUDGE,
    FIG1B_EAGLE3_TAU,
    FIG3_P_DROPS,
    FIG6_IFEVAL,
    HIDDEN_SIZE,
    P_DROP,
    PAPER_SETUPS,
    TABLE1_HEAD_PASS,
    TABLE2_AGREEMENT,
    TABLE3_JS,
    TABLE4_OVERHEAD_PERCENT,
    TABLE7_EAGLE3,
    TABLE8_AUTOJUDGE,
    TABLE8_SPEEDUP_RANGE,
    TABLE10_KOMT,
    table6_for,
)
from ..report import Estimate
from .measure import Runs, all_heads_agree, head_pass_change, missing, quality, ratio, table_value
from .rules import (
    FIG3_HIGH_COSINE,
    FIGURE_RATIO_TOLERANCE,
    FIGURE_TOLERANCE_POINTS,
    JS_RELATIVE_TOLERANCE,
    KOMT_SCORE_TOLERANCE,
    OVERHEAD_TOLERANCE_POINTS,
    PAPER_WIDTH,
    QUALITY_TOLERANCE_POINTS,
    RATIO_TOLERANCE,
    SHARE_TOLERANCE,
    Claim,
    Measurement,
)

Measure = Callable[[float], Measurement]  # p_drop wanted -> our measurement there
Claims = list[tuple[Claim, Measure]]
NO_JUDGE = "no Auto-Judge runs in judge_study.csv (notebook 06 trained no judge, or did not run)"
NO_EAGLE = ("no EAGLE-3 runs (method sd+eagle3@L..) in table10_korean.csv or table7_eagle3.csv; "
            "python -m dropmatch.benchmarks.eagle3_dropmatch prints this comparison but writes no table")


def all_claims(results_dir: Path) -> Claims:
    """Every claim of the paper with the measurement of ours that tests it (the table sorts them by result)."""
    return (judge_claims(results_dir) + eagle_claims(results_dir) + head_claims(results_dir)
            + overhead_claims(results_dir) + untestable_claims() + table6_claims(results_dir)
            + korean_claims(results_dir))


def table6_claims(results_dir: Path) -> Claims:
    """Table 6 per task and L: speed-up and tau ratio of SD+DM (the JS criteria) over SD at the same L, and
    the score change."""
    runs = Runs.read(results_dir, "table6_main.csv")
    model = None
    if runs.table is not None and "model" in runs.table.columns and len(runs.table):
        model = str(runs.table["model"].iloc[0])
    key, numbers = table6_for(model)
    common = dict(null=1.0, p_drop=P_DROP, setup=PAPER_SETUPS[key],
                  width=HIDDEN_SIZE["Qwen3-32B"] if key == "table6_qwen" else PAPER_WIDTH)
    out: Claims = []
    for (task, L), (tau_sd, tau_dm, acc_sd, acc_dm, speedup) in numbers.items():
        def pair(p, task=task, L=L):
            return runs.find(task, "dropmatch(js", L=L, p=p, excludes="+eagle3"), runs.find(task, "sd@", L=L)

        what = f"SD+DM L={L} and SD L={L}"
        out += [
            (Claim("Table 6", f"speed-up SD+DM / SD (decode tokens/s), {task}, L={L}", speedup, speedup, "x",
                   RATIO_TOLERANCE, **common), lambda p, pair=pair, w=what: ratio(runs, *pair(p), "speed", w)),
            (Claim("Table 6", f"tau ratio SD+DM / SD (paper tau), {task}, L={L}", tau_dm / tau_sd, tau_dm / tau_sd,
                   "x", RATIO_TOLERANCE, **common), lambda p, pair=pair, w=what: ratio(runs, *pair(p), "tau", w)),
            (Claim("Table 6", f"score change SD+DM - SD, {task}, L={L}", acc_dm - acc_sd, acc_dm - acc_sd, "points",
                   QUALITY_TOLERANCE_POINTS, **{**common, "null": 0.0}),
             lambda p, pair=pair, w=what: quality(runs, *pair(p), w)),
        ]
    return out


def _thresholds(runs: Runs, task: str) -> tuple[list[float], float | None]:
    """Our judge thresholds on ``task`` and the most permissive one (Auto-Judge's largest paper tau)."""
    if runs.table is None or "task" not in runs.table.columns:
        return [], None
    aj = runs.table[(runs.table["task"] == task) & runs.table["method"].str.startswith("judge(")]
    if not len(aj):
        return [], None
    tau = aj["paper_tau" if "paper_tau" in aj.columns else "tau"].astype(float).fillna(-math.inf)
    return (sorted({report.label_value(m, "t") for m in aj["method"]}),
            report.label_value(str(aj.loc[tau.idxmax(), "method"]), "t"))


def judge_claims(results_dir: Path) -> Claims:
    """Fig. 1a, Table 8, Fig. 5 and Fig. 6, from notebook 06's judge study."""
    runs = Runs.read(results_dir, "judge_study.csv")

    def aj(task, t):
        return runs.find(task, "judge(", t=t)

    def both(task, t, p):
        return runs.find(task, "judge+dropmatch(", t=t, p=p)

    def sd(task):
        return runs.find(task, "sd@")

    def when(t, measure: Measure) -> Measure:
        return measure if t is not None else lambda p: missing(NO_JUDGE)

    out: Claims = []
    for task, (standard, judged) in FIG1A_AUTOJUDGE.items():
        top = _thresholds(runs, task)[1]
        out.append((Claim("Fig. 1a", f"score change Auto-Judge - SD, {task}, most permissive threshold",
                          judged - standard, judged - standard, "points", FIGURE_TOLERANCE_POINTS, null=0.0,
                          setup=PAPER_SETUPS["fig1a"], text=f"{judged - standard:+.1f} ({standard:g} -> {judged:g}, "
                                                            "read off)"),
                    when(top, lambda p, task=task, top=top: quality(runs, aj(task, top), sd(task), "Auto-Judge and SD"))))
    ts, gsm8k_top = _thresholds(runs, "gsm8k")
    for t in ts or [None]:
        label = f"threshold {t:g} (ours)" if t is not None else "per threshold"
        out.append((Claim("Table 8", f"speed-up AJ+DM / AJ (decode tokens/s), gsm8k, {label}", *TABLE8_SPEEDUP_RANGE,
                          "x", RATIO_TOLERANCE, null=1.0, p_drop=P_DROP, setup=PAPER_SETUPS["table8"]),
                    when(t, lambda p, t=t: ratio(runs, both("gsm8k", t, p), aj("gsm8k", t), "speed", "AJ+DM / AJ"))))
        out.append((Claim("Fig. 5", f"tau ratio AJ+DM / AJ (paper tau), gsm8k, {label}", 1.0, math.inf, "x", null=1.0,
                          kind="effect", p_drop=P_DROP, setup=PAPER_SETUPS["fig5"],
                          text="> 1 (AJ+DM right of AJ, read off)"),
                    when(t, lambda p, t=t: ratio(runs, both("gsm8k", t, p), aj("gsm8k", t), "tau", "AJ+DM / AJ"))))
    aj_acc, _, both_acc, _ = TABLE8_AUTOJUDGE[max(TABLE8_AUTOJUDGE)]
    out.append((Claim("Table 8", "score change AJ+DM - AJ, gsm8k, most permissive threshold", both_acc - aj_acc,
                      both_acc - aj_acc, "points", QUALITY_TOLERANCE_POINTS, null=0.0, p_drop=P_DROP,
                      setup=PAPER_SETUPS["table8"]),
                when(gsm8k_top, lambda p: quality(runs, both("gsm8k", gsm8k_top, p), aj("gsm8k", gsm8k_top),
                                                  "AJ+DM and AJ", lossless=sd("gsm8k")))))
    ifeval_top = _thresholds(runs, "ifeval")[1]
    fig6 = dict(p_drop=P_DROP, setup=PAPER_SETUPS["fig6"])
    (aj_acc, aj_speed), (both_acc, both_speed) = FIG6_IFEVAL["auto-judge"], FIG6_IFEVAL["auto-judge+dm"]

    def agreement_gain(p):
        rows = [both("ifeval", ifeval_top, p), aj("ifeval", ifeval_top), sd("ifeval")]
        if any(r is None for r in rows):
            return missing("no AJ+DM, AJ and SD runs on ifeval in judge_study.csv")
        records = [runs.records(r) for r in rows]
        if any(r is None for r in records):
            return Measurement(Estimate(math.nan, source="no per-example records"), p)
        refs = {r["id"]: r for r in records[2]}
        triples = [(x, y, refs[x["id"]]) for x, y in report.paired(records[0], records[1]) if x["id"] in refs]
        return Measurement(report.agreement_gain("ifeval", triples), p)

    out += [
        (Claim("Fig. 6", "score change AJ+DM - AJ, ifeval, most permissive threshold", both_acc - aj_acc,
               both_acc - aj_acc, "points", FIGURE_TOLERANCE_POINTS, null=0.0,
               text=f"{both_acc - aj_acc:+.1f} (read off)", **fig6),
         when(ifeval_top, lambda p: quality(runs, both("ifeval", ifeval_top, p), aj("ifeval", ifeval_top),
                                            "AJ+DM and AJ", lossless=sd("ifeval")))),
        (Claim("Fig. 6", "answer agreement with SD, AJ+DM minus AJ, ifeval, most permissive threshold "
               "(proxy at this size; the paper shows accuracy)", 0.0, 1.0, "share of prompts", null=0.0,
               kind="effect", text="> 0 (AJ+DM keeps more quality)", **fig6), when(ifeval_top, agreement_gain)),
        (Claim("Fig. 6", "speed-up AJ+DM / AJ (decode tokens/s), ifeval, most permissive threshold",
               both_speed / aj_speed, both_speed / aj_speed, "x", FIGURE_RATIO_TOLERANCE, null=1.0,
               text=f"{both_speed / aj_speed:.3f} ({both_speed:g}x / {aj_speed:g}x, read off)", **fig6),
         when(ifeval_top, lambda p: ratio(runs, both("ifeval", ifeval_top, p), aj("ifeval", ifeval_top), "speed",
                                          "AJ+DM / AJ"))),
    ]
    return out


def eagle_claims(results_dir: Path) -> Claims:
    """Fig. 1b, Table 7 and Table 10's EAGLE-3 row (EAGLE-3 runs: method labels ``sd+eagle3@L..``)."""
    korean, table7 = Runs.read(results_dir, "table10_korean.csv"), Runs.read(results_dir, "table7_eagle3.csv")

    def eagle_over_sd(task):
        for runs in (korean, table7):
            eagle = runs.find(task, "sd+eagle3@")
            sd = runs.find(task, "sd@", L=eagle["_L"]) if eagle is not None else None
            if sd is not None:
                return ratio(runs, eagle, sd, "tau", "EAGLE-3 / SD")
        return missing(NO_EAGLE)

    out: Claims = []
    for task, (standard, eagle) in FIG1B_EAGLE3_TAU.items():
        out.append((Claim("Fig. 1b", f"tau ratio EAGLE-3 / SD (paper tau), {task}", eagle / standard,
                          eagle / standard, "x", FIGURE_RATIO_TOLERANCE, null=1.0, setup=PAPER_SETUPS["fig1b"],
                          text=f"{eagle / standard:.3f} ({eagle:g} / {standard:g}, read off, L=5)"),
                    lambda p, task=task: eagle_over_sd(task)))
    for task in ("gsm8k", "mt_bench", "alpaca"):
        speed_e, tau_e, speed_dm, tau_dm = TABLE7_EAGLE3[(task, 5)]
        for kind, value, what in (("speed", speed_dm / speed_e, "speed-up (decode tokens/s)"),
                                  ("tau", tau_dm / tau_e, "tau ratio")):
            def measure(p, task=task, kind=kind):
                if table7.table is None:
                    return missing(NO_EAGLE)
                dm = table7.find(task, "dropmatch(naive,", contains="+eagle3", p=p)
                return ratio(table7, dm, table7.find(task, "sd+eagle3@", L=5), kind, "EAGLE-3+DM (naive) / EAGLE-3")

            out.append((Claim("Table 7", f"{what} EAGLE-3+DM / EAGLE-3, {task}, L=5", value, value, "x",
                              RATIO_TOLERANCE, null=1.0, p_drop=P_DROP, setup=PAPER_SETUPS["table7"],
                              untestable="no Alpaca data here" if task == "alpaca" else ""), measure))
    out.append((Claim("Table 7", "MT-bench score and Alpaca win rate of EAGLE-3+DM (GPT-4 judge)", 8.45, 8.45, "score",
                      setup=PAPER_SETUPS["table7"], text="8.45 vs 8.47 (MT-bench, L=5); win rate 55.0",
                      untestable="needs a GPT-4 judge and Alpaca data (neither ships offline)"),
                lambda p: Measurement()))
    komt = TABLE10_KOMT["eagle3"][1] / TABLE10_KOMT["standard"][1]
    out.append((Claim("Table 10", "tau ratio EAGLE-3 / SD (paper tau), komt_bench", komt, komt, "x", RATIO_TOLERANCE,
                      null=1.0, setup=PAPER_SETUPS["table10"]), lambda p: eagle_over_sd("komt_bench")))
    return out


def korean_claims(results_dir: Path) -> Claims:
    """Table 10: tau ratio of SD+DM over SD on KoMT-bench, and the LLM-judge score change."""
    runs = Runs.read(results_dir, "table10_korean.csv")
    (s_score, s_tau), (d_score, d_tau) = TABLE10_KOMT["standard"], TABLE10_KOMT["standard+dm"]
    common = dict(p_drop=P_DROP, setup=PAPER_SETUPS["table10"])

    def pair(p):
        return runs.find("komt_bench", "dropmatch(", p=p, excludes="+eagle3"), runs.find("komt_bench", "sd@")

    def score(p):
        dm, sd = pair(p)
        if dm is not None and str(dm.get("score", "")) != "judge_score":
            return missing("KoMT-bench is scored reference-free here: no LLM judge configured (the paper: GPT-4; "
                           "see DROPMATCH_LLM_JUDGE)")
        return quality(runs, dm, sd, "SD+DM and SD on komt_bench", scale=1.0)

    return [
        (Claim("Table 10", "tau ratio SD+DM / SD (paper tau), komt_bench, L=7", d_tau / s_tau, d_tau / s_tau, "x",
               RATIO_TOLERANCE, null=1.0, **common), lambda p: ratio(runs, *pair(p), "tau", "SD+DM / SD on komt_bench")),
        (Claim("Table 10", "LLM-judge score change SD+DM - SD, komt_bench (out of 10)", d_score - s_score,
               d_score - s_score, "score points", KOMT_SCORE_TOLERANCE, null=0.0, **common), score),
    ]


def head_claims(results_dir: Path) -> Claims:
    """Table 1 (per-head pass@1), Table 2 (head agreement), Fig. 3 (path similarity), Table 3 (JS radii)."""
    heads = TABLE1_HEAD_PASS[P_DROP]
    change = sum(heads) / len(heads) - 81.7
    out: Claims = [
        (Claim("Table 1", "mean per-head pass@1 minus the dropout-free baseline, humaneval", change, change, "points",
               FIGURE_TOLERANCE_POINTS, null=0.0, kind="level", p_drop=P_DROP, setup=PAPER_SETUPS["table1"],
               text=f"{change:+.2f} ({sum(heads) / len(heads):.2f} vs 81.7)"),
         lambda p: head_pass_change(results_dir, p)),
        (Claim("Table 2", "share of positions where all 5 heads agree", TABLE2_AGREEMENT[5], TABLE2_AGREEMENT[5],
               "share", SHARE_TOLERANCE, p_drop=P_DROP, setup=PAPER_SETUPS["table2"]),
         lambda p: all_heads_agree(results_dir, p)),
    ]
    for paper_p in FIG3_P_DROPS:
        out.append((Claim("Fig. 3", f"mean pairwise sentence cosine of the K=5 paths (paper p_drop {paper_p:g})",
                          FIG3_HIGH_COSINE, 1.0, "cosine", p_drop=paper_p, setup=PAPER_SETUPS["fig3"],
                          text=f"high (no numbers printed; read as >= {FIG3_HIGH_COSINE:g})"),
                    lambda p: table_value(results_dir, "fig3_path_similarity.csv", p, "mean off-diagonal cosine",
                                          "cosine")))
    for case, values in TABLE3_JS.items():
        for value, column, what in zip(values, ("js_draft", "js_heads"), ("JS(c, draft)", "radius JS(c, heads)"),
                                       strict=True):
            out.append((Claim("Table 3", f"{what}, {case} positions", value, value, "nats", JS_RELATIVE_TOLERANCE,
                              relative=True, p_drop=P_DROP, setup=PAPER_SETUPS["table3"]),
                        lambda p, case=case, column=column: table_value(
                            results_dir, "table3_js_radii.csv", p, column, column, where=("case", case))))
    return out


def overhead_claims(results_dir: Path) -> Claims:
    """Table 4: head overhead in % of the verify step (notebook 07's overhead.csv; rules
    ``dropmatch <criterion> p=<p> (<dtype>)``, the bfloat16 heads where measured)."""
    def measure(criterion):
        def at(p):
            table = report.read_table(results_dir, "overhead.csv")
            if table is None or "rule" not in table.columns:
                return missing("no overhead.csv (notebook 07 measures it)", p)
            rows = table[table["rule"].str.contains(f"dropmatch {criterion} ", regex=False)]
            rows = rows.assign(p_drop=rows["rule"].map(lambda r: report.label_value(r, "p")))
            bf16 = rows[rows["rule"].str.contains("bfloat16")]
            return table_value(results_dir, "overhead.csv", p, "head overhead (% of verify step)", "overhead",
                               frame=bf16 if len(bf16) else rows)
        return at

    return [(Claim("Table 4", f"head overhead, K=5 {criterion} (% of the forward / verify step)", 0.0,
                   TABLE4_OVERHEAD_PERCENT[key], "%", OVERHEAD_TOLERANCE_POINTS, p_drop=P_DROP, scale_bound=True,
                   setup=PAPER_SETUPS["table4"], text=f"{TABLE4_OVERHEAD_PERCENT[key]:g} (at most)"), measure(criterion))
            for criterion, key in (("js+majority", "K=5 js"), ("naive", "K=5 naive"))]


def untestable_claims() -> Claims:
    """Results this setup cannot test at all (Table 5: vLLM on A100s; Table 9: LiveCodeBench)."""
    return [
        (Claim("Table 5", "throughput SD+DM / SD at batch 1-128 (vLLM, TP=4)", 1.10, 1.19, "x",
               setup=PAPER_SETUPS["table5"], untestable="needs vLLM on CUDA GPUs (the paper: 4x A100, TP=4); "
               "make bench-vllm measures the CPU analogue outside the notebook series"), lambda p: Measurement()),
        (Claim("Table 9", "tau gain AJ+DM over AJ on LiveCodeBench", 1.053, 1.348, "x", setup=PAPER_SETUPS["table9"],
               untestable="no LiveCodeBench data here"), lambda p: Measurement()),
    ]
