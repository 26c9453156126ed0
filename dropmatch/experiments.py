"""The experiments of the notebook series, as resumable functions returning tables (pandas).

Every long computation writes JSON lines under ``results_dir`` and skips what is already there, so
a notebook re-run (or ``make reproduce`` after an interruption) continues instead of starting over.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from . import analysis
from .fidelity import target_nll
from .methods import Decoder, MethodConfig
from .models import ModelPair, load_pair
from .runner import GreedyReference, append_result, read_results, run_task
from .stopping import StopOnText
from .summarize import summarize_records
from .tasks import Example, cut_output, generation_defaults, score
from .tasks.llm_judge import PROMPT_FILES, JudgeEndpoint


def load_models(pair: str | None = "gemma-3-270m", target: str | None = None, draft: str | None = None,
                **kwargs) -> ModelPair:
    """The notebooks' model parameters: a named ``pair``, or ``target`` and ``draft`` ids / directories."""
    return load_pair(None, target=target, draft=draft, **kwargs) if target else load_pair(pair, **kwargs)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", text).strip("_")


def run_methods(pair: ModelPair, task: str, configs: Mapping[str, MethodConfig], results_dir: str | Path, *,
                n_prompts: int | None, max_new_tokens: int | None = None, seed: int = 0, fidelity: bool = True,
                baseline: str | None = None, progress: bool = True,
                llm_judge: JudgeEndpoint | None = None) -> pd.DataFrame:
    """Decode ``task`` with every method (resumable) and return one summary row per method.

    Columns: name, model, method, n, tau (ours) and paper_tau (the paper's), tokens/s (mean over
    examples, end to end), tokens/s pooled, decode tokens/s (pooled, after the prefill), speedup (decode)
    and speedup e2e (vs ``baseline``, a key of ``configs``), the task score and its 95 % interval,
    exact_match_rate / nll / greedy_nll (fidelity), draft acceptance, mean verify-step time (ms) and
    extra accepts per step. MT-bench and KoMT-bench are graded by ``llm_judge``, else by the endpoint
    :func:`judge_from_env` names (none: no LLM grading).
    """
    results_dir = Path(results_dir)
    records: dict[str, list[dict]] = {}
    judge = llm_judge or (judge_from_env() if task in PROMPT_FILES else None)
    for name, config in configs.items():
        out = results_dir / f"{task}__{slug(pair.name)}__{slug(config.label)}.jsonl"
        records[name] = run_task(Decoder(pair, config), task, out, limit=n_prompts, seed=seed,
                                 max_new_tokens=max_new_tokens, fidelity=fidelity, progress=progress,
                                 reference_cache=reference_path(pair, task, results_dir),
                                 llm_judge=judge if task in PROMPT_FILES else None)
    rows = []
    for name, rs in records.items():
        row = summarize_records(rs)[0]
        stats = [r["stats"] for r in rs]
        steps = sum(len(s["accepted_per_step"]) for s in stats)
        row.update(name=name, model=pair.name, draft_acceptance=float(np.mean([s["draft_acceptance_rate"] for s in stats])),
                   verify_ms_per_step=1000 * sum(s["verify_s"] for s in stats) / max(steps, 1),
                   extra_accepts_per_step=sum(s["extra_accepts"] for s in stats) / max(steps, 1))
        rows.append(row)
    table = pd.DataFrame(rows)
    if baseline is not None:
        base = table.loc[table["name"] == baseline].iloc[0]
        table["speedup"] = table["decode tokens/s"] / float(base["decode tokens/s"])
        table["speedup e2e"] = table["tokens/s pooled"] / float(base["tokens/s pooled"])
    return table


JUDGE_SWITCH = "DROPMATCH_LLM_JUDGE"


def judge_from_env() -> JudgeEndpoint | None:
    """The LLM judge of MT-bench / KoMT-bench when ``DROPMATCH_LLM_JUDGE=1`` (the paper preset sets it)
    and an endpoint is configured (``DROPMATCH_JUDGE_URL``, ``DROPMATCH_JUDGE_MODEL``); else ``None``."""
    if os.environ.get(JUDGE_SWITCH, "") not in ("1", "true", "yes"):
        return None
    return JudgeEndpoint.from_env()


