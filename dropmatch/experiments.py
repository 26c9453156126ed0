"""The experiments of the notebook series, as resumable functions returning tables (pandas).

Every long computation writes JSON lines under ``results_dir`` and skips what is already there, so
a notebook re-run (or ``make reproduce`` after an interruption) continues instead of starting over.

Every estimate over prompts comes with a bootstrap 95 % interval over the prompts, in the columns
``<column>_lo`` and ``<column>_hi`` (:mod:`dropmatch.intervals`). Every example draws its dropout masks
(and samples) from a seed of its own, :func:`example_seed` of the run's seed and the example's id.
Generations use each task's own budget and stop strings (:func:`token_budget`), optionally capped.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections.abc import Collection, Mapping, Sequence, Sized
from pathlib import Path

import numpy as np
import pandas as pd

from . import analysis
from .errors import ConfigError
from .fidelity import target_nll
from .intervals import UNIT, bootstrap_ci, pooled_ratio_ci
from .methods import Decoder, MethodConfig
from .models import ModelPair, load_pair
from .runner import GreedyReference, append_result, prefix_digest, read_results, run_task, task_prefix
from .stopping import StopOnText
from .summarize import agreement, compare_runs, pooled_ratio, summarize_run, with_ci
from .tasks import Example, cut_output, generation_defaults, score
from .tasks.llm_judge import PROMPT_FILES, JudgeEndpoint


def load_models(pair: str | None = "gemma-3-270m", target: str | None = None, draft: str | None = None,
                **kwargs) -> ModelPair:
    """The notebooks' model parameters: a named ``pair``, or ``target`` and ``draft`` ids / directories."""
    return load_pair(None, target=target, draft=draft, **kwargs) if target else load_pair(pair, **kwargs)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", text).strip("_")


def example_seed(seed: int, example_id: str, *salt) -> int:
    """The seed of one example (with ``salt``, of one stream within it, e.g. a dropout path's head): the
    CRC-32 of ``"seed/id[/salt...]"``, the same in every process and Python version (``hash()`` of a
    string is salted per process) and different from example to example."""
    return zlib.crc32("/".join(str(part) for part in (seed, example_id, *salt)).encode())


def token_budget(task: str, max_new_tokens: int | None = None, task_budgets: Mapping[str, int] | None = None) -> int:
    """New tokens per generation (per turn of a chat task) on ``task``: the task's own budget
    (:func:`~dropmatch.tasks.generation_defaults`, which also gives its stop strings), capped by
    ``task_budgets[task]`` where given and by ``max_new_tokens`` (``None``: no cap); ``ConfigError`` for a
    cap below 1."""
    caps = [generation_defaults(task).max_new_tokens, (task_budgets or {}).get(task), max_new_tokens]
    for name, cap in (("task_budgets", caps[1]), ("max_new_tokens", caps[2])):
        if cap is not None and int(cap) < 1:
            raise ConfigError(f"{name} caps {task} at {cap} new tokens: give at least 1 (None: no cap)")
    return min(int(c) for c in caps if c is not None)


def _require(what: str, values: Sized) -> None:
    """``ConfigError`` naming ``what`` when ``values`` is empty (a table over nothing is no result)."""
    if not len(values):
        raise ConfigError(f"no {what} given: the table needs at least one")


LOSSLESS_METHODS = ("ar", "sd")  # greedy: the target's own output


