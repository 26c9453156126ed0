"""Run the notebook series headless with papermill: ``python -m dropmatch.reproduce --preset default``.

Each notebook in ``notebooks/`` (in file-name order) has a cell tagged ``parameters``. A preset sets
parameters for all notebooks; ``-p NAME VALUE`` overrides any of them (values are parsed as Python
literals when possible). Every notebook receives only the parameters it declares. Executed notebooks
go to ``results/<preset>/``; a failing notebook stops the run with its name and error.
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

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
    # The paper's pairs and full datasets, for GPUs with the weights at hand.
    "paper": {"preset": "paper", "pair": None, "target": "meta-llama/Llama-3.1-70B-Instruct",
              "draft": "meta-llama/Llama-3.1-8B-Instruct", "n_prompts": None, "max_new_tokens": 512,
              "reference_hidden_size": 8192},
}


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
    for nb in notebooks(only):
        declared = papermill.inspect_notebook(str(nb))
        given = {k: v for k, v in params.items() if k in declared}
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
