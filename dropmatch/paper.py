"""The paper's reported numbers (arXiv 2603.03333 v1, from ../shared/reference/PAPER.md), for the
side-by-side tables. Model pairs and hardware are recorded with each comparison."""

from __future__ import annotations

# The paper's tau ("mean acceptance length") counts the tokens each verify step emits, the bonus /
# correction token included (EAGLE3 at L=5 reaches 5.82 > 5); ours is GenerationStats.paper_tau.
TAU_DEFINITION = "paper tau: tokens emitted per verify step (bonus included), the prefill's token left out"

# The setup each table states (PAPER.md section 2); "[not stated]" where the paper gives none.
PAPER_SETUPS = {
    "table6_llama": "Llama-3.1-70B-Instruct / Llama-3.1-8B-Instruct, 4x A100-SXM4-80G, vLLM TP=4, bs=1",
    "table6_qwen": "Qwen3-32B / Qwen3-4B, 4x A100-SXM4-80G, vLLM TP=4, bs=1",
    "table10": "Llama-3.3-70B-Instruct / Llama-3.1-8B-Instruct, L=7, bs=1 (hardware not stated)",
    "table4": "Llama-3.1-70B-Instruct, bs=1, n_input=5, p_drop=0.3 (hardware not stated)",
    "table2": "Llama-3.1-70B-Instruct, HumanEval, K=5, p_drop=0.3",
    "table8": "Llama-3.1-70B-Instruct / Llama-3.1-8B-Instruct, Auto-Judge repo, GSM8K 8-shot, L=32, bs=1",
    "table1": "Llama-3.1-70B-Instruct, HumanEval, K=5 dropout heads decoded alone",
    "table3": "Llama-3.1-70B-Instruct / Llama-3.1-8B-Instruct, K=5, p_drop=0.3 (task not stated)",
    "table5": "Llama-3.1-70B-Instruct / Llama-3.1-8B-Instruct, GSM8K, L=10, 4x A100, vLLM TP=4, bs 1-128",
    "table7": "Llama-3.3-70B-Instruct + EAGLE3 head, naive, K=5, p_drop=0.3, 80 samples per task, GPT-4 judge",
    "table9": "Llama-3.1-70B-Instruct / Llama-3.1-8B-Instruct, Auto-Judge, LiveCodeBench",
    "fig1a": "Llama-3.1-70B-Instruct, Auto-Judge head trained on math [read off figure]",
    "fig1b": "Llama-3.3-70B-Instruct + English-trained EAGLE3 head, L=5 [read off figure]",
    "fig3": "Llama-3.1-70B-Instruct, Spec-Bench, K=5, Sentence-BERT cosine [no numbers printed]",
    "fig5": "Llama-3.1-70B-Instruct / Llama-3.1-8B-Instruct, Auto-Judge (+ DM p_drop 0.2, 0.3), GSM8K 8-shot",
    "fig6": "Llama-3.1-70B-Instruct / Llama-3.1-8B-Instruct, IFEval, math-trained judge, p_drop=0.3 [read off]",
}
PAPER_SETUP = PAPER_SETUPS["table6_llama"]

