"""Saving figures with a manifest: ``save_figure(fig, "fig3_path_similarity", params, figures_dir, models=models)``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from .provenance import environment_record, run_record


def save_figure(fig, name: str, params: dict, figures_dir: str | Path, device: str | None = None, *,
                models=None, derived: Mapping | None = None) -> list[Path]:
    """Write ``name``.png and ``name``.pdf, and ``name``.manifest.json beside them: ``params``, and the
    run's record (:func:`dropmatch.provenance.run_record`: preset, notebook, every parameter, derived
    values, the models and their device, the revision, the CPU's kernels). ``models`` (the loaded
    ``ModelPair``) defaults to the notebook's ``models``; ``device`` to the models'. Returns the paths."""
    out = Path(figures_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(paths[1], bbox_inches="tight", metadata={"CreationDate": None})
    record = run_record(params, models=models, derived=derived)
    environment = environment_record(device or record["device"] or "cpu")
    environment.pop("argv")  # a kernel's connection file: the notebook is in the record
    manifest = {"figure": name, "parameters": params, "run": record, "environment": environment}
    manifest_path = out / f"{name}.manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=1, default=str))
    return [*paths, manifest_path]
