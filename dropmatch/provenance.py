"""What produced a result: package versions, device, threads, git revision."""

from __future__ import annotations

import datetime
import platform
import subprocess
import sys
from importlib import metadata

import torch

from .paths import REPO_ROOT

PACKAGES = ("dropmatch", "torch", "transformers", "datasets", "evaluate", "numpy", "scikit-learn", "papermill")


def git_revision() -> str | None:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment_record(device: torch.device | str | None = None) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    device = torch.device(device) if device is not None else torch.device("cpu")
    return {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "packages": versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "git_revision": git_revision(),
        "argv": sys.argv,
    }
