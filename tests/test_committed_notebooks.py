"""The committed notebooks carry the outputs of the last default-preset run and its record, cleanly.

``make reproduce`` (the default preset) refreshes them; these tests fail until its notebooks are committed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dropmatch import notebook_record
from dropmatch.paths import REPO_ROOT
from dropmatch.reproduce import CANONICAL, notebooks

NOTEBOOKS = notebooks()


def _record_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if notebook_record.RECORD_TAG in c.get("metadata", {}).get("tags", [])]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_outputs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert any(c.get("outputs") for c in code), f"{path.name} has no outputs: run `make reproduce` and commit it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_has_its_run_record(path):
    cells = _record_cells(json.loads(path.read_text()))
    assert len(cells) == 1, f"{path.name} has no run record: run `make reproduce` and commit it"
    record = cells[0]["metadata"]["dropmatch"]
    assert record["preset"] == CANONICAL and record["notebook"] == path.name
    assert record["revision"] and record["revision"]["commit"] and "dirty" in record["revision"]
    assert record["device"] and record["date"] and record["parameters"]
    text = "".join(cells[0]["source"])
    for part in (CANONICAL, record["revision"]["commit"][:12], record["device"], record["date"]):
        assert part in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_clean(path):
    text = path.read_text()
    for absolute in (str(REPO_ROOT), str(Path.home())):
        assert absolute not in text, f"{path.name} holds absolute paths ({absolute})"
    assert '"papermill"' not in text and notebook_record.WIDGET_STATE not in text
    assert "injected-parameters" not in text and notebook_record.KERNEL_TAG not in text
