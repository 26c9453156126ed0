"""Where a run writes, what a notebook run by hand uses, and the record in an executed notebook."""

from __future__ import annotations

import json

import nbformat
import papermill
import pytest

from dropmatch import notebook_record, reproduce
from dropmatch.paths import REPO_ROOT


@pytest.mark.parametrize("preset, overrides, figures, refresh", [
    ("default", {}, "figures", True),
    ("default", {"max_new_tokens": 8}, "figures/default", False),
    ("smoke", {}, "figures/smoke", False),
])
def test_only_the_default_preset_refreshes_notebooks_and_figures(preset, overrides, figures, refresh):
    out_dir, figures_dir, refreshes = reproduce.output_dirs(preset, overrides)
    assert out_dir == REPO_ROOT / "results" / preset and figures_dir == REPO_ROOT / figures and refreshes is refresh


@pytest.mark.parametrize("nb", reproduce.notebooks(), ids=lambda p: p.name)
def test_notebook_defaults_are_the_default_preset_and_leave_committed_figures_alone(nb):
    declared = {name: reproduce.parse_value(info["default"]) for name, info in papermill.inspect_notebook(str(nb)).items()}
    preset = reproduce.notebook_parameters("default", nb.name, reproduce.PRESETS["default"], {})
    assert {k: v for k, v in preset.items() if k in declared} == {k: declared[k] for k in preset if k in declared}
    assert declared["results_dir"] == "../results/manual"
    assert declared.get("figures_dir", "../figures/manual") == "../figures/manual"


def _notebook(path):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}, "language_info": {"name": "python"}})
    params = nbformat.v4.new_code_cell("n = 1\nthresholds = None\nresults_dir = '../results/manual'")
    params.metadata["tags"] = ["parameters"]
    body = ("from tqdm.auto import tqdm\nfor _ in tqdm(range(n), desc='loop'):\n    pass\n"
            "thresholds = [0.5]\nprint('n =', n)")
    nb.cells = [nbformat.v4.new_markdown_cell("# A notebook"), params, nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, path)


@pytest.mark.timeout(300)
def test_a_default_run_writes_the_notebook_back_with_its_record(tmp_path, monkeypatch):
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    _notebook(notebooks / "01_a.ipynb")
    monkeypatch.setattr(reproduce, "NOTEBOOK_DIR", notebooks)
    monkeypatch.setattr(reproduce, "FIGURES_DIR", tmp_path / "figures")
    assert reproduce.run("default", {}, results=tmp_path / "results") == 0
    written = json.loads((notebooks / "01_a.ipynb").read_text())
    assert written == json.loads((tmp_path / "results" / "01_a.ipynb").read_text())
    cells = written["cells"]
    assert [c["metadata"].get("tags") for c in cells] == [None, [notebook_record.RECORD_TAG], ["parameters"], None]
    record = cells[1]["metadata"]["dropmatch"]
    assert (record["preset"], record["notebook"], record["device"]) == ("default", "01_a.ipynb", "cpu")
    assert record["parameters"]["n"] == 1 and record["derived"] == {"thresholds": [0.5]} and record["date"]
    assert "papermill" not in json.dumps(written) and "widgets" not in written["metadata"]
    assert "".join(cells[3]["outputs"][-1]["text"]) == "n = 1\n"
    assert not (tmp_path / "figures").exists() or not any((tmp_path / "figures").iterdir())