def run_methods(pair: ModelPair, task: str, configs: Mapping[str, MethodConfig], results_dir: str | Path, *,
                n_prompts: int | None, max_new_tokens: int | None = None,
                task_budgets: Mapping[str, int] | None = None, seed: int = 0, fidelity: bool = True,
                baseline: str | None = None, lossless: str | None = None, progress: bool = True,
                llm_judge: JudgeEndpoint | None = None, prefix_cache: bool = True) -> pd.DataFrame:
    """Decode the first ``n_prompts`` examples of ``task`` (``None``: all) with every method (resumable;
    each example with its own :func:`example_seed`, at :func:`token_budget` new tokens) and return one
    row per method. MT-bench and KoMT-bench are graded by ``llm_judge``, else by the endpoint
    :func:`judge_from_env` names (none: no LLM grading). With ``prefix_cache`` the task's shared prompt
    beginning is prefilled once (:func:`~dropmatch.runner.task_prefix`), in files of their own.

    Columns; ``<c>_lo`` / ``<c>_hi`` hold the bootstrap 95 % interval over the prompts of column ``c``:

    * ``name`` (the key in ``configs``), ``model``, ``task``, ``method`` (the label), ``records`` (the
      JSON-lines file of the per-example records), ``n`` (prompts), ``max_new_tokens`` (the budget);
    * ``tau`` (ours: new tokens per target call), ``paper_tau`` (the paper's: per verify step),
      ``tokens/s`` (mean over examples, end to end), ``tokens/s pooled``, ``decode tokens/s`` (pooled,
      after the prefill), each but ``tokens/s pooled`` with ``_lo`` / ``_hi``;
    * ``score`` (the task score's name), ``mean`` with ``mean_lo`` / ``mean_hi`` (and, as text, ``ci95``);
    * with ``fidelity``: ``exact_match_rate`` (output = the target's greedy output), ``nll`` and
      ``greedy_nll`` (target NLL per token of the output and of the greedy output), ``delta_nll`` (their
      difference per prompt, averaged), the first and last with ``_lo`` / ``_hi``;
    * with ``baseline`` (a key of ``configs``): ``speedup`` (decode tokens/s over the baseline's),
      ``speedup e2e`` (pooled end-to-end tokens/s over the baseline's), ``tau_gain`` (paper_tau over the
      baseline's, minus 1), each with a paired interval (the same prompts resampled for both runs);
    * ``agreement``: share of prompts whose answer is the lossless run's (``lossless``, default the
      baseline if it is SD or AR, else the first such config; nan without one), with its interval;
    * ``draft_acceptance`` (accepted over drafted tokens) and ``verify_ms_per_step``, both pooled over the
      examples, with ``_lo`` / ``_hi``; ``extra_accepts_per_step``; each nan where nothing was drafted
      (AR) or no verify step ran.
    """
    for role, name in (("baseline", baseline), ("lossless", lossless)):
        if name is not None and name not in configs:  # before any decoding, not after every config ran
            raise ConfigError(f"{role} {name!r} is not one of the configs: {', '.join(configs)}")
    results_dir = Path(results_dir)
    budget = token_budget(task, max_new_tokens, task_budgets)
    judge = llm_judge or (judge_from_env() if task in PROMPT_FILES else None)
    records: dict[str, list[dict]] = {}
    files: dict[str, Path] = {}
    prefix = task_prefix(pair, task) if prefix_cache else None
    for name, config in configs.items():
        # seed, budget and a cached prompt prefix in the name: a run with other settings gets its own file, not a
        # refusal (a task without a shared prompt beginning keeps the name it had before prefixes)
        cached = f"-prefix{prefix_digest(prefix)}" if prefix else ""
        files[name] = (results_dir / f"{task}__{slug(pair.name)}__{slug(config.label)}__seed{seed}-new{budget}"
                       f"{cached}.jsonl")
        records[name] = run_task(Decoder(pair, config), task, files[name], limit=n_prompts, seed=seed,
                                 max_new_tokens=budget, fidelity=fidelity, progress=progress,
                                 reference_cache=reference_path(pair, task, results_dir),
                                 llm_judge=judge if task in PROMPT_FILES else None, example_seed=example_seed,
                                 prefix_cache=prefix_cache)
    reference = lossless or next((n for n in ([baseline] if baseline else []) + list(configs)
                                  if configs[n].method in LOSSLESS_METHODS), None)
    rows = []
    for name, rs in records.items():
        row = {"name": name, "model": pair.name, **summarize_run(task, configs[name].label, rs),
               "records": files[name].name, "max_new_tokens": budget}
        if baseline is not None:
            row.update(compare_runs(rs, records[baseline]))
        row.update(agreement(task, rs, records[reference] if reference else []))
        stats = [r["stats"] for r in rs]
        accepted = [sum(s["accepted_per_step"]) for s in stats]
        drafted = [sum(s["drafted_per_step"]) for s in stats]
        verify_ms = [1000 * s["verify_s"] for s in stats]
        steps = [len(s["accepted_per_step"]) for s in stats]
        with_ci(row, "draft_acceptance", pooled_ratio(accepted, drafted), pooled_ratio_ci(accepted, drafted, bounds=UNIT))
        with_ci(row, "verify_ms_per_step", pooled_ratio(verify_ms, steps), pooled_ratio_ci(verify_ms, steps))
        row["extra_accepts_per_step"] = pooled_ratio([s["extra_accepts"] for s in stats], steps)
        rows.append(row)
    return pd.DataFrame(rows)


