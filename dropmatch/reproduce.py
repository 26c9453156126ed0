"""Run the notebook series headless with papermill: ``python -m dropmatch.reproduce --preset default``.

Each notebook in ``notebooks/`` (in file-name order) has a cell tagged ``parameters``. A preset sets
parameters for all notebooks; ``-p NAME VALUE`` overrides any of them (values are parsed as Python
literals when possible). Every notebook receives only the parameters it declares. The ``default``
preset is the notebooks' own defaults, so a notebook run by hand in JupyterLab computes the same
numbers (into ``results/manual`` and ``figures/manual``).

Executed notebooks go to ``results/<preset>/``, cleaned (:mod:`dropmatch.notebook_record`) and with a
"Run record" cell: preset, notebook, every parameter, derived values, revision (clean or dirty,
fixed once at the start), the models' device, the CPU's kernels, the date. The default preset with
no ``-p`` also writes them back to ``notebooks/`` and its figures to ``figures/`` (both committed);
any other run writes figures to ``figures/<preset>/`` only. A failing notebook stops the run with
its name and error.

Some parameters act on the run rather than on one notebook: ``device_map`` (exported as
``DROPMATCH_DEVICE_MAP``: hub targets are spread over the GPUs present, the draft on the head's GPU)
and ``llm_judge`` (exported as ``DROPMATCH_LLM_JUDGE``: MT-bench and KoMT-bench are graded by the
endpoint in ``DROPMATCH_JUDGE_URL`` / ``DROPMATCH_JUDGE_MODEL`` when one is configured, and scored
reference-free when none is). ``NOTEBOOK_PARAMETERS`` gives single notebooks their own models (the
paper's KoMT-bench table uses Llama-3.3-70B), and a preset's ``notebooks`` limits the series.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from .paper import PAPER_MODELS
from .paths import REPO_ROOT

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
FIGURES_DIR = REPO_ROOT / "figures"
CANONICAL = "default"  # the preset whose executed notebooks and figures are committed

PRESETS: dict[str, dict] = {
    # `make smoke` (and, on a tiny pair, the `ci` preset below): two prompts per cell, short generations, the
    # smallest sweeps; ~20 minutes on 2 cores. The decoding sweeps of notebooks 02-04 (K, p_drop, rivals,
    # Table 7) run on HumanEval, whose prompts are ~150 tokens:
    # GSM8K's 8-shot prompt (1358 tokens) costs ~3 s of target prefill (7-8 s on a loaded machine) and as much
    # again of int8-draft prefill per generation on 2 cores, most of a 16-token smoke generation. GSM8K still runs in
    # notebook 04's main table and notebook 06's mining and judge study; KLUE-NLI in notebook 06. Mining takes
    # one problem: it runs the mining code, and no smoke run trains a judge (two problems gave 4 important
    # mismatches and no unimportant one, where training needs 2 of each), so notebook 06 skips the judge rows.
    "smoke": {
        "preset": "smoke", "pair": "gemma-3-270m", "n_prompts": 2, "n_headline": 2, "n_equal_noise": 2,
        "n_rivals": 2, "max_new_tokens": 16,
        "p_similarity": [0.3], "p_heads": [0.3], "ks": [1, 5], "p_drops": [0.0, 0.05, 0.3],
        "decode_p_drops": [0.05], "tasks": ["gsm8k", "humaneval"], "draft_lens": [5], "topk_ks": [2],
        "typical_settings": [[0.09, 0.3]], "divergence_settings": [["js", 0.3]], "dropmatch_p_curve": [0.05, 0.3],
        "tasks_korean": ["komt_bench"],
        "mine_problems": 1, "mine_mismatches": 2, "mine_max_new_tokens": 32, "thresholds": [0.2],
        "ood_tasks": ["klue_nli"], "overhead_prompts": 1, "n_eagle3": 2, "eagle3_tasks": ["humaneval"],
        "task": "humaneval", "rival_task": "humaneval",
    },
    # The notebooks' own defaults (the embedded pair on subsets big enough for the comparisons to mean
    # something): a notebook run by hand in JupyterLab computes what this preset computes.
    #
    # Sizing (the parameters cells of notebooks 01-06). Headline cells, n_headline = 30 prompts: GSM8K
    # (Table 6) at L = 5 and 10, SD and SD + DM at p_drop 0.3, and at L = 5 also at the equal-noise p_drop
    # (the p_drop sweep's three headline points 0 / equal-noise / 0.3 of notebook 03 are the same runs);
    # KoMT-bench at L = 7, SD and SD + DM at 0.3. The equal-noise runs at L = 10 and on KoMT-bench:
    # n_equal_noise = 10. Cells the verdict table reads (notebook 01's paths, Table 6's other tasks,
    # notebook 06's judge study): 5 prompts; the rest (K ablation, the p_drop sweep's other points, the
    # rivals, notebook 05's other tasks): 3. Budgets: each task's own with its stop strings, capped at
    # GSM8K 128, HumanEval 64, IFEval 48, KULLM 64, MT-bench / KoMT-bench 32 per turn, the dropout paths
    # 32 (MMLU, KLUE-NLI: their own 4); 12 GSM8K train problems x 2 mismatches mined for the judge (4 gave 8
    # mismatches, all important, and a judge needs 2 of each class).
    #
    # Time on 2 cores, tokens = prompts x methods x budget (x 2 turns), at the measured ~11 tokens/s of
    # SD / SD + DM with the int8 draft and ~9 tokens/s of AR (the greedy references), every generation
    # taken to its cap:
    #   GSM8K headline   5 runs x 30 x 128 = 19200 tok / 11 = 1745 s; equal noise L=10: 10 x 128 / 11 = 116 s;
    #                    greedy reference 30 x 128 / 9 = 427 s                                      -> 2288 s
    #   KoMT-bench       2 runs x 30 x 2 x 32 = 3840 tok / 11 = 349 s; equal noise 10 x 64 / 11 = 58 s;
    #                    greedy reference 30 x 64 / 9 = 213 s                                       ->  620 s
    #   other cells      GSM8K: 11 runs (K, sweep, rivals, judge) x 3-5 prompts x 128 = 4992 tok / 11 ~ 450 s;
    #                    Table 6's other tasks: 18 runs x 5 prompts = 3480 tok / 11 + references ~ 380 s;
    #                    notebook 05's other tasks ~ 150 s; notebook 06 on IFEval / KLUE-NLI ~ 80 s;
    #                    80 dropout paths x 32 / 9 ~ 280 s; mining ~ 1600 s (~130 s a problem); probe, head agreement,
    #                    overhead ~ 190 s; 7 kernels + model loads ~ 210 s                       -> ~3400 s
    #   total ~ 6300 s = 105 min. Not in those speeds: GSM8K's 8-shot prompt (~1350 tokens) cost ~3-4.5 s of
    #   target (+ draft) prefill per generation (smoke-run records), up to ~17 min over the ~250 GSM8K
    #   generations (warm-ups included), and as much again for the fidelity NLLs; since 2026-12-08 the runner
    #   prefills the shared exemplars once per model (runner.task_prefix), which removes most of both.
    #   Levers: n_headline (~1.5 min per prompt), the GSM8K cap (~3.5 min per 10 tokens).
    #   Measured on a 2-core AVX2 EPYC (no native bfloat16, float32 heads; cdd5a40): notebooks 00-04 took
    #   7298 s (03: 2771 s, 04: 3671 s), the whole series about three hours.
    "default": {"preset": "default"},
    # The paper's pairs and full datasets, for GPUs with the weights at hand (the 70B target spread over
    # them); the trained judge is mined on all of GSM8K train, as AutoJudge's judges are trained on it.
    # Every task at its own budget (512 caps none) and the full sweeps of each notebook.
    "paper": {"preset": "paper", "pair": None, "target": PAPER_MODELS["table6_llama"][0],
              "draft": PAPER_MODELS["table6_llama"][1], "n_prompts": None, "n_headline": None,
              "n_equal_noise": None, "n_rivals": None, "max_new_tokens": 512, "task_budgets": {},
              "reference_hidden_size": 8192, "device_map": "auto", "llm_judge": True,
              "mine_problems": None, "mine_mismatches": 64, "mine_max_new_tokens": 512,
              "p_heads": [0.0, 0.1, 0.2, 0.3, 0.4, 0.5], "ks": [1, 2, 3, 5, 8, 10],
              "p_drops": [0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5], "decode_p_drops": [0.01, 0.02, 0.05, 0.1, 0.2, 0.5],
              "topk_ks": [2, 3, 5], "typical_settings": [[0.09, 0.3], [0.3, 0.6]],
              "divergence_settings": [["js", 0.1], ["js", 0.3], ["kl", 1.0]], "fly_settings": [[0.3, 1], [0.3, 2]],
              "ensemble_weights": [0.5, 0.8], "dropmatch_p_curve": [0.02, 0.05, 0.1, 0.3],
              "accept_shares": [0.25, 0.5, 0.75]},
}
# `make test`: the smoke preset on the tiny random Gemma-3 pair (dropmatch.models.tiny_pair, byte tokenizer),
# so that every notebook runs end to end through every cell that writes a table or a figure in ~4 minutes on
# 2 cores (the smoke preset takes ~20 on the embedded pair: `make smoke`). Its numbers mean nothing: it checks
# the series, not the method. No EAGLE-3 head ships for this pair; pass one as eagle3_head to run Table 7.
PRESETS["ci"] = {**PRESETS["smoke"], "preset": "ci", "pair": "tiny-gemma"}
# Table 6's second pair: the main results and the side-by-side table on Qwen3-32B / Qwen3-4B.
PRESETS["paper-qwen"] = {**PRESETS["paper"], "preset": "paper-qwen", "target": PAPER_MODELS["table6_qwen"][0],
                         "draft": PAPER_MODELS["table6_qwen"][1], "reference_hidden_size": 5120,
                         "notebooks": ["04_", "07_"]}

# Per preset, parameters of single notebooks (file-name prefix) that differ from the preset's.
NOTEBOOK_PARAMETERS: dict[str, dict[str, dict]] = {
    "paper": {"05_": {"target": PAPER_MODELS["table10"][0], "draft": PAPER_MODELS["table10"][1],
                      "eagle3_head": PAPER_MODELS["table7_eagle3_head"]}},
}
RUN_ENV = {"device_map": "DROPMATCH_DEVICE_MAP", "llm_judge": "DROPMATCH_LLM_JUDGE"}


def parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def notebooks(only: list[str] | None = None) -> list[Path]:
    found = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
    if only:
        found = [nb for nb in found if any(key in nb.name for key in only)]
    return found


def output_dirs(preset: str, overrides: Mapping, results: Path | None = None) -> tuple[Path, Path, bool]:
    """Results and figures directories of a run, and whether it refreshes the committed ``notebooks/``
    and ``figures/`` (the default preset without overrides)."""
    refresh = preset == CANONICAL and not overrides
    out_dir = Path(results) if results else REPO_ROOT / "results" / preset
    return out_dir.resolve(), FIGURES_DIR if refresh else FIGURES_DIR / preset, refresh


def run(preset: str, overrides: dict, only: list[str] | None = None, results: Path | None = None) -> int:
    import papermill

    from .errors import ConfigError, JudgeError
    from .provenance import REVISION_ENV, revision_record

    if preset not in PRESETS:
        print(f"error: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    out_dir, figures, refresh = output_dirs(preset, overrides, results)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = {**PRESETS[preset], "results_dir": str(out_dir), "figures_dir": str(figures), **overrides}
    revision = revision_record()  # once: this run rewrites notebooks/ and figures/ itself
    print(f"[reproduce] revision {revision['text'] if revision else 'unknown'}", flush=True)
    try:
        with run_environment(params), environ({REVISION_ENV: json.dumps(revision) if revision else None}):
            return _run_notebooks(papermill, preset, params, overrides, only or params.get("notebooks"), out_dir,
                                  refresh)
    except (ConfigError, JudgeError) as err:  # bad parameters, an unreachable LLM judge
        print(f"error: {err}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for ``None``, unset) environment variables while the block runs; restore on exit."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def notebook_parameters(preset: str, notebook: str, params: dict, overrides: dict) -> dict:
    """The parameters of one notebook: the preset's, then the notebook's own, then the command line's."""
    own = [v for prefix, v in NOTEBOOK_PARAMETERS.get(preset, {}).items() if notebook.startswith(prefix)]
    return {**params, **{k: v for d in own for k, v in d.items()}, **overrides}