def reference_path(pair: ModelPair, task: str, results_dir: str | Path) -> Path:
    """The greedy-reference cache of a pair and task (its records are keyed by budget and prompt)."""
    return Path(results_dir) / f"greedy__{task}__{slug(pair.name)}.jsonl"


def greedy_answers(pair: ModelPair, examples: Sequence[Example], max_new_tokens: int,
                   results_dir: str | Path) -> list[list[int]]:
    """The target's greedy answers (cached), ending at the task's stop strings."""
    references: dict[str, GreedyReference] = {}
    for task in {ex.task for ex in examples}:
        references[task] = GreedyReference(pair, generation_defaults(task).stop, max_new_tokens,
                                           reference_path(pair, task, results_dir))
    return [references[ex.task](ex.prompt) for ex in examples]


def acceptance_sweep(pair: ModelPair, examples: Sequence[Example], p_values: Sequence[float],
                     criteria: Sequence[str], max_new_tokens: int, results_dir: str | Path, k: int = 5,
                     seed: int = 0) -> pd.DataFrame:
    """Teacher-forced acceptance per (p_drop, criterion), pooled over the examples' greedy answers."""
    rows = []
    for ex, answer in zip(examples, greedy_answers(pair, examples, max_new_tokens, results_dir), strict=True):
        if len(answer) < 2:
            continue
        for row in analysis.acceptance_probe(pair, pair.encode(ex.prompt), answer, p_values, criteria, k, seed):
            rows.append({"id": ex.id, **row})
    table = pd.DataFrame(rows)
    pooled = table.assign(accepted=table.acceptance_rate * table.positions,
                          exact=table.exact_match_rate * table.positions,
                          outside=table.outside_top5_share * table.accepted_mismatches)
    pooled = pooled.groupby(["p_drop", "criterion"], as_index=False)[
        ["positions", "accepted", "exact", "accepted_mismatches", "outside"]].sum()
    pooled["acceptance_rate"] = pooled.accepted / pooled.positions
    pooled["exact_match_rate"] = pooled.exact / pooled.positions
    pooled["outside_top5_share"] = pooled.outside / pooled.accepted_mismatches.clip(lower=1)
    return pooled[["p_drop", "criterion", "positions", "exact_match_rate", "acceptance_rate", "outside_top5_share"]]


def agreement_by_p(pair: ModelPair, examples: Sequence[Example], p_values: Sequence[float], max_new_tokens: int,
                   results_dir: str | Path, k: int = 5, seed: int = 0) -> pd.DataFrame:
    """Share of positions where m of the K heads agree on the majority token (paper Table 2), per p_drop."""
    answers = greedy_answers(pair, examples, max_new_tokens, results_dir)
    rows = []
    for p in p_values:
        counts, probs = [], []
        for ex, answer in zip(examples, answers, strict=True):
            if answer:
                result = analysis.head_agreement(pair, pair.encode(ex.prompt), answer, k=k, p_drop=p, seed=seed)
                counts.append(result["majority_count"])
                probs.append(result["majority_prob"])
        counts_all, probs_all = np.concatenate(counts), np.concatenate(probs)
        for m in range(1, k + 1):
            sel = counts_all == m
            rows.append({"p_drop": p, "agreeing_heads": m, "share": float(sel.mean()),
                         "mean_prob": float(probs_all[sel].mean()) if sel.any() else float("nan")})
    return pd.DataFrame(rows)


