"""Provenance: the revision says plainly whether the tree was dirty; records name models, device, kernels."""

from __future__ import annotations

import json
import subprocess

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from dropmatch import provenance  # noqa: E402
from dropmatch.figures import save_figure  # noqa: E402


def _git(root, *args):
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def _notebook(source: str, outputs: list | None = None) -> str:
    cell = {"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {}, "outputs": outputs or [],
            "source": source}
    return json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.REVISION_ENV, raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "01_a.ipynb").write_text(_notebook("x = 1"))
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "init")
    return tmp_path


def test_clean_tree_records_the_commit_alone(repo):
    record = provenance.revision_record(repo)
    assert record == {"commit": _git(repo, "rev-parse", "HEAD"), "dirty": False, "changed": [],
                      "text": _git(repo, "rev-parse", "HEAD")}


def test_dirty_tree_says_so_and_lists_the_paths(repo):
    (repo / "code.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 1\n")
    record = provenance.revision_record(repo)
    assert record["dirty"] and record["changed"] == ["code.py", "new.py"]
    assert record["text"] == f"{record['commit']} (dirty: 2 files changed)"


def test_outputs_of_a_run_leave_the_tree_clean(repo):
    (repo / "figures").mkdir()
    (repo / "figures" / "fig.png").write_bytes(b"png")
    outputs = [{"output_type": "stream", "name": "stdout", "text": "1\n"}]
    (repo / "notebooks" / "01_a.ipynb").write_text(_notebook("x = 1", outputs))  # outputs only
    assert not provenance.revision_record(repo)["dirty"]
    (repo / "notebooks" / "01_a.ipynb").write_text(_notebook("x = 2", outputs))  # the code changed
    assert provenance.revision_record(repo)["changed"] == ["notebooks/01_a.ipynb"]


def test_a_run_pins_its_revision_for_every_manifest(repo, monkeypatch):
    pinned = {"commit": "abc", "dirty": True, "changed": ["x.py"], "text": "abc (dirty: 1 file changed)"}
    monkeypatch.setenv(provenance.REVISION_ENV, json.dumps(pinned))
    assert provenance.revision_record(repo) == pinned and provenance.git_revision() == pinned["text"]


def test_run_record_names_context_models_derived_values_and_kernels(tiny, monkeypatch):
    context = {"preset": "default", "notebook": "06_x.ipynb", "parameters": {"thresholds": None, "k": 5},
               "passed": []}
    monkeypatch.setenv(provenance.CONTEXT_ENV, json.dumps(context))
    record = provenance.run_record({"k": 5}, namespace={"models": tiny, "thresholds": [0.2], "k": 5, "p_equal": 0.01})
    assert (record["preset"], record["notebook"], record["device"]) == ("default", "06_x.ipynb", "cpu")
    assert record["parameters"] == {"thresholds": None, "k": 5}
    assert record["derived"] == {"thresholds": [0.2], "p_equal": 0.01}
    assert record["models"]["name"] == tiny.name and "cpu" in record["models"]["target"]
    machine = record["machine"]
    assert {"avx512_bf16", "amx_bf16", "avx512_vnni"} <= set(machine["kernel_flags"])
    assert machine["torch_threads"] >= 1 and machine["torch"] and "fbgemm" in record["kernel_note"]
    text = provenance.record_markdown(record)
    for part in ("default", "06_x.ipynb", "cpu", record["date"], "avx512_bf16", "`thresholds=[0.2]`"):
        assert part in text


def test_figure_manifest_carries_the_run_record(tiny, tmp_path):
    fig, ax = plt.subplots()
    ax.plot([0, 1])
    paths = save_figure(fig, "demo", {"k": 5}, tmp_path, models=tiny)
    plt.close(fig)
    manifest = json.loads(paths[2].read_text())
    assert manifest["parameters"] == {"k": 5} and manifest["run"]["device"] == "cpu"
    assert manifest["run"]["models"]["name"] == tiny.name and "argv" not in manifest["environment"]
    assert manifest["environment"]["git_revision"] == (manifest["run"]["revision"] or {}).get("text")


def test_cpu_fields_are_the_first_processors_and_empty_without_the_file(monkeypatch, tmp_path):
    from dropmatch import cpuinfo

    listing = tmp_path / "cpuinfo"
    listing.write_text("processor\t: 0\nmodel name\t: Big Core\nflags\t\t: fpu avx2\n\n"
                       "processor\t: 1\nmodel name\t: Little Core\nflags\t\t: fpu\n")
    real_open = open
    monkeypatch.setattr(cpuinfo, "open", lambda path, *a, **k: real_open(listing if path == "/proc/cpuinfo" else path,
                                                                         *a, **k), raising=False)
    cpuinfo.cpu_fields.cache_clear()
    try:
        fields = cpuinfo.cpu_fields()
        assert (fields["model name"], fields["flags"]) == ("Big Core", "fpu avx2")
        with pytest.raises(TypeError):
            fields["flags"] = "avx512f"  # shared by every caller: read-only
        listing.unlink()
        cpuinfo.cpu_fields.cache_clear()
        assert dict(cpuinfo.cpu_fields()) == {}
    finally:
        cpuinfo.cpu_fields.cache_clear()