def run_environment(params: dict) -> contextlib.AbstractContextManager:
    """Export the run-wide parameters (``RUN_ENV``) to the notebooks' kernels; restore on exit."""
    if params.get("llm_judge"):
        print(f"[reproduce] LLM judge: {judge_status()}", flush=True)
    return environ({name: None if params.get(key) in (None, False) else "1" if params.get(key) is True
                    else str(params[key]) for key, name in RUN_ENV.items()})


def judge_status() -> str:
    """Which endpoint grades MT-bench / KoMT-bench, or why none does; a URL without a model is an error, and
    so is an endpoint that cannot be reached or refuses the key (checked here, before any notebook runs)."""
    from .tasks.llm_judge import JudgeEndpoint

    endpoint = JudgeEndpoint.from_env()  # ConfigError: a URL without DROPMATCH_JUDGE_MODEL
    if endpoint is None:
        return ("none configured (set DROPMATCH_JUDGE_URL and DROPMATCH_JUDGE_MODEL to grade MT-bench and "
                "KoMT-bench); they are scored reference-free")
    endpoint.check()  # JudgeError
    return f"{endpoint.model} at {endpoint.url}"


def notebook_context(preset: str, notebook: Path, declared: Mapping, given: Mapping) -> dict:
    """What a notebook's kernel is told of its run: preset, notebook, the value of every parameter of
    its parameters cell (given, else the cell's default) and which were given."""
    values = {name: given[name] if name in given else parse_value(str(info.get("default")))
              for name, info in declared.items()}
    return {"preset": preset, "notebook": notebook.name, "parameters": values, "passed": sorted(given)}