def run_cells(pair: ModelPair, task: str, cells: Mapping[str, tuple[MethodConfig, int | None]],
              results_dir: str | Path, *, baseline: str, **kwargs) -> pd.DataFrame:
    """:func:`run_methods` for configs that need different numbers of prompts: ``cells`` maps a name to
    (config, n_prompts; ``None``: all). Each group of one size runs with ``baseline`` (a name in
    ``cells``, with the most prompts) on its own prompts, the first n of the baseline's (which resume
    from its records), so every row's paired columns rest on that row's n. Rows in ``cells``' order."""
    def size(n: int | None) -> float:
        return math.inf if n is None else n

    if baseline not in cells:
        raise ConfigError(f"baseline {baseline!r} is not one of the cells: {', '.join(cells)}")
    groups: dict[int | None, dict[str, MethodConfig]] = {}
    for name, (config, n) in cells.items():
        if size(n) > size(cells[baseline][1]):
            raise ConfigError(f"{name} asks for {n} prompts, more than its baseline {baseline} ({cells[baseline][1]})")
        groups.setdefault(n, {})[name] = config
    tables = []
    for n, configs in sorted(groups.items(), key=lambda group: -size(group[0])):
        table = run_methods(pair, task, {baseline: cells[baseline][0], **configs}, results_dir, n_prompts=n,
                            baseline=baseline, **kwargs)
        tables.append(table if baseline in configs else table[table["name"] != baseline])
    return pd.concat(tables, ignore_index=True).set_index("name").loc[list(cells)].reset_index()


# Plot styles of the notebooks: series colours without red (the equal-noise p_drop's line) and grey (SD,
# the lossless baseline), and markers that keep overlapping series apart.
PALETTE = ("C0", "C1", "C2", "C4", "C5", "C6", "C8", "C9")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<")


def ci_text(row: Mapping, column: str, fmt: str = ".3f", scale: float = 1.0, sign: bool = False) -> str:
    """``value [95 % CI lo, hi]`` of ``column`` in a result row (``scale``: e.g. 100 for percent)."""
    spec = ("+" if sign else "") + fmt
    value, lo, hi = (scale * float(row.get(c, float("nan"))) for c in (column, f"{column}_lo", f"{column}_hi"))
    return f"{value:{spec}} [95% CI {lo:{spec}}, {hi:{spec}}]"


def error_bars(table: pd.DataFrame, column: str) -> np.ndarray:
    """(2, rows) distances from ``column`` down to ``<column>_lo`` and up to ``<column>_hi``, for
    matplotlib's ``yerr`` / ``xerr`` (0 where an interval is missing)."""
    value = table[column].to_numpy(dtype=float)
    lo = table.get(f"{column}_lo", table[column]).to_numpy(dtype=float)
    hi = table.get(f"{column}_hi", table[column]).to_numpy(dtype=float)
    return np.nan_to_num(np.clip(np.stack([value - lo, hi - value]), 0, None))


def figure_legend(fig, axes, ncols: int = 4):
    """One legend below the panels for every labelled series of ``axes`` (each label once), so that no
    legend box covers data (needs a figure with ``layout="constrained"``)."""
    handles: dict[str, object] = {}
    for ax in np.ravel(axes):
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    return fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=ncols, fontsize=8)


