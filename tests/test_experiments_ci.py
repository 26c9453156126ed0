"""Intervals over prompts in the result tables, per-example seeds, task budgets and the presets' parameters."""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import pandas as pd
import papermill
import pytest
from scipy.stats import binomtest

from dropmatch import experiments, reproduce
from dropmatch.errors import ConfigError
from dropmatch.intervals import bootstrap_ci, paired_ratio_ci, pooled_ratio_ci
from dropmatch.methods import MethodConfig
from dropmatch.paths import data_dir
from dropmatch.stats import GenerationStats
from dropmatch.summarize import summarize_records
from dropmatch.tasks import load_task

needs_data = pytest.mark.skipif(not (data_dir() / "gsm8k").is_dir(), reason="benchmark data directory not found")

INTERVAL_COLUMNS = ("tau", "paper_tau", "tokens/s", "decode tokens/s", "mean", "exact_match_rate", "delta_nll",
                    "speedup", "speedup e2e", "tau_gain", "agreement")


def _records(method: str, speed: float, seed: int, n: int = 12) -> list[dict]:
    """Synthetic GSM8K records of one method: prompts of varying length, ``speed`` times faster decoding."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        new = int(rng.integers(20, 60))
        calls = max(2, int(new / rng.uniform(1.5, 4.0)))
        prefill = 0.5
        stats = GenerationStats(new_tokens=new, target_calls=calls, prefill_s=prefill,
                                wall_s=prefill + new / (10 * speed * rng.uniform(0.7, 1.3))).to_dict()
        greedy_nll = float(rng.uniform(0.5, 1.5))
        answer = str(i if rng.random() < 0.7 else 1000 + i)
        out.append({"id": f"gsm8k/{i}", "task": "gsm8k", "method": method, "output": f"... #### {answer}",
                    "score": {"exact_match": float(rng.random() < 0.4)}, "stats": stats,
                    "fidelity": {"exact_match": bool(rng.random() < 0.5), "nll": greedy_nll + rng.uniform(0, 0.3),
                                 "greedy_nll": greedy_nll}})
    return out


def test_every_estimate_has_an_interval_that_brackets_it():
    rows = {r["method"]: r for r in summarize_records(_records("sd@L5", 1.0, 0) + _records("dropmatch(x)@L5", 1.3, 1))}
    dm, sd = rows["dropmatch(x)@L5"], rows["sd@L5"]
    for column in INTERVAL_COLUMNS:
        assert dm[f"{column}_lo"] <= dm[column] <= dm[f"{column}_hi"], column
        assert dm[f"{column}_lo"] < dm[f"{column}_hi"], column  # 12 varied prompts: a real interval
    assert dm["ci95"] == f"[{dm['mean_lo']:.3f}, {dm['mean_hi']:.3f}]"
    assert dm["delta_nll"] == pytest.approx(dm["nll"] - dm["greedy_nll"])
    assert dm["tau_gain"] == pytest.approx(dm["paper_tau"] / sd["paper_tau"] - 1)
    assert dm["speedup"] == pytest.approx(dm["decode tokens/s"] / sd["decode tokens/s"])
    # the baseline against itself: paired resamples of the same prompts leave no spread
    assert (sd["speedup_lo"], sd["speedup"], sd["speedup_hi"]) == pytest.approx((1.0, 1.0, 1.0))
    assert (sd["tau_gain"], sd["agreement"], sd["agreement_lo"]) == pytest.approx((0.0, 1.0, 1.0))


def test_paired_interval_of_a_ratio_constant_per_prompt_collapses():
    base_tokens = np.array([10.0, 50.0, 20.0, 80.0])
    base_seconds = np.array([1.0, 9.0, 2.0, 3.0])  # speeds vary a lot from prompt to prompt
    assert paired_ratio_ci(base_tokens, base_seconds / 2, base_tokens, base_seconds) == pytest.approx((2.0, 2.0))
    low, high = pooled_ratio_ci(base_tokens, base_seconds)  # unpaired, the same spread shows
    assert low < base_tokens.sum() / base_seconds.sum() < high
    assert bootstrap_ci([0, 1] * 50) == pooled_ratio_ci([0, 1] * 50, [1] * 100)  # same resamples, same interval


def test_example_seeds_are_stable_and_differ():
    assert experiments.example_seed(0, "gsm8k/7") == zlib.crc32(b"0/gsm8k/7") == 2446816147
    assert experiments.example_seed(0, "gsm8k/7", 2) == zlib.crc32(b"0/gsm8k/7/2")
    seeds = {experiments.example_seed(s, f"gsm8k/{i}") for s in range(3) for i in range(200)}
    assert len(seeds) == 600


def test_token_budget_is_the_tasks_own_capped():
    assert experiments.token_budget("gsm8k") == 256 and experiments.token_budget("mmlu", 128) == 4
    assert experiments.token_budget("gsm8k", None, {"gsm8k": 128}) == 128
    assert experiments.token_budget("gsm8k", 16, {"gsm8k": 128}) == 16  # a run-wide cap still caps
    assert experiments.token_budget("humaneval", 512, {}) == 384


@needs_data
def test_run_methods_and_run_cells_return_intervals(tiny, tmp_path, one_thread):
    cells = {"SD": (MethodConfig("sd"), 3), "DM": (MethodConfig("dropmatch", p_drop=0.3), 3),
             "DM eq": (MethodConfig("dropmatch", p_drop=0.03), 2)}
    table = experiments.run_cells(tiny, "klue_nli", cells, tmp_path, baseline="SD", progress=False)
    assert list(table.name) == ["SD", "DM", "DM eq"] and list(table.n) == [3, 3, 2]
    assert (table.max_new_tokens == 4).all() and all((tmp_path / f).exists() for f in table.records)
    for column in INTERVAL_COLUMNS + ("draft_acceptance", "verify_ms_per_step"):
        assert ((table[f"{column}_lo"] <= table[column] + 1e-12) & (table[column] <= table[f"{column}_hi"] + 1e-12)
                | table[column].isna()).all(), column
    sd = table.iloc[0]
    assert sd.speedup == 1.0 and sd.agreement == 1.0 and sd.tau_gain == 0.0
    with pytest.raises(ConfigError, match="more than its baseline"):
        experiments.run_cells(tiny, "klue_nli", {"SD": (MethodConfig("sd"), 1), "DM": (MethodConfig("dropmatch"), 2)},
                              tmp_path, baseline="SD", progress=False)


@needs_data
def test_dropout_paths_depend_on_the_seed(tiny, tmp_path, one_thread):
    examples = load_task("humaneval", limit=2)

    def paths(seed):
        return experiments.dropout_paths(tiny, examples, [0.0, 0.5], k=3, max_new_tokens=8, results_dir=tmp_path,
                                         seed=seed, progress=False)

    first, other = paths(0), paths(1)
    assert len(list(tmp_path.glob("dropout_paths__humaneval__*__seed*.jsonl"))) == 2  # one file per seed
    noisy = [(a["token_ids"], b["token_ids"]) for a, b in zip(first, other, strict=True) if a["p_drop"] == 0.5]
    assert any(a != b for a, b in noisy)  # other seed, other masks
    assert len({tuple(r["token_ids"]) for r in first if r["p_drop"] == 0.5}) > 1  # heads and examples differ too
    assert len({r["seed"] for r in first}) == 2 * 3  # a seed per (example, head)
    for ex in examples:  # no dropout: every head is the greedy path, whatever the seed
        greedy = [r["token_ids"] for r in first + other if r["id"] == ex.id and r["p_drop"] == 0.0]
        assert len(greedy) == 6 and all(g == greedy[0] for g in greedy)
    assert paths(0) == first  # resumed from its own file


def test_a_pooled_share_with_one_ratio_across_prompts_has_the_exact_interval():
    # one prompt holds all four accepted mismatches, one of them outside the top 5: every resample pools to
    # 1/4, so the bootstrap has no width; with the share's range known, the interval is the exact one
    # over the one prompt that contributes (prompts without mismatches say nothing about the share)
    r = 1 - binomtest(1, 1).proportion_ci(confidence_level=0.95, method="exact").low
    outside, mismatches = [1, 0, 0, 0, 0], [4, 0, 0, 0, 0]
    assert pooled_ratio_ci(outside, mismatches) == (0.25, 0.25)  # no range given: the bootstrap's own interval
    assert pooled_ratio_ci(outside, mismatches, bounds=(0.0, 1.0)) == pytest.approx((0.25 - 0.25 * r,
                                                                                     0.25 + 0.75 * r))
    # five prompts of different sizes that all give 1/2: as five equal per-prompt values
    halves = pooled_ratio_ci([1, 2, 3, 4, 5], [2, 4, 6, 8, 10], bounds=(0.0, 1.0))
    assert halves == pytest.approx(bootstrap_ci([0.5] * 5, bounds=(0.0, 1.0)))
    # ratios that differ: the bootstrap, as before
    assert pooled_ratio_ci([1, 0, 2], [2, 3, 4], bounds=(0.0, 1.0)) == pooled_ratio_ci([1, 0, 2], [2, 3, 4])


@needs_data
def test_head_agreement_by_p_has_intervals(tiny, tmp_path, one_thread):
    examples = load_task("humaneval", limit=3)
    table = experiments.agreement_by_p(tiny, examples, [0.0, 0.5], 8, tmp_path, k=3)
    all_agree = table[table.agreeing_heads == 3].set_index("p_drop")
    assert all_agree.loc[0.0, "share"] == 1.0 and (all_agree.n == 3).all()
    # every prompt gives share 1 at p = 0: the exact interval over 3 prompts, not a zero-width [1, 1]
    exact_low = binomtest(3, 3).proportion_ci(confidence_level=0.95, method="exact").low
    assert (all_agree.loc[0.0, "share_lo"], all_agree.loc[0.0, "share_hi"]) == pytest.approx((exact_low, 1.0))
    assert ((table.share_lo <= table.share) & (table.share <= table.share_hi)).all()
    assert table.groupby("p_drop").share.sum().round(9).eq(1.0).all()


@needs_data
def test_js_radii_by_p_split_the_positions_of_table2(tiny, tmp_path, one_thread):
    examples = load_task("humaneval", limit=3)
    radii = experiments.js_radii_by_p(tiny, examples, [0.0, 0.5], 8, tmp_path, k=3).set_index(["p_drop", "case"])
    agreement = experiments.agreement_by_p(tiny, examples, [0.0, 0.5], 8, tmp_path, k=3)
    for p in (0.0, 0.5):
        everywhere = agreement[agreement.p_drop == p]
        unanimous = everywhere[everywhere.agreeing_heads == 3]
        assert radii.loc[(p, "concentrated"), "positions"] == round(float(unanimous.share.iloc[0]) * everywhere.positions.iloc[0])
        assert radii.loc[[(p, "concentrated"), (p, "dispersed")], "positions"].sum() == everywhere.positions.iloc[0]
    assert radii.loc[(0.0, "dispersed"), "n"] == 0 and np.isnan(radii.loc[(0.0, "dispersed"), "js_heads"])
    calm = radii.loc[(0.0, "concentrated")]  # every head is the target: radius 0, the draft outside it
    assert calm.n == 3 and abs(calm.js_heads) < 1e-6 and calm.js_draft > 0 and calm.inside_share == 0.0
    noisy = radii.loc[0.5]
    noisy = noisy[noisy.n > 0]
    for column in ("js_draft", "js_heads", "inside_share"):
        assert ((noisy[f"{column}_lo"] <= noisy[column]) & (noisy[column] <= noisy[f"{column}_hi"])).all()
    assert (noisy.js_heads > 0).all()


def _declared() -> dict[str, set[str]]:
    return {nb.name: set(papermill.inspect_notebook(str(nb))) for nb in reproduce.notebooks()}


RUN_WIDE = {"preset", "notebooks", "device_map", "llm_judge"}


def test_every_preset_parameter_is_declared_by_some_notebook():
    declared = set().union(*_declared().values())
    for name, preset in reproduce.PRESETS.items():
        unknown = set(preset) - declared - RUN_WIDE
        assert not unknown, f"preset {name} sets parameters no notebook declares: {sorted(unknown)}"


def test_headline_cells_get_30_prompts_by_default():
    declared = {nb.name: papermill.inspect_notebook(str(nb)) for nb in reproduce.notebooks()}
    for prefix in ("03_", "04_", "05_"):
        (params,) = [v for k, v in declared.items() if k.startswith(prefix)]
        assert reproduce.parse_value(params["n_headline"]["default"]) >= 30


def test_unknown_baseline_or_lossless_names_are_refused_before_any_decoding(tiny, tmp_path):
    configs = {"SD": MethodConfig("sd"), "DM": MethodConfig("dropmatch")}
    with pytest.raises(ConfigError, match="baseline 'sd' is not one of the cells"):
        experiments.run_cells(tiny, "klue_nli", {k: (c, 1) for k, c in configs.items()}, tmp_path, baseline="sd",
                              progress=False)
    for role in ("baseline", "lossless"):
        with pytest.raises(ConfigError, match=f"{role} 'AR' is not one of the configs"):
            experiments.run_methods(tiny, "klue_nli", configs, tmp_path, n_prompts=1, progress=False, **{role: "AR"})
    assert not list(tmp_path.iterdir())  # refused before anything was decoded


def test_tables_over_nothing_are_refused_with_what_is_missing(monkeypatch, tmp_path):
    for call in (lambda: experiments.acceptance_sweep(None, [], [0.3], ["js"], 16, tmp_path),
                 lambda: experiments.agreement_by_p(None, [], [0.3], 16, tmp_path),
                 lambda: experiments.js_radii_by_p(None, [], [0.3], 16, tmp_path),
                 lambda: experiments.dropout_paths(None, [], [0.3], 5, 16, tmp_path, progress=False)):
        with pytest.raises(ConfigError, match="no examples given"):
            call()
    with pytest.raises(ConfigError, match="no path records given"):
        experiments.head_scores([], {}, "pass@1")
    examples = [SimpleNamespace(id=f"e{i}", prompt="p", task="gsm8k") for i in range(3)]
    pair = SimpleNamespace(encode=lambda text: [1, 2])
    with pytest.raises(ConfigError, match="no p_drop values given"):
        experiments.agreement_by_p(pair, examples, [], 16, tmp_path)
    monkeypatch.setattr(experiments, "greedy_answers", lambda pair, examples, budget, results: [[7] for _ in examples])
    with pytest.raises(ConfigError, match="no example has a greedy answer of >= 2 tokens to probe"):
        experiments.acceptance_sweep(pair, examples, [0.3], ["js"], 16, tmp_path)
    monkeypatch.setattr(experiments, "greedy_answers", lambda pair, examples, budget, results: [[] for _ in examples])
    for table in (experiments.agreement_by_p, experiments.js_radii_by_p):
        with pytest.raises(ConfigError, match="no example has a non-empty greedy answer"):
            table(pair, examples, [0.3], 16, tmp_path)


def test_outside_top5_share_is_undefined_without_accepted_mismatches(monkeypatch, tmp_path):
    def probe(pair, prompt, answer, p_values, criteria, k, seed):  # naive at p_drop 0: no mismatch accepted
        return [{"p_drop": p, "criterion": c, "positions": 4, "exact_match_rate": 0.5, "acceptance_rate": 0.5,
                 "accepted_mismatches": 0, "outside_top5_share": 0.0} for p in p_values for c in criteria]

    monkeypatch.setattr(experiments.analysis, "acceptance_probe", probe)
    monkeypatch.setattr(experiments, "greedy_answers", lambda pair, examples, budget, results: [[5, 6, 7, 8]] * 3)
    examples = [SimpleNamespace(id=f"e{i}", prompt="p", task="gsm8k") for i in range(3)]
    row = experiments.acceptance_sweep(SimpleNamespace(encode=lambda text: [1]), examples, [0.0], ["naive"], 16,
                                       tmp_path).iloc[0]
    assert row.n == 3 and row.acceptance_rate == 0.5
    assert np.isnan([row.outside_top5_share, row.outside_top5_share_lo, row.outside_top5_share_hi]).all()


def test_token_budget_refuses_caps_below_one():
    with pytest.raises(ConfigError, match="max_new_tokens caps gsm8k at 0 new tokens"):
        experiments.token_budget("gsm8k", 0)
    with pytest.raises(ConfigError, match="task_budgets caps gsm8k at -5"):
        experiments.token_budget("gsm8k", None, {"gsm8k": -5})
    assert experiments.token_budget("gsm8k", 1) == 1


def test_draft_acceptance_pools_the_drafted_tokens(monkeypatch, tmp_path):
    def record(i, accepted, drafted, verify_s, new):
        stats = GenerationStats(new_tokens=new, target_calls=1 + len(accepted), accepted_per_step=accepted,
                                drafted_per_step=drafted, verify_s=verify_s, wall_s=1.0, prefill_s=0.1)
        return {"id": f"p{i}", "output": "x", "score": {"exact_match": 0.0}, "stats": stats.to_dict()}

    def run_task(decoder, task, out, **kwargs):
        if decoder.config.method == "ar":  # no verify step, nothing drafted
            return [record(i, [], [], 0.0, 20) for i in range(4)]
        # SD: prompt p0 stops at its first token, before any draft; the others accept 8 of 10
        return [record(0, [], [], 0.0, 1)] + [record(i, [4, 4], [5, 5], 0.02, 11) for i in range(1, 4)]

    monkeypatch.setattr(experiments, "run_task", run_task)
    monkeypatch.setattr(experiments, "Decoder", lambda pair, config: SimpleNamespace(config=config))
    table = experiments.run_methods(SimpleNamespace(name="fake"), "gsm8k",
                                    {"AR": MethodConfig("ar"), "SD": MethodConfig("sd", draft_len=5)}, tmp_path,
                                    n_prompts=4, fidelity=False, baseline="AR", progress=False,
                                    prefix_cache=False).set_index("name")  # a fake pair has no tokenizer
    assert table.loc["SD", "draft_acceptance"] == pytest.approx(24 / 30)  # not (0 + 3 * 0.8) / 4
    assert table.loc["SD", "verify_ms_per_step"] == pytest.approx(10.0)
    ar = table.loc["AR", ["draft_acceptance", "draft_acceptance_lo", "draft_acceptance_hi", "verify_ms_per_step",
                          "verify_ms_per_step_lo", "extra_accepts_per_step"]]
    assert ar.isna().all()


@needs_data
def test_dropout_paths_create_their_results_dir(tiny, tmp_path, one_thread):
    results = tmp_path / "not" / "yet"
    records = experiments.dropout_paths(tiny, load_task("gsm8k", limit=1), [0.3], k=2, max_new_tokens=3,
                                        results_dir=results, progress=False)
    assert len(records) == 2 and len(list(results.glob("dropout_paths__gsm8k__*.jsonl"))) == 1


def test_head_scores_count_the_prompts_each_estimate_rests_on():
    paths = [{"id": f"p{i}", "p_drop": 0.3, "head": 0, "score": {"pass@1": 1.0}, "token_ids": [1],
              "nll": float("nan") if i < 2 else 1.0 + i} for i in range(5)]  # two empty paths: no NLL
    row = experiments.head_scores(paths, {f"p{i}": [1] for i in range(5)}, "pass@1").iloc[0]
    assert (row.n, row.n_nll) == (5, 3) and row.nll == pytest.approx(4.0) and row.nll_lo < row.nll < row.nll_hi


def test_figure_title_of_no_rows():
    pair = SimpleNamespace(name="m")
    assert experiments.figure_title("x", pair, "gsm8k", pd.Series([], dtype=int)) == "x\nm, gsm8k, n = 0 prompts"
    assert experiments.figure_title("x", pair, "gsm8k", [3, 5, 3]).endswith("n = 3-5 prompts")


def test_nll_estimates_and_intervals_leave_out_the_same_undefined_prompts():
    records = _records("sd@L5", 1.0, 0, n=30)
    records[7]["fidelity"]["nll"] = float("nan")  # empty after its stop string: no NLL
    row = summarize_records(records)[0]
    kept = [r["fidelity"] for i, r in enumerate(records) if i != 7]
    delta = [f["nll"] - f["greedy_nll"] for f in kept]
    assert row["n"] == 30 and row["n_nll"] == 29
    assert row["delta_nll"] == pytest.approx(np.mean(delta)) and row["nll"] == pytest.approx(np.mean([f["nll"] for f in kept]))
    assert (row["delta_nll_lo"], row["delta_nll_hi"]) == pytest.approx(bootstrap_ci(delta))
    assert row["delta_nll_lo"] < row["delta_nll"] < row["delta_nll_hi"]
