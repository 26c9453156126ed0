"""Where data and results live."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """Benchmark data: ``$DROPMATCH_DATA``, else ``../shared/data`` next to the checkout if it exists,
    else the repository's ``data/``."""
    env = os.environ.get("DROPMATCH_DATA")
    if env:
        return Path(env).expanduser()
    shared = REPO_ROOT.parent / "shared" / "data"
    return shared if shared.is_dir() else REPO_ROOT / "data"


def cache_root() -> Path:
    """Converted weights and library caches: ``$DROPMATCH_CACHE``, else ``~/.cache/dropmatch``."""
    return Path(os.environ.get("DROPMATCH_CACHE", Path.home() / ".cache" / "dropmatch"))
