"""Side-by-side tables from result tables."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from dropmatch import report


def _main():
    rows = []
    for task, (sd_tau, dm_tau) in {"gsm8k": (3.0, 4.5), "mmlu": (2.0, 2.2)}.items():
        for L in (5, 10):
            rows.append({"task": task, "name": f"SD L={L}", "tau": sd_tau, "tokens/s": 10.0, "delta_nll": 0.0})
            rows.append({"task": task, "name": f"SD+DM L={L}", "tau": dm_tau, "tokens/s": 12.0, "delta_nll": 0.1})
    return pd.DataFrame(rows)


def test_table6_side_by_side():
    table = report.table6_side_by_side(_main())
    row = table[(table.task == "gsm8k") & (table.L == 5)].iloc[0]
    assert row["our tau gain"] == pytest.approx(0.5) and row["our speedup DM/SD"] == pytest.approx(1.2)
    assert row["paper tau SD"] == 4.97 and row["paper tau gain"] == pytest.approx(5.50 / 4.97 - 1)


def test_largest_p_within():
    table = pd.DataFrame({"criterion": ["js"] * 3 + ["naive"] * 2, "p_drop": [0.01, 0.1, 0.3, 0.01, 0.3],
                          "delta_nll": [0.01, 0.04, 0.2, 0.5, 0.9]})
    assert report.largest_p_within(table, 0.05) == {"js": 0.1, "naive": 0.0}


def test_side_by_side_uses_what_exists(tmp_path):
    report.table6_side_by_side(_main()).to_csv(tmp_path / "table6_side_by_side.csv", index=False)
    pd.DataFrame({"task": ["komt_bench", "komt_bench"], "name": ["SD", "SD+DM"], "tau": [2.0, 3.0]}).to_csv(
        tmp_path / "table10_korean.csv", index=False)
    overhead = pd.DataFrame({"rule": ["standard", "dropmatch js+majority (bfloat16 heads)"],
                             "head overhead (% of verify step)": [0.0, 12.5]})
    table = report.side_by_side(tmp_path, overhead, 0.03, "ours")
    by = dict(zip(table.comparison, table.ours, strict=True))
    assert by["KoMT-bench tau gain SD+DM over SD"] == pytest.approx(0.5)
    assert by["head overhead, K=5 JS (% of the verify step)"] == 12.5
    assert "tau gain SD+DM over SD, gsm8k, L=10" in by
    paper = dict(zip(table.comparison, table.paper, strict=True))
    quality = next(c for c in by if c.startswith("quality cost of SD+DM, gsm8k, L=5"))
    assert by[quality] == pytest.approx(0.1) and paper[quality] == f"{94.29 - 94.69:.3f}"
    assert paper["tau gain SD+DM over SD, gsm8k, L=5"] == f"{5.50 / 4.97 - 1:.3f}"
    assert report.side_by_side(tmp_path / "missing", None, 0.03, "ours").empty


def test_table6_uses_the_paper_tau_decode_speed_and_the_pairs_own_rows():
    main = _main().assign(model="Qwen/Qwen3-32B / Qwen/Qwen3-4B", paper_tau=lambda f: f["tau"] + 1.0,
                          **{"decode tokens/s": lambda f: f["tokens/s"] * ([1.0, 2.0] * 4),
                             "tokens/s pooled": lambda f: f["tokens/s"]})
    row = report.table6_side_by_side(main).query("task == 'gsm8k' and L == 10").iloc[0]
    assert row["paper tau SD"] == 7.87 and "Qwen3-32B" in row["paper setup"]  # Qwen's Table 6 block
    assert row["our tau SD"] == 4.0 and row["our tau gain"] == pytest.approx(5.5 / 4.0 - 1)
    assert row["our speedup DM/SD"] == pytest.approx(2.4) and row["our e2e speedup DM/SD"] == pytest.approx(1.2)
    llama = report.table6_side_by_side(_main()).query("task == 'gsm8k' and L == 10").iloc[0]
    assert llama["paper tau SD"] == 7.62 and "Llama-3.1-70B" in llama["paper setup"]


def test_side_by_side_setups_come_from_each_table(tmp_path):
    report.table6_side_by_side(_main().assign(model="tiny")).to_csv(tmp_path / "table6_side_by_side.csv",
                                                                   index=False)
    pd.DataFrame({"task": ["komt_bench"] * 2, "name": ["SD", "SD+DM"], "tau": [2.0, 3.0], "paper_tau": [3.0, 6.0],
                  "model": ["llama-3.3 / 8b"] * 2}).to_csv(tmp_path / "table10_korean.csv", index=False)
    table = report.side_by_side(tmp_path, None, 0.03, "tiny: target float32 on cpu").set_index("comparison")
    korean = table.loc["KoMT-bench tau gain SD+DM over SD"]
    assert float(korean.ours) == pytest.approx(1.0)  # the paper's tau, not ours
    assert "Llama-3.3-70B" in korean["paper setup"] and korean["our setup"].startswith("llama-3.3 / 8b")
    gsm = table.loc["tau gain SD+DM over SD, gsm8k, L=5"]
    assert gsm["our setup"] == "tiny: target float32 on cpu" and "Llama-3.1-70B" in gsm["paper setup"]
    assert not any("A100" in s for s in table["our setup"])


def test_setup_line_reads_the_loaded_models(tiny):
    from dropmatch.models import ByteTokenizer, CausalLM, ModelPair, int8_draft

    line = report.setup_line(tiny)
    assert line.startswith("tiny-llama: target float32 on cpu, draft float32 on cpu;") and "int8" not in line
    quantized = ModelPair(tiny.target, CausalLM(int8_draft(tiny.target.model), vocab_size=259), ByteTokenizer(), "q")
    assert "draft int8 dynamic on cpu" in report.setup_line(quantized)
    assert "float32" in report.figure_labels(tiny)[1]


def test_label_values_and_the_records_behind_a_row(tmp_path):
    assert report.label_value("dropmatch(js+majority,K=5,p=0.0324)@L10", "p") == 0.0324
    assert report.label_value("judge+dropmatch(t=1e-05,naive,K=5,p=0.3)[judge_path=j]@L5", "t") == 1e-05
    assert report.label_value("SD+DM L=7", "L") == 7 and math.isnan(report.label_value("sd@L5", "p"))
    row = pd.Series({"task": "gsm8k", "model": "tiny llama", "method": "sd@L5"})
    assert report.records_path(tmp_path, row).name == "gsm8k__tiny_llama__sd_L5.jsonl"
    named = pd.Series({**row.to_dict(), "records": "x.jsonl"})  # run_methods' records column wins
    assert report.records_path(tmp_path, named).name == "x.jsonl"
    assert report.records_for(tmp_path, row) is None  # no file
    (tmp_path / "gsm8k__tiny_llama__sd_L5.jsonl").write_text('{"id": "a", "stats": {}}\n')
    assert report.records_for(tmp_path, row) == [{"id": "a", "stats": {}}]


def test_table6_reads_the_paired_columns_of_the_dm_row():
    """SD on 30 prompts, SD+DM on the 10 easiest: the rows' unpaired ratio says +120 %, the paired gain +10 %."""
    main = pd.DataFrame([
        {"task": "gsm8k", "name": "SD L=10", "n": 30, "paper_tau": 2.5, "decode tokens/s": 20.0, "tokens/s pooled": 18.0,
         "tau_gain": 0.0, "tau_gain_lo": 0.0, "tau_gain_hi": 0.0, "speedup": 1.0, "speedup_lo": 1.0, "speedup_hi": 1.0,
         "speedup e2e": 1.0, "speedup e2e_lo": 1.0, "speedup e2e_hi": 1.0},
        {"task": "gsm8k", "name": "SD+DM L=10", "n": 10, "paper_tau": 5.5, "decode tokens/s": 50.0,
         "tokens/s pooled": 45.0, "tau_gain": 0.1, "tau_gain_lo": 0.05, "tau_gain_hi": 0.15, "speedup": 1.1,
         "speedup_lo": 1.0, "speedup_hi": 1.2, "speedup e2e": 1.08, "speedup e2e_lo": 0.99, "speedup e2e_hi": 1.17}])
    row = report.table6_side_by_side(main).iloc[0]
    assert row["paired"] and row["our tau gain"] == pytest.approx(0.1)
    assert (row["our tau gain lo"], row["our tau gain hi"]) == pytest.approx((0.05, 0.15))
    assert (row["our speedup DM/SD"], row["our speedup DM/SD lo"], row["our speedup DM/SD hi"]) == (1.1, 1.0, 1.2)
    assert row["our e2e speedup DM/SD"] == 1.08 and row["our e2e speedup DM/SD hi"] == 1.17
    assert row["our tau SD"] == 2.5 and row["our tau SD+DM"] == 5.5  # each row's own tau stays as it is
    old = report.table6_side_by_side(_main()).iloc[0]  # no paired columns: the unpaired ratio, said so
    assert not old["paired"] and math.isnan(old["our tau gain lo"])


def test_records_path_finds_the_file_the_runner_names(tmp_path):
    from dropmatch.errors import ConfigError

    row = pd.Series({"task": "gsm8k", "model": "gemma-3-270m", "method": "sd@L5"})  # no records column
    written = tmp_path / "gsm8k__gemma-3-270m__sd_L5__seed0-new128-prefix0123abcdef.jsonl"  # run_methods' name (prefix cached)
    written.write_text('{"id": "a", "stats": {}}\n')
    (tmp_path / "gsm8k__gemma-3-270m__sd_L5__seed0-new128-0123456789.jsonl").write_text("")  # another naming
    assert report.records_path(tmp_path, row) == written
    assert report.records_for(tmp_path, row) == [{"id": "a", "stats": {}}]
    (tmp_path / "gsm8k__gemma-3-270m__sd_L5__seed1-new128.jsonl").write_text("")  # without a cached prefix
    with pytest.raises(ConfigError, match="several record files match sd@L5 on gsm8k.*seed0-new128-prefix.*seed1-new128"):
        report.records_path(tmp_path, row)
