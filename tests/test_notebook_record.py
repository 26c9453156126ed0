"""Cleaning executed notebooks: timings, widget state and absolute paths go; figures, tables and the record stay."""

from __future__ import annotations

import json

from dropmatch import notebook_record as nr
from dropmatch.notebook_cells import same_sources

PNG = "iVBORw0KGgoAAAANSUhEUg=="


def _executed(root) -> dict:
    """A notebook as papermill leaves it: its metadata, an injected cell, a widget bar, console bars."""
    timing = {"papermill": {"duration": 0.1, "start_time": "2026-01-01T00:00:00", "status": "completed"},
              "execution": {"iopub.status.busy": "2026-01-01T00:00:00Z"}}
    widget = {"HB": {"state": {"children": ["IPY_MODEL_L", "IPY_MODEL_P", "IPY_MODEL_R"]}},
              "L": {"state": {"value": "gsm8k sd: 100%"}},
              "P": {"state": {"value": 6.0, "max": 6.0}},
              "R": {"state": {"value": "\u20076/6\u2007[00:10&lt;00:00,\u20070.61it/s]"}}}
    code = [
        {"output_type": "display_data", "metadata": {},
         "data": {nr.WIDGET_VIEW: {"model_id": "HB"}, "text/plain": ["gsm8k sd:   0%|          | 0/6"]}},
        {"output_type": "stream", "name": "stderr", "text": ["\rmining:   0%|          | 0/2 [00:00<?, ?it/s]"]},
        {"output_type": "stream", "name": "stderr", "text": ["\rmining: 100%|██████████| 2/2 [00:03<00:00,  1.52s/it]"]},
        {"output_type": "stream", "name": "stderr", "text": ["\n"]},
        {"output_type": "stream", "name": "stdout", "text": [f"wrote {root}/results/default/x.csv\n"]},
        {"output_type": "execute_result", "execution_count": 3, "metadata": {},
         "data": {"text/html": ["<table><tr><td>0.5</td></tr></table>"], "text/plain": ["   tau\n0  0.5"]}},
        {"output_type": "display_data", "metadata": {}, "data": {"image/png": PNG, "text/plain": ["<Figure>"]}},
    ]
    return {
        "metadata": {"kernelspec": {"name": "python3"}, "papermill": {"duration": 9.0, "input_path": str(root)},
                     "widgets": {nr.WIDGET_STATE: {"state": widget}}},
        "nbformat": 4, "nbformat_minor": 5,
        "cells": [
            {"cell_type": "markdown", "id": "t", "metadata": {**timing, "tags": []}, "source": "# Title"},
            {"cell_type": "code", "id": "p", "execution_count": 1, "metadata": {**timing, "tags": ["parameters"]},
             "outputs": [], "source": "k = 5"},
            {"cell_type": "code", "id": "i", "execution_count": 2, "metadata": {"tags": ["injected-parameters"]},
             "outputs": [], "source": f"# Parameters\nresults_dir = '{root}/results/default'\n"},
            {"cell_type": "code", "id": "c", "execution_count": 3, "metadata": timing, "outputs": code,
             "source": "run()"},
        ],
    }


def test_clean_strips_timings_widget_state_paths_and_the_injected_cell(tmp_path):
    nb = nr.clean(_executed(tmp_path), root=tmp_path)
    text = json.dumps(nb)
    assert "papermill" not in text and "iopub" not in text and "widgets" not in nb["metadata"]
    assert str(tmp_path) not in text and "injected-parameters" not in text
    assert [c["id"] for c in nb["cells"]] == ["t", "p", "c"]
    assert nb["cells"][1]["metadata"] == {"tags": ["parameters"]} and nb["cells"][0]["metadata"] == {}
    outputs = nb["cells"][2]["outputs"]
    stderr = "".join(outputs[0]["text"])
    assert stderr == "gsm8k sd: 100%|██████████| 6/6\nmining: 100%|██████████| 2/2\n"  # final states, no timings
    assert "".join(outputs[1]["text"]) == "wrote results/default/x.csv\n"


def test_clean_keeps_tables_and_figures(tmp_path):
    outputs = nr.clean(_executed(tmp_path), root=tmp_path)["cells"][2]["outputs"]
    assert outputs[2]["data"]["text/html"] == ["<table><tr><td>0.5</td></tr></table>"]
    assert outputs[3]["data"]["image/png"] == PNG


def test_finish_puts_the_record_after_the_title_and_prepare_takes_it_out(tmp_path):
    executed = nr.prepare(_executed(tmp_path))
    assert executed["cells"][-1]["metadata"]["tags"] == [nr.KERNEL_TAG]
    executed["cells"][-1]["outputs"] = [{"output_type": "display_data", "metadata": {},
                                         "data": {nr.RECORD_MIME: {"device": "cpu", "date": "2026-01-01"}}}]
    nb, record = nr.finish(executed, {"preset": "default", "notebook": "01_a.ipynb", "revision": None}, root=tmp_path)
    assert [c["id"] for c in nb["cells"]] == ["t", nr.RECORD_TAG, "p", "c"]
    assert record == {"device": "cpu", "date": "2026-01-01", "preset": "default", "notebook": "01_a.ipynb"}
    cell = nb["cells"][1]
    assert cell["metadata"]["dropmatch"] == record and "**Run record**" in "".join(cell["source"])
    again = nr.prepare(nb)  # the next run: one record cell, no stale one
    assert [c["id"] for c in again["cells"]] == ["t", "p", "c", nr.KERNEL_TAG]
    assert same_sources(nb, _executed(tmp_path))


def test_progress_text_keeps_each_bars_last_state():
    text = "\rx:  50%|█████     | 1/2 [00:01<00:01, 1.0it/s]\rx: 100%|██████████| 2/2 [00:02<00:00, 1.0it/s]\nok\n"
    assert nr.progress_text(text) == "x: 100%|██████████| 2/2\nok\n"
    assert nr.progress_text("steps: 5it [00:01, 3.2it/s]\n") == "steps: 5it\n"


def test_paths_are_stripped_where_they_start_and_end():
    from dropmatch.notebook_record import _replace

    replace = [("/work/main", "."), ("/root", "~")]
    assert _replace("see /work/main/data/x.csv and /root/.cache", replace) == "see data/x.csv and ~/.cache"
    assert _replace("a cache under /root.", replace) == "a cache under ~."  # the sentence's full stop is not the path's
    for kept in ("mounted at /mnt/work/main/data", "/work/main2/x", "/work/main.git", "a/root/b"):
        assert _replace(kept, replace) == kept
