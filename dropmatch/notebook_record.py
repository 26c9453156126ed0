"""Executed notebooks fit for the repository: a run record cell, and nothing that changes without meaning.

:func:`prepare` adds a last code cell that reports the kernel's side of the record (models, derived
values, machine) as a ``RECORD_MIME`` output; :func:`finish` takes that output out, cleans the
notebook (:func:`clean`) and puts a visible "Run record" markdown cell after the title. Both work on
notebook dicts (nbformat's ``NotebookNode`` included) and are idempotent across runs.
"""

from __future__ import annotations

import copy
import html
import re
from collections.abc import Mapping
from pathlib import Path

from .notebook_cells import KERNEL_TAG, RECORD_TAG, _source, _tags
from .paths import REPO_ROOT

RECORD_MIME = "application/vnd.dropmatch.run-record+json"
KERNEL_SOURCE = f"""try:
    from dropmatch.provenance import run_record as _run_record
    display({{{RECORD_MIME!r}: _run_record(), "text/plain": "run record"}}, raw=True)
except Exception as _error:  # the notebook's results stand; the record says what is missing
    print(f"run record failed: {{_error!r}}")
"""
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# cell metadata written by papermill / nbclient: timings and statuses of this one execution
RUN_METADATA = ("papermill", "execution", "ExecuteTime")
# tqdm's timing part: "[00:12<00:03,  1.23s/it]", "[00:00<?, ?it/s]", "[00:01, 3.2it/s]"
TQDM_TIMING = re.compile(r"\s*\[[0-9:?]+(?:<[0-9:?]+)?(?:,[^\]]*)?\]")
TQDM_LINE = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\d+it\s*\[")


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def prepare(nb: Mapping) -> dict:
    """A copy of ``nb`` to execute: old record cells out, the kernel's record cell appended."""
    out = copy.deepcopy(dict(nb))
    out["cells"] = [c for c in out["cells"] if not {RECORD_TAG, KERNEL_TAG} & set(_tags(c))]
    out["cells"].append({"cell_type": "code", "execution_count": None, "id": KERNEL_TAG,
                         "metadata": {"tags": [KERNEL_TAG]}, "outputs": [], "source": KERNEL_SOURCE})
    return _as_node(out)


def _as_node(nb: dict):
    try:
        import nbformat
    except ImportError:
        return nb
    return nbformat.from_dict(nb)


def finish(nb: Mapping, record: Mapping, root: Path = REPO_ROOT) -> tuple[dict, dict]:
    """The executed ``nb`` cleaned, with the run record (``record`` joined with the kernel's) as a
    markdown cell after the first cell; and that full record."""
    from .provenance import record_markdown

    nb = copy.deepcopy(dict(nb))
    kernel = {}
    for cell in nb["cells"]:
        if KERNEL_TAG in _tags(cell):
            for output in cell.get("outputs", []):
                kernel.update(output.get("data", {}).get(RECORD_MIME, {}))
    full = {**kernel, **{k: v for k, v in record.items() if v is not None}}
    nb = clean(nb, root)
    cell = {"cell_type": "markdown", "id": RECORD_TAG, "metadata": {"tags": [RECORD_TAG], "dropmatch": full},
            "source": _lines(record_markdown(full))}
    nb["cells"].insert(1 if nb["cells"] and nb["cells"][0]["cell_type"] == "markdown" else 0, cell)
    return nb, full


def clean(nb: Mapping, root: Path = REPO_ROOT) -> dict:
    """``nb`` without what changes from run to run without meaning: papermill's and nbclient's
    timings (notebook and cell metadata), the injected-parameters and record cells, widget state
    (progress-bar widgets become their final text, timings cut), tqdm's intermediate states and
    timings on stderr, and absolute paths (the checkout becomes ``.``, the home directory ``~``)."""
    nb = copy.deepcopy(dict(nb))
    metadata = dict(nb.get("metadata", {}))
    widgets = metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    metadata.pop("papermill", None)
    nb["metadata"] = metadata
    replace = _path_replacements(root)
    cells = []
    for cell in nb["cells"]:
        tags = _tags(cell)
        if {"injected-parameters", RECORD_TAG, KERNEL_TAG} & set(tags):
            continue
        cell = dict(cell)
        meta = {k: v for k, v in cell.get("metadata", {}).items() if k not in RUN_METADATA}
        if not meta.get("tags", True):
            meta.pop("tags")
        cell["metadata"] = meta
        if cell["cell_type"] == "code":
            cell["outputs"] = [_strip_paths(o, replace) for o in _clean_outputs(cell.get("outputs", []), widgets)]
        cells.append(cell)
    nb["cells"] = cells
    return nb


def _path_replacements(root: Path) -> list[tuple[str, str]]:
    pairs = [(str(Path(root).resolve()), "."), (str(Path(root)), "."), (str(Path.home()), "~")]
    pairs = [(a, b) for a, b in pairs if a not in ("/", "")]
    return sorted(dict(pairs).items(), key=lambda p: -len(p[0]))


def _replace(text: str, replace: list[tuple[str, str]]) -> str:
    """``text`` with each path ``old`` (and what lies under it) written as ``new``: only where a path
    starts (not inside /mnt/work/main) and ends (not /work/main2 or /work/main.git; a full stop after it
    ends a sentence)."""
    for old, new in replace:
        start = r"(?<![\w./-])" + re.escape(old)
        under, bare = ("" if new == "." else new + "/"), new  # literal replacements (no group references)
        text = re.sub(start + "/", lambda _, under=under: under, text)
        text = re.sub(start + r"(?![\w-]|\.[\w-])", lambda _, bare=bare: bare, text)
    return text


def _strip_paths(output: dict, replace: list[tuple[str, str]]) -> dict:
    def fix(value):
        if isinstance(value, str):
            return _replace(value, replace)
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value

    output = dict(output)
    if "text" in output:
        output["text"] = fix(output["text"])
    if "traceback" in output:
        output["traceback"] = fix(output["traceback"])
    if "data" in output:
        output["data"] = {k: (fix(v) if k.startswith("text/") else v) for k, v in output["data"].items()}
    return output


def progress_text(text: str) -> str:
    """Console tqdm output reduced to each bar's final state, without timings."""
    lines = []
    for line in text.split("\n"):
        line = line.rstrip("\r").split("\r")[-1]
        lines.append(TQDM_TIMING.sub("", line) if TQDM_LINE.search(line) else line)
    return "\n".join(lines)


def _widget_text(model_id: str, widgets: Mapping) -> str | None:
    """A tqdm widget's final state as console tqdm prints it (``desc: 100%|██████████| 6/6``), no
    timings; ``None`` without saved state."""
    children = widgets.get(model_id, {}).get("state", {}).get("children", [])
    states = [widgets.get(c.removeprefix("IPY_MODEL_"), {}).get("state", {}) for c in children]
    bars = [s for s in states if "max" in s]
    texts = [html.unescape(re.sub(r"<[^>]+>", "", s["value"])).replace("\u2007", " ").strip()
             for s in states if isinstance(s.get("value"), str)]
    if not bars or len(texts) != 2:
        return None
    total = bars[0].get("max") or 0
    filled = round(10 * bars[0].get("value", 0) / total) if total else 0
    return TQDM_TIMING.sub("", f"{texts[0]}|{'█' * filled}{' ' * (10 - filled)}| {texts[1]}").strip()


def _clean_outputs(outputs: list, widgets: Mapping) -> list:
    cleaned: list[dict] = []
    for output in outputs:
        output = dict(output)
        data = output.get("data", {})
        if WIDGET_VIEW in data:
            text = _widget_text(data[WIDGET_VIEW].get("model_id", ""), widgets)
            if text is None:
                continue
            output = {"output_type": "stream", "name": "stderr", "text": text + "\n"}
        if output.get("output_type") == "stream":
            text = _source({"source": output.get("text", "")})
            prev = cleaned[-1] if cleaned else None
            if prev and prev.get("output_type") == "stream" and prev.get("name") == output.get("name"):
                prev["text"] = prev["text"] + text  # one stream, so \r rewrites resolve across chunks
                continue
            output["text"] = text
        cleaned.append(output)
    for output in cleaned:
        if output.get("output_type") == "stream":
            output["text"] = _lines(progress_text(output["text"]))
    return [o for o in cleaned if o.get("output_type") != "stream" or "".join(o["text"]).strip()]