# The models of each table, for runs that reproduce it (the paper preset).
PAPER_MODELS = {
    "table6_llama": ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    "table6_qwen": ("Qwen/Qwen3-32B", "Qwen/Qwen3-4B"),
    "table10": ("meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    "table8": ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    "table7_eagle3_head": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",  # the EAGLE-3 head for table10's target
}

# Table 6, Llama-3.1-8B/70B-Instruct, JS criterion, K=5, p_drop=0.3: (task, L) -> (tau SD, tau SD+DM, acc SD, acc SD+DM,
# speedup of SD+DM over SD at the same L [derived])
TABLE6_LLAMA = {
    ("gsm8k", 5): (4.97, 5.50, 94.69, 94.29, 1.10),
    ("mmlu", 5): (4.02, 4.43, 85.94, 85.50, 1.09),
    ("ifeval", 5): (4.12, 4.48, 85.60, 85.24, 1.10),
    ("humaneval", 5): (5.40, 5.57, 81.70, 79.89, 1.00),
    ("gsm8k", 10): (7.62, 9.20, 95.40, 93.90, 1.196),
    ("mmlu", 10): (5.25, 6.06, 86.06, 85.34, 1.186),
    ("ifeval", 10): (5.47, 6.34, 86.86, 86.17, 1.138),
    ("humaneval", 10): (8.87, 9.38, 81.70, 78.70, 0.991),
}

# Table 6, Qwen3-4B/32B, same layout as TABLE6_LLAMA (speedup at the same L derived from the printed ratios
# against SD at L=5: e.g. GSM8K L=10 1.13 / 0.96)
TABLE6_QWEN = {
    ("gsm8k", 5): (5.06, 5.66, 86.20, 87.49, 1.07),
    ("mmlu", 5): (4.62, 5.15, 83.21, 82.15, 1.05),
    ("ifeval", 5): (3.40, 4.22, 80.72, 78.24, 1.19),
    ("humaneval", 5): (5.09, 5.27, 90.4, 90.9, 1.00),
    ("gsm8k", 10): (7.87, 9.78, 86.20, 86.58, 1.177),
    ("mmlu", 10): (6.48, 8.60, 83.26, 82.06, 1.330),
    ("ifeval", 10): (4.04, 5.67, 82.31, 81.60, 1.361),
    ("humaneval", 10): (8.11, 8.72, 92.1, 90.2, 1.061),
}


def table6_for(model: str | None) -> tuple[str, dict]:
    """The Table 6 block (setup key, numbers) of a pair's family: Qwen rows for a Qwen model, else Llama's."""
    return ("table6_qwen", TABLE6_QWEN) if model and "qwen" in model.lower() else ("table6_llama", TABLE6_LLAMA)


# Table 10, KoMT-bench, L=7, Llama-3.3-70B target / Llama-3.1-8B draft: (score, tau)
TABLE10_KOMT = {"standard": (8.08, 4.85), "eagle3": (7.96, 1.46), "standard+dm": (8.12, 5.24)}

# Table 4: head overhead, Llama-3.1-70B-Instruct, bs=1, n_input=5, p_drop=0.3: percent of the forward pass
TABLE4_OVERHEAD_PERCENT = {"w/o dropout": 0.05, "K=5 naive": 0.17, "K=5 js": 1.64}

# Table 2: share of HumanEval positions where m of the K=5 heads agree (Llama-3.1-70B-Instruct, p_drop=0.3)
TABLE2_AGREEMENT = {1: 0.0000, 2: 0.0014, 3: 0.0082, 4: 0.0054, 5: 0.9840}

# Table 1: HumanEval pass@1 of each dropout head (70B; baseline 81.7, draft 72.6)
TABLE1_HEAD_PASS = {0.1: (81.1, 78.7, 81.1, 86.0, 77.4), 0.2: (80.5, 81.1, 80.5, 81.1, 78.7),
                    0.3: (78.7, 81.1, 75.6, 77.4, 79.9), 0.4: (76.2, 79.3, 80.5, 73.2, 76.2),
                    0.5: (78.7, 65.2, 73.8, 64.0, 70.1)}

# Table 8: Auto-Judge vs Auto-Judge + DM on GSM8K (8-shot), Llama-3.1-8B/70B: threshold -> (acc AJ, tok/s AJ,
# acc AJ+DM, tok/s AJ+DM)
TABLE8_AUTOJUDGE = {0.014: (95.1, 57.4, 94.1, 73.9), 0.022: (94.3, 62.2, 93.9, 77.6),
                    0.112: (91.4, 84.8, 93.0, 90.4), 0.281: (88.2, 90.1, 90.7, 95.9)}

HIDDEN_SIZE = {"Llama-3.1-70B": 8192, "Llama-3.1-8B": 4096, "Qwen3-32B": 5120, "Qwen3-4B": 2560, "Gemma-3-270M": 640}

# The p_drop of every main result (Tables 4, 6-9, Fig. 6); Fig. 3 also shows 0.1.
P_DROP = 0.3
FIG3_P_DROPS = (0.1, 0.3)

# The abstract's range of SD + DM speed-ups over SD (Table 6) and Table 8's of AJ + DM over Auto-Judge.
HEADLINE_SPEEDUP_RANGE = (1.09, 1.33)
TABLE8_SPEEDUP_RANGE = (1.06, 1.29)

# Table 3: mean JS divergence to the centroid c of the K heads: case -> (JS(c, draft), JS(c, heads))
TABLE3_JS = {"dispersed": (0.0254, 0.0313), "concentrated": (0.0097, 0.0014)}

# Table 7, Llama-3.3-70B EAGLE3, naive, K=5, p_drop=0.3, vs autoregressive: (task, L) ->
# (speedup EAGLE3, tau EAGLE3, speedup EAGLE3+DM, tau EAGLE3+DM)
TABLE7_EAGLE3 = {("gsm8k", 5): (4.19, 5.82, 4.32, 6.09), ("gsm8k", 7): (4.65, 6.71, 4.86, 7.07),
                 ("gsm8k", 9): (4.68, 6.71, 5.03, 7.48), ("mt_bench", 5): (3.90, 5.37, 4.13, 5.86),
                 ("mt_bench", 7): (4.18, 5.81, 4.52, 6.58), ("mt_bench", 9): (4.24, 6.06, 4.62, 6.89),
                 ("alpaca", 5): (4.31, 5.83, 4.47, 6.30), ("alpaca", 7): (4.75, 6.59, 5.02, 7.25),
                 ("alpaca", 9): (4.92, 6.89, 5.27, 7.74)}

# Fig. 1 [read off figure]: (a) task -> (Standard score, Auto-Judge score); (b) task -> (Standard tau,
# EAGLE3 tau) at L=5
FIG1A_AUTOJUDGE = {"gsm8k": (96.0, 91.5), "ifeval": (87.0, 73.5)}
FIG1B_EAGLE3_TAU = {"mt_bench": (4.8, 5.4), "komt_bench": (4.2, 1.45)}

# Fig. 6 [read off figure], IFEval at the most permissive judge threshold: method -> (accuracy, speedup)
FIG6_IFEVAL = {"standard": (86.9, 1.0), "auto-judge": (73.6, 1.92), "auto-judge+dm": (81.4, 2.03)}

# Table 5: throughput of SD + DM over SD by batch size (vLLM, 4x A100)
TABLE5_BATCH = {1: 1.19, 4: 1.18, 16: 1.12, 32: 1.10, 64: 1.15, 128: 1.10}