def _run_notebooks(papermill, preset: str, params: dict, overrides: dict, only: list[str] | None,
                   out_dir: Path, refresh: bool = False) -> int:
    import nbformat

    from . import notebook_record
    from .provenance import CONTEXT_ENV, relative

    for nb in notebooks(only):
        declared = papermill.inspect_notebook(str(nb))
        given = {k: v for k, v in notebook_parameters(preset, nb.name, params, overrides).items() if k in declared}
        context = notebook_context(preset, nb, declared, given)
        print(f"[reproduce] {nb.name} with {relative(given)}", flush=True)
        start = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / nb.name
            nbformat.write(notebook_record.prepare(nbformat.read(nb, as_version=4)), source)
            try:
                with environ({CONTEXT_ENV: json.dumps(context, default=str)}):
                    executed = papermill.execute_notebook(str(source), str(out_dir / nb.name), parameters=given,
                                                          cwd=str(NOTEBOOK_DIR), kernel_name="python3",
                                                          progress_bar=False, log_output=False)
            except papermill.PapermillExecutionError as err:
                print(f"[reproduce] FAILED {nb.name}: {err.ename}: {err.evalue}", file=sys.stderr)
                print(f"[reproduce] executed notebook with the traceback: {out_dir / nb.name}", file=sys.stderr)
                return 1
        cleaned, record = notebook_record.finish(executed, relative(context))
        if record.get("device") is None:
            print(f"[reproduce] warning: {nb.name} reported no device (no run record from its kernel)",
                  file=sys.stderr)
        targets = [out_dir / nb.name, nb] if refresh else [out_dir / nb.name]
        for path in targets:
            nbformat.write(nbformat.from_dict(cleaned), path)
        print(f"[reproduce] {nb.name} done in {time.time() - start:.0f} s; wrote "
              f"{', '.join(str(relative(str(p))) for p in targets)}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="default", help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument("--only", nargs="*", help="run only notebooks whose file name contains one of these")
    parser.add_argument("--results", help="output directory (default results/<preset>)")
    args = parser.parse_args(argv)
    overrides = {name: parse_value(value) for name, value in args.parameter}
    return run(args.preset, overrides, args.only, Path(args.results) if args.results else None)


if __name__ == "__main__":
    sys.exit(main())
