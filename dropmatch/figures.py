"""Saving figures with a manifest: ``save_figure(fig, "fig3_similarity", params, figures_dir)``."""

from __future__ import annotations

import json
from pathlib import Path

from .provenance import environment_record


def save_figure(fig, name: str, params: dict, figures_dir: str | Path, device: str = "cpu") -> list[Path]:
    """Write ``name``.png and ``name``.pdf, and ``name``.manifest.json (parameters, seeds, package
    versions, device, git revision) beside them. Returns the paths written."""
    out = Path(figures_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight", metadata={"CreationDate": None})
    manifest = {"figure": name, "parameters": params, "environment": environment_record(device)}
    manifest_path = out / f"{name}.manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=1, default=str))
    return [*paths, manifest_path]
