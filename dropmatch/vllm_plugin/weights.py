"""The embedded Gemma-3-270M as a vLLM model directory.

The converted directory (``dropmatch.models.gemma_weights_dir()``, made in the main environment)
loads in vLLM once ``config.json`` names ``"architectures": ["Gemma3ForCausalLM"]`` (without it
vLLM builds an embedding model). :func:`vllm_model_dir` makes a sibling directory of symlinks with
that config, leaving the converted one untouched.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ..paths import REPO_ROOT, cache_root

CONVERTED = "gemma-3-270m"
LINKED = "gemma-3-270m-vllm"
_CONVERT = "from dropmatch.models import gemma_weights_dir; print(gemma_weights_dir())"


def converted_dir(create: bool = True) -> Path:
    """The converted Gemma directory; with ``create``, convert it first (about a minute) with the
    main environment's python (``.venv``), which has the pinned transformers and the GGUF package."""
    out = cache_root() / CONVERTED
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    if not create:
        raise FileNotFoundError(f"{out} is missing; run `{_CONVERT}` in the main environment")
    main_python = REPO_ROOT / ".venv" / "bin" / "python"
    if not main_python.exists():
        raise FileNotFoundError(f"{out} is missing and the main environment {main_python} that converts it is "
                                f"absent: run `make install`, or `{_CONVERT}` in an environment with this project")
    subprocess.run([str(main_python), "-c", _CONVERT], check=True, cwd=REPO_ROOT)
    return out


def vllm_model_dir(create: bool = True) -> Path:
    """``$DROPMATCH_CACHE/gemma-3-270m-vllm``: symlinks to the converted files plus a config.json
    with the architectures entry."""
    source = converted_dir(create)
    out = source.parent / LINKED
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name == "config.json" or f.name.startswith("."):
            continue
        link = out / f.name
        if not link.is_symlink() or link.resolve() != f.resolve():
            link.unlink(missing_ok=True)
            link.symlink_to(f.resolve())
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["Gemma3ForCausalLM"]
    text = json.dumps(config, indent=1)
    target = out / "config.json"
    if not target.exists() or target.read_text() != text:
        tmp = out / ".config.json.tmp"
        tmp.write_text(text)
        tmp.replace(target)
    return out