def figure_title(what: str, pair: ModelPair, task: str, n: int | Collection[int] | None) -> str:
    """``what``, then ``<model>, <task>, n = <prompts> prompts`` on a second line (a range where the
    rows rest on different counts; 0 for no rows)."""
    counts = sorted({int(x) for x in n}) if isinstance(n, Collection) else [n]
    shown = "0" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"{what}\n{pair.name}, {task}, n = {shown} prompts"


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
    """Teacher-forced acceptance per (p_drop, criterion), pooled over the examples' greedy answers
    (each example's masks from its :func:`example_seed`); ``exact_match_rate``, ``acceptance_rate`` and
    ``outside_top5_share`` (nan where no mismatch was accepted) with their intervals over the examples,
    and ``n`` (examples). ``ConfigError`` when nothing is left to probe."""
    for what, values in (("examples", examples), ("p_drop values", p_values), ("criteria", criteria)):
        _require(what, values)
    rows = []
    for ex, answer in zip(examples, greedy_answers(pair, examples, max_new_tokens, results_dir), strict=True):
        if len(answer) < 2:
            continue
        for row in analysis.acceptance_probe(pair, pair.encode(ex.prompt), answer, p_values, criteria, k,
                                             example_seed(seed, ex.id)):
            rows.append({"id": ex.id, **row})
    if not rows:
        raise ConfigError(f"no example has a greedy answer of >= 2 tokens to probe ({len(examples)} examples, "
                          f"at most {max_new_tokens} new tokens): take more prompts or a larger budget")
    table = pd.DataFrame(rows)
    table = table.assign(accepted=table.acceptance_rate * table.positions,
                         exact=table.exact_match_rate * table.positions,
                         outside=table.outside_top5_share * table.accepted_mismatches)
    out = []
    for (p, criterion), g in table.groupby(["p_drop", "criterion"]):
        row = {"p_drop": p, "criterion": criterion, "n": len(g), "positions": int(g.positions.sum())}
        with_ci(row, "exact_match_rate", pooled_ratio(g.exact, g.positions), pooled_ratio_ci(g.exact, g.positions, bounds=UNIT))
        with_ci(row, "acceptance_rate", pooled_ratio(g.accepted, g.positions), pooled_ratio_ci(g.accepted, g.positions, bounds=UNIT))
        with_ci(row, "outside_top5_share", pooled_ratio(g.outside, g.accepted_mismatches),
                pooled_ratio_ci(g.outside, g.accepted_mismatches, bounds=UNIT))
        out.append(row)
    return pd.DataFrame(out)


def agreement_by_p(pair: ModelPair, examples: Sequence[Example], p_values: Sequence[float], max_new_tokens: int,
                   results_dir: str | Path, k: int = 5, seed: int = 0) -> pd.DataFrame:
    """Share of positions where m of the K heads agree on the majority token (paper Table 2), per p_drop,
    teacher-forced on the target's greedy answers (one forward pass per example serves every p_drop;
    each example's masks from its :func:`example_seed`). Columns: p_drop, agreeing_heads, share with
    ``share_lo`` / ``share_hi`` (bootstrap over the examples, positions pooled), mean_prob (the heads'
    mean probability of the majority token), n (examples), positions. ``ConfigError`` when no example has
    an answer."""
    _require("examples", examples)
    _require("p_drop values", p_values)
    per_example = []  # (p, example) -> counts
    for ex, answer in zip(examples, greedy_answers(pair, examples, max_new_tokens, results_dir), strict=True):
        if not answer:
            continue
        hidden, logits, _ = analysis.teacher_forced(pair, pair.encode(ex.prompt), answer, draft=False)
        for p in p_values:
            result = analysis.head_agreement_at(pair.target, hidden, logits, k=k, p_drop=p,
                                                seed=example_seed(seed, ex.id))
            per_example.append((p, result["majority_count"], result["majority_prob"]))
    if not per_example:
        raise _no_answer(examples, max_new_tokens)
    rows = []
    for p in p_values:
        counts = [c for q, c, _ in per_example if q == p]
        probs = np.concatenate([pr for q, _, pr in per_example if q == p])
        counts_all = np.concatenate(counts)
        positions = np.array([len(c) for c in counts], dtype=float)
        for m in range(1, k + 1):
            sel = counts_all == m
            row = {"p_drop": p, "agreeing_heads": m}
            with_ci(row, "share", float(sel.mean()),
                    pooled_ratio_ci([float((c == m).sum()) for c in counts], positions, bounds=UNIT))
            row.update(mean_prob=float(probs[sel].mean()) if sel.any() else float("nan"), n=len(counts),
                       positions=int(positions.sum()))
            rows.append(row)
    return pd.DataFrame(rows)


