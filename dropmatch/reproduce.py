"""Run the notebook series headless with papermill: ``python -m dropmatch.reproduce --preset default``.

Each notebook in ``notebooks/`` (in file-name order) has a cell tagged ``parameters``. A preset sets
parameters for all notebooks; ``-p NAME VALUE`` overrides any of them (values are parsed as Python
literals when possible). Every notebook receives only the parameters it declares. Executed notebooks
go to ``results/<preset>/``; a failing notebook stops the run with its name and error.

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
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .paper import PAPER_MODELS
from .paths import REPO_ROOT

NOTEBOOK_DIR = REPO_ROOT / "notebooks"

PRESETS: dict[str, dict] = {
    # CI: two prompts per cell, short generations, the smallest sweeps; minutes on 2 cores.
    "smoke": {
        "preset": "smoke", "pair": "gemma-3-270m", "n_prompts": 2, "max_new_tokens": 16,
        "p_similarity": [0.1, 0.3], "p_heads": [0.1, 0.3], "ks": [1, 5], "p_drops": [0.0, 0.05, 0.3],
        "tasks": ["gsm8k", "humaneval"], "draft_lens": [5], "topk_ks": [2], "typical_settings": [[0.09, 0.3]],
        "divergence_settings": [["js", 0.3]], "dropmatch_p_curve": [0.05, 0.3], "tasks_korean": ["komt_bench", "klue_nli"],
        "mine_problems": 2, "mine_mismatches": 2, "mine_max_new_tokens": 32, "thresholds": [0.2],
        "ood_tasks": ["klue_nli"], "overhead_prompts": 1,
    },
    # The embedded pair on subsets big enough for the comparisons to mean something (< 90 min on 2 cores).
    "default": {"preset": "default", "pair": "gemma-3-270m", "n_prompts": 6, "max_new_tokens": 48},
    # The paper's pairs and full datasets, for GPUs with the weights at hand (the 70B target spread over
    # them); the trained judge is mined on all of GSM8K train, as AutoJudge's judges are trained on it.
    "paper": {"preset": "paper", "pair": None, "target": PAPER_MODELS["table6_llama"][0],
              "draft": PAPER_MODELS["table6_llama"][1], "n_prompts": None, "max_new_tokens": 512,
              "reference_hidden_size": 8192, "device_map": "auto", "llm_judge": True,
              "mine_problems": None, "mine_mismatches": 64, "mine_max_new_tokens": 512},
}
# Table 6's second pair: the main results and the side-by-side table on Qwen3-32B / Qwen3-4B.
PRESETS["paper-qwen"] = {**PRESETS["paper"], "preset": "paper-qwen", "target": PAPER_MODELS["table6_qwen"][0],
                         "draft": PAPER_MODELS["table6_qwen"][1], "reference_hidden_size": 5120,
                         "notebooks": ["04_", "07_"]}

# Per preset, parameters of single notebooks (file-name prefix) that differ from the preset's.
NOTEBOOK_PARAMETERS: dict[str, dict[str, dict]] = {
    "paper": {"05_": {"target": PAPER_MODELS["table10"][0], "draft": PAPER_MODELS["table10"][1]}},
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


def run(preset: str, overrides: dict, only: list[str] | None = None, results: Path | None = None) -> int:
    import papermill

    if preset not in PRESETS:
        print(f"error: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    out_dir = Path(results or REPO_ROOT / "results" / preset)
    out_dir.mkdir(parents=True, exist_ok=True)
    params = {**PRESETS[preset], "results_dir": str(out_dir), **overrides}
    from .errors import ConfigError

    try:
        with run_environment(params):
            return _run_notebooks(papermill, preset, params, overrides, only or params.get("notebooks"), out_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def notebook_parameters(preset: str, notebook: str, params: dict, overrides: dict) -> dict:
    """The parameters of one notebook: the preset's, then the notebook's own, then the command line's."""
    own = [v for prefix, v in NOTEBOOK_PARAMETERS.get(preset, {}).items() if notebook.startswith(prefix)]
    return {**params, **{k: v for d in own for k, v in d.items()}, **overrides}


@contextlib.contextmanager
def run_environment(params: dict) -> Iterator[None]:
    """Export the run-wide parameters (``RUN_ENV``) to the notebooks' kernels; restore on exit."""
    saved = {name: os.environ.get(name) for name in RUN_ENV.values()}
    try:
        for key, name in RUN_ENV.items():
            value = params.get(key)
            if value in (None, False):
                os.environ.pop(name, None)
            else:
                os.environ[name] = "1" if value is True else str(value)
        if params.get("llm_judge"):
            print(f"[reproduce] LLM judge: {judge_status()}", flush=True)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def judge_status() -> str:
    """Which endpoint grades MT-bench / KoMT-bench, or why none does; a URL without a model is an error."""
    from .tasks.llm_judge import JudgeEndpoint

    endpoint = JudgeEndpoint.from_env()  # ConfigError: a URL without DROPMATCH_JUDGE_MODEL
    if endpoint is None:
        return ("none configured (set DROPMATCH_JUDGE_URL and DROPMATCH_JUDGE_MODEL to grade MT-bench and "
                "KoMT-bench); they are scored reference-free")
    return f"{endpoint.model} at {endpoint.url}"


def _run_notebooks(papermill, preset: str, params: dict, overrides: dict, only: list[str] | None,
                   out_dir: Path) -> int:
    for nb in notebooks(only):
        declared = papermill.inspect_notebook(str(nb))
        given = {k: v for k, v in notebook_parameters(preset, nb.name, params, overrides).items() if k in declared}
        print(f"[reproduce] {nb.name} with {given}", flush=True)
        start = time.time()
        try:
            papermill.execute_notebook(str(nb), str(out_dir / nb.name), parameters=given, cwd=str(NOTEBOOK_DIR),
                                       kernel_name="python3", progress_bar=False, log_output=False)
        except papermill.PapermillExecutionError as err:
            print(f"[reproduce] FAILED {nb.name}: {err.ename}: {err.evalue}", file=sys.stderr)
            print(f"[reproduce] executed notebook with the traceback: {out_dir / nb.name}", file=sys.stderr)
            return 1
        print(f"[reproduce] {nb.name} done in {time.time() - start:.0f} s", flush=True)
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
