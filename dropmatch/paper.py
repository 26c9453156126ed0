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
}
PAPER_SETUP = PAPER_SETUPS["table6_llama"]

# The models of each table, for runs that reproduce it (the paper preset).
PAPER_MODELS = {
    "table6_llama": ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    "table6_qwen": ("Qwen/Qwen3-32B", "Qwen/Qwen3-4B"),
    "table10": ("meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    "table8": ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
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