def dropout_paths(pair: ModelPair, examples: Sequence[Example], p_values: Sequence[float], k: int,
                  max_new_tokens: int, results_dir: str | Path, seed: int = 0, progress: bool = True) -> list[dict]:
    """K free-running dropout paths per example and p_drop (resumable); each record carries the path's
    text, task score and target NLL."""
    from tqdm.auto import tqdm

    path = Path(results_dir) / f"dropout_paths__{examples[0].task}__{slug(pair.name)}__{max_new_tokens}.jsonl"
    done = {(r["id"], r["p_drop"], r["head"]): r for r in read_results(path)}
    jobs = [(ex, p, i) for ex in examples for p in p_values for i in range(k) if (ex.id, p, i) not in done]
    for ex, p, i in tqdm(jobs, desc="dropout paths", disable=not progress):
        ids = pair.encode(ex.prompt)
        stop = generation_defaults(ex.task).stop
        out = analysis.dropout_path(pair.target, ids, p, seed=seed * 1000 + i, max_new_tokens=max_new_tokens,
                                    eos_token_ids=pair.eos_token_ids,
                                    should_stop=StopOnText(pair.decode, stop) if stop else None)
        text = cut_output(ex.task, pair.decode(out))
        record = {"id": ex.id, "p_drop": p, "head": i, "token_ids": out, "text": text,
                  "score": score(ex, text), "nll": target_nll(pair.target, ids, out)}
        append_result(path, record)
        done[(ex.id, p, i)] = record
    return [done[(ex.id, p, i)] for ex in examples for p in p_values for i in range(k)]


def path_similarity(records: Sequence[dict], p_drop: float, k: int) -> dict[str, np.ndarray]:
    """Mean (K, K) sentence-embedding cosine similarity and shared-prefix token agreement between the
    paths at ``p_drop``."""
    by_id: dict[str, dict[int, dict]] = {}
    for r in records:
        if r["p_drop"] == p_drop:
            by_id.setdefault(r["id"], {})[r["head"]] = r
    cosines, agreements = [], []
    for paths in by_id.values():
        texts = [paths[i]["text"] or " " for i in range(k)]
        cosines.append(analysis.pairwise_cosine(analysis.sentence_embeddings(texts)))
        agreements.append(analysis.shared_prefix([paths[i]["token_ids"] for i in range(k)]))
    return {"cosine": np.mean(cosines, axis=0), "token_agreement": np.mean(agreements, axis=0)}


def head_scores(records: Sequence[dict], greedy: Mapping[str, list[int]], metric: str) -> pd.DataFrame:
    """Per p_drop and head: mean task score, exact match with the greedy output, mean target NLL (Table 1)."""
    rows = [{"p_drop": r["p_drop"], "head": r["head"] + 1, "score": r["score"].get(metric, float("nan")),
             "exact_match": r["token_ids"] == greedy.get(r["id"]), "nll": r["nll"]} for r in records]
    return pd.DataFrame(rows).groupby(["p_drop", "head"], as_index=False).mean(numeric_only=True)


def rival_configs(draft_len: int, *, topk_ks: Sequence[int] = (), typical_settings: Sequence[Sequence[float]] = (),
                  divergence_settings: Sequence[Sequence] = (), fly_settings: Sequence[Sequence[float]] = (),
                  ensemble_weights: Sequence[float] = (), dropmatch_p_curve: Sequence[float] = (), k: int = 5,
                  criterion: str = "js+majority") -> dict[str, MethodConfig]:
    """The rival sweep of notebook 04: SD, then one config per setting, named ``<family> <setting>``
    (the family is the name's first word): top-K, typical acceptance ([eps, delta]), divergence
    thresholds ([metric, threshold]), FLy ([entropy threshold, window]), static ensemble (target
    weight w), DropMatch (p_drop)."""
    configs = {"SD": MethodConfig("sd", draft_len=draft_len)}
    configs.update({f"top-{K}": MethodConfig("topk", draft_len=draft_len, topk=K) for K in topk_ks})
    configs.update({f"typical eps={e} delta={d}": MethodConfig("typical", draft_len=draft_len, typical_eps=e,
                                                               typical_delta=d) for e, d in typical_settings})
    configs.update({f"{m} <= {t}": MethodConfig("divergence", draft_len=draft_len, divergence=m,
                                                divergence_threshold=t) for m, t in divergence_settings})
    configs.update({f"FLy H3>={h} W={int(w)}": MethodConfig("fly", draft_len=draft_len, fly_entropy=h,
                                                            fly_window=int(w)) for h, w in fly_settings})
    configs.update({f"ensemble w={w}": MethodConfig("ensemble", draft_len=draft_len, ensemble_weight=w)
                    for w in ensemble_weights})
    configs.update({f"DropMatch p={p}": MethodConfig("dropmatch", draft_len=draft_len, k=k, p_drop=p,
                                                     criterion=criterion) for p in dropmatch_p_curve})
    return configs