def _no_answer(examples: Sequence[Example], max_new_tokens: int) -> ConfigError:
    return ConfigError(f"no example has a non-empty greedy answer to teacher-force ({len(examples)} examples, at "
                       f"most {max_new_tokens} new tokens): take more prompts or a larger budget")


TABLE3_CASES = {"dispersed": False, "concentrated": True}  # case -> whether all K heads agree


def js_radii_by_p(pair: ModelPair, examples: Sequence[Example], p_values: Sequence[float], max_new_tokens: int,
                  results_dir: str | Path, k: int = 5, seed: int = 0) -> pd.DataFrame:
    """Paper Table 3, per p_drop and case: the mean JS(q || c) of the draft to the heads' centroid
    (``js_draft``) and the mean radius max_i JS(p_i || c) (``js_heads``), in nats, teacher-forced on the
    target's greedy answers at every position, split into ``dispersed`` (the K heads do not all pick the
    same token) and ``concentrated`` (they do) positions, with the masks of :func:`agreement_by_p` (same
    seed, same split). ``inside_share``: the share of the case's positions where js_draft <= js_heads (the
    JS criterion alone accepts the draft distribution there). Intervals: bootstrap over the ``n`` examples
    with positions of the case, positions pooled. ``ConfigError`` when no example has an answer."""
    _require("examples", examples)
    _require("p_drop values", p_values)
    per_example = []  # (p, js_radii_at's arrays) per example
    for ex, answer in zip(examples, greedy_answers(pair, examples, max_new_tokens, results_dir), strict=True):
        if not answer:
            continue
        hidden, logits, draft_logits = analysis.teacher_forced(pair, pair.encode(ex.prompt), answer)
        if draft_logits is None:
            raise ConfigError("Table 3 compares the draft's distribution with the heads': the pair needs a draft model")
        for p in p_values:
            per_example.append((p, analysis.js_radii_at(pair.target, hidden, logits, draft_logits, k=k, p_drop=p,
                                                        seed=example_seed(seed, ex.id))))
    if not per_example:
        raise _no_answer(examples, max_new_tokens)
    rows = []
    for p in p_values:
        for case, agree in TABLE3_CASES.items():
            parts = [{name: values[r["agree"] == agree] for name, values in r.items()} for q, r in per_example if q == p]
            parts = [part for part in parts if len(part["agree"])]
            counts = [len(part["agree"]) for part in parts]
            row = {"p_drop": p, "case": case}
            for column, values, bounds in (("js_draft", [part["js_draft"] for part in parts], None),
                                           ("js_heads", [part["js_heads"] for part in parts], None),
                                           ("inside_share", [part["js_draft"] <= part["js_heads"] for part in parts],
                                            UNIT)):
                sums = [float(v.sum()) for v in values]
                with_ci(row, column, sum(sums) / sum(counts) if counts else float("nan"),
                        pooled_ratio_ci(sums, counts, bounds=bounds))
            rows.append({**row, "n": len(parts), "positions": int(sum(counts))})
    return pd.DataFrame(rows)


def dropout_paths(pair: ModelPair, examples: Sequence[Example], p_values: Sequence[float], k: int,
                  max_new_tokens: int, results_dir: str | Path, seed: int = 0, progress: bool = True) -> list[dict]:
    """K free-running dropout paths per example and p_drop (resumable, one file per seed and budget).
    Head i of an example draws its masks from ``example_seed(seed, id, i)``: other seeds, examples and
    heads draw other masks, and every p_drop thresholds the same draws. At p_drop = 0 all heads are
    the greedy path, decoded once. Each record carries the path's seed, text, task score and target NLL
    (nan for an empty path)."""
    from tqdm.auto import tqdm

    _require("examples", examples)
    name = f"dropout_paths__{examples[0].task}__{slug(pair.name)}__{max_new_tokens}__seed{seed}.jsonl"
    path = Path(results_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)  # before the first path is decoded, not after
    done = {(r["id"], r["p_drop"], r["head"]): r for r in read_results(path, key="id")}
    jobs = [(ex, p, i) for ex in examples for p in p_values for i in range(k) if (ex.id, p, i) not in done]
    for ex, p, i in tqdm(jobs, desc="dropout paths", disable=not progress):
        path_seed = example_seed(seed, ex.id, i)
        if p == 0 and (ex.id, p, 0) in done:  # no dropout: every head is the greedy path
            record = {**done[(ex.id, p, 0)], "head": i, "seed": path_seed}
        else:
            ids = pair.encode(ex.prompt)
            stop = generation_defaults(ex.task).stop
            out = analysis.dropout_path(pair.target, ids, p, seed=path_seed, max_new_tokens=max_new_tokens,
                                        eos_token_ids=pair.eos_token_ids,
                                        should_stop=StopOnText(pair.decode, stop) if stop else None)
            text = cut_output(ex.task, pair.decode(out))
            record = {"id": ex.id, "p_drop": p, "head": i, "seed": path_seed, "token_ids": out, "text": text,
                      "score": score(ex, text), "nll": target_nll(pair.target, ids, out)}
        append_result(path, record)
        done[(ex.id, p, i)] = record
    return [done[(ex.id, p, i)] for ex in examples for p in p_values for i in range(k)]


