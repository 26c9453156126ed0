"""Notebook cells as the run record sees them: tags, sources, and whether two notebooks hold the same
cells. Imports nothing of this package, so provenance (which asks whether a notebook changed beyond its
outputs) and notebook_record (which writes the record) can both use it."""

from __future__ import annotations

from collections.abc import Mapping

RECORD_TAG = "run-record"
KERNEL_TAG = "run-record-kernel"


def _tags(cell: Mapping) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _source(cell: Mapping) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def same_sources(a: Mapping, b: Mapping) -> bool:
    """Whether two notebooks have the same cells (type and source), run-record cells aside."""
    def cells(nb):
        return [(c["cell_type"], _source(c)) for c in nb.get("cells", [])
                if not {RECORD_TAG, KERNEL_TAG, "injected-parameters"} & set(_tags(c))]
    return cells(a) == cells(b)