def path_similarity(records: Sequence[dict], p_values: Sequence[float], k: int) -> pd.DataFrame:
    """Per p_drop: the (K, K) sentence-embedding cosine similarity and shared-prefix token agreement
    between the paths, averaged over the prompts (``cosine``, ``token_agreement``), and the mean
    off-diagonal value of each with its interval over the prompts (``mean off-diagonal cosine`` with
    ``cosine_lo`` / ``cosine_hi``; ``mean off-diagonal shared prefix`` with ``shared_prefix_lo`` / ``_hi``)."""
    by_key: dict[tuple[float, str], dict[int, dict]] = {}
    for r in records:
        if r["p_drop"] in p_values:
            by_key.setdefault((r["p_drop"], r["id"]), {})[r["head"]] = r
    keys = list(by_key)
    texts = [by_key[key][i]["text"] or " " for key in keys for i in range(k)]
    embeddings = analysis.sentence_embeddings(texts) if texts else np.zeros((0, 384))
    off = ~np.eye(k, dtype=bool)
    rows = []
    for p in p_values:
        cosines, agreements = [], []
        for j, key in enumerate(keys):
            if key[0] == p:
                cosines.append(analysis.pairwise_cosine(embeddings[j * k:(j + 1) * k]))
                agreements.append(analysis.shared_prefix([by_key[key][i]["token_ids"] for i in range(k)]))
        if not cosines:
            continue
        cos_mean, pre_mean = [c[off].mean() for c in cosines], [a[off].mean() for a in agreements]
        row = {"p_drop": p, "n": len(cosines), "cosine": np.mean(cosines, axis=0),
               "token_agreement": np.mean(agreements, axis=0)}
        row["mean off-diagonal cosine"], (row["cosine_lo"], row["cosine_hi"]) = float(np.mean(cos_mean)), \
            bootstrap_ci(cos_mean)
        row["mean off-diagonal shared prefix"], (row["shared_prefix_lo"], row["shared_prefix_hi"]) = \
            float(np.mean(pre_mean)), bootstrap_ci(pre_mean)
        rows.append(row)
    return pd.DataFrame(rows)


def head_scores(records: Sequence[dict], greedy: Mapping[str, list[int]], metric: str) -> pd.DataFrame:
    """Per p_drop and head: mean task score, exact match with the greedy output and mean target NLL
    (Table 1), each with ``_lo`` / ``_hi`` (bootstrap over the prompts); ``n`` (prompts) and ``n_nll``
    (those whose path has an NLL: an empty path has none), the counts the estimates rest on."""
    _require("path records", records)
    frame = pd.DataFrame([{"p_drop": r["p_drop"], "head": r["head"] + 1, "score": r["score"].get(metric, float("nan")),
                           "exact_match": float(r["token_ids"] == greedy.get(r["id"])), "nll": r["nll"]}
                          for r in records])
    rows = []
    for (p, head), g in frame.groupby(["p_drop", "head"]):
        row = {"p_drop": p, "head": head, "n": len(g), "n_nll": int(g["nll"].notna().sum())}
        for column in ("score", "exact_match", "nll"):
            values = g[column].dropna().to_numpy()
            with_ci(row, column, float(values.mean()) if len(values) else float("nan"), bootstrap_ci(values))
        rows.append(row)
    return pd.DataFrame(rows)


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
