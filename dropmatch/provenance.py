"""What produced a result: git revision (clean or dirty), run context, models, device, CPU kernels.

``python -m dropmatch.reproduce`` fixes the revision once at its start (``DROPMATCH_RUN_REVISION``,
so every manifest of a run agrees although the run rewrites ``notebooks/`` and ``figures/``) and gives
each notebook's kernel its context (``DROPMATCH_RUN_CONTEXT``: preset, notebook, all parameters).
:func:`run_record` joins these with the loaded models and the machine; :func:`record_markdown`
renders it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import weakref
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import torch

from .cpuinfo import cpu_fields
from .notebook_cells import same_sources
from .paths import REPO_ROOT

PACKAGES = ("dropmatch", "torch", "transformers", "datasets", "evaluate", "numpy", "scikit-learn", "papermill")
REVISION_ENV = "DROPMATCH_RUN_REVISION"
CONTEXT_ENV = "DROPMATCH_RUN_CONTEXT"
# Instruction-set flags that decide which int8 / bfloat16 kernels run (and so how results round).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
# Outputs of a run, not inputs to it: changes there leave the tree clean (notebooks: outputs only).
OUTPUT_DIRS = ("figures/", "results/")
# Notebook variables computed from the parameters that a record names beside them.
DERIVED_NAMES = ("p_equal", "hidden_size")
_MAX_PATHS = 50
_seen_models: list[weakref.ref] = []


def _git(*args: str, root: Path) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout


def _changed_paths(root: Path) -> list[str]:
    """Paths git reports as modified, staged, deleted or untracked, less outputs of a run: anything
    under ``OUTPUT_DIRS`` and notebooks whose cell sources equal HEAD's."""
    entries = _git("status", "--porcelain=v1", "-z", "--untracked-files=all", root=root).split("\0")
    paths, skip = [], False
    for entry in entries:
        if skip or not entry:  # the source path of a rename follows its entry
            skip = False
            continue
        status, path = entry[:2], entry[3:]
        skip = "R" in status or "C" in status
        if path.startswith(OUTPUT_DIRS):
            continue
        if path.endswith(".ipynb") and status.strip() == "M" and _notebook_sources_unchanged(root, path, same_sources):
            continue
        paths.append(path)
    return sorted(paths)


def _notebook_sources_unchanged(root: Path, path: str, same_sources) -> bool:
    try:
        head = json.loads(_git("show", f"HEAD:{path}", root=root))
        return same_sources(head, json.loads((root / path).read_text()))
    except (OSError, ValueError, subprocess.SubprocessError):
        return False


def revision_record(root: Path = REPO_ROOT) -> dict | None:
    """``{"commit", "dirty", "changed" (paths), "text"}``; ``text`` is the commit if the tree is clean,
    else ``<commit> (dirty: N files changed)``. The run's own revision (``DROPMATCH_RUN_REVISION``)
    when set; ``None`` outside a git checkout."""
    pinned = os.environ.get(REVISION_ENV)
    if pinned:
        return json.loads(pinned)
    try:
        commit = _git("rev-parse", "HEAD", root=root).strip()
        changed = _changed_paths(root)
    except (OSError, subprocess.SubprocessError):
        return None
    text = commit if not changed else f"{commit} (dirty: {len(changed)} file{'s' * (len(changed) != 1)} changed)"
    return {"commit": commit, "dirty": bool(changed), "changed": changed[:_MAX_PATHS], "text": text}


def git_revision() -> str | None:
    """The revision as one string: the commit, or ``<commit> (dirty: N files changed)``."""
    record = revision_record()
    return record["text"] if record else None


def relative(value):
    """``value`` with absolute paths inside the checkout made relative to it (strings, lists, dicts)."""
    if isinstance(value, str):
        root = str(REPO_ROOT)
        return re.sub(re.escape(root) + r"(?![\w.-])", ".", value.replace(root + "/", "")) if root in value else value
    if isinstance(value, Mapping):
        return {k: relative(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [relative(v) for v in value]
    return value


def machine_record() -> dict:
    """CPU model, the kernel-relevant flags, torch's build, threads and kernel choices, the GPUs."""
    from .heads import bf16_matmul_supported

    fields = cpu_fields()
    cpu = fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"cpu": cpu, "kernel_flags": {f: f in flags for f in KERNEL_FLAGS},
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "quantized_engine": torch.backends.quantized.engine,
            "bf16_gemm": bf16_matmul_supported(), "cuda": cuda, "python": platform.python_version()}


def note_models(pair) -> None:
    """Remember ``pair`` as the models this process runs (runner and mining call it): a record made
    later without ``models`` (a figure's manifest) names them."""
    _seen_models[:] = [weakref.ref(pair)]


def _last_models():
    return _seen_models[0]() if _seen_models else None


def describe_model(lm) -> str:
    """What a loaded model is, from the model itself: ``int8 dynamic`` when torch's dynamic
    quantization replaced its linear layers, else the dtype of its weights; and its device(s)."""
    from torch.ao.nn.quantized import dynamic

    modules = list(lm.model.modules())
    kind = ("int8 dynamic" if any(isinstance(m, dynamic.Linear) for m in modules)
            else str(next(lm.model.parameters()).dtype).replace("torch.", ""))
    spread = getattr(lm.model, "hf_device_map", None)
    devices = sorted({str(d) for d in spread.values()}) if spread and len(set(spread.values())) > 1 else [str(lm.device)]
    return f"{kind} on {'+'.join(devices)}"


def cpu_model() -> str:
    """The CPU's model name where ``/proc/cpuinfo`` gives it (Linux), else the platform's processor or machine."""
    name = cpu_fields().get("model name", "")
    machine = platform.processor() or platform.machine()
    return f"{name} ({machine})" if name else machine


def machine_line() -> str:
    """One line naming the processor (its model where known: timings differ between an AVX2 EPYC and an AMX
    Xeon), torch's threads and the torch and Python versions."""
    return (f"{cpu_model()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, python {platform.python_version()}")


def models_record(pair) -> dict:
    """Each model's kind (dtype or int8 dynamic) and device(s), and the device the target's head ran on."""
    device = torch.device(pair.target.device)
    return {"name": pair.name, "target": describe_model(pair.target),
            "draft": describe_model(pair.draft) if pair.draft is not None else None,
            "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def run_context() -> dict:
    """What ``dropmatch.reproduce`` told this kernel: preset, notebook, all parameters (``{}`` standalone)."""
    text = os.environ.get(CONTEXT_ENV)
    return json.loads(text) if text else {}


def _jsonable(value):
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return None


def derived_values(namespace: Mapping, parameters: Mapping) -> dict:
    """Values a notebook computed from its parameters: parameters it reassigned (``thresholds=None``
    set from shares) and ``DERIVED_NAMES`` (the equal-noise ``p_equal``)."""
    out = {}
    for name, given in parameters.items():
        if name in namespace and _jsonable(namespace[name]) != _jsonable(given):
            out[name] = _jsonable(namespace[name])
    for name in DERIVED_NAMES:
        if name in namespace and _jsonable(namespace[name]) is not None:
            out[name] = _jsonable(namespace[name])
    return out


def notebook_namespace() -> dict | None:
    """The running notebook's globals, or ``None`` outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "user_ns", None)


def run_record(params: Mapping | None = None, models=None, derived: Mapping | None = None,
               namespace: Mapping | None = None) -> dict:
    """The record of a run: preset, notebook, every parameter (from reproduce, else ``params``), derived
    values, the models and their device, the revision, the machine's CPU kernels, the date.

    ``models``: the loaded ``ModelPair`` (default: ``namespace["models"]``, else the pair the runner last
    ran). ``namespace``: the notebook's globals (default: IPython's, when running in a kernel)."""
    context = run_context()
    namespace = notebook_namespace() if namespace is None else namespace
    parameters = {**(params or {}), **context.get("parameters", {})}
    if models is None and namespace is not None and hasattr(namespace.get("models"), "target"):
        models = namespace["models"]
    models = models if models is not None else _last_models()
    found = {**(derived_values(namespace, parameters) if namespace is not None else {}), **(derived or {})}
    models_info = models_record(models) if models is not None else None
    machine = machine_record()
    device = models_info["device"] if models_info else ("cpu" if not machine["cuda"] else None)
    return relative({
        "preset": context.get("preset"), "notebook": context.get("notebook"), "parameters": parameters,
        "passed": context.get("passed"), "derived": found, "models": models_info, "device": device,
        "revision": revision_record(), "date": _now(), "machine": machine,
        "kernel_note": kernel_note(models_info, machine),
    })


def kernel_note(models_info: dict | None, machine: dict) -> str | None:
    """Where a number depends on this CPU's kernels (any model part on the CPU), say so."""
    parts = " ".join(str(v) for v in (models_info or {}).values())
    if models_info is not None and "cpu" not in parts:
        return None
    native = "yes" if machine["bf16_gemm"] else "no"
    return (f"CPU-kernel dependent: the int8 dynamic-quantized draft (torch {machine['quantized_engine']} / fbgemm "
            f"kernels), the bfloat16 screened heads and EAGLE-3 heads drafting in bfloat16 for a float32 target "
            f"(both only with native bf16 GEMMs: {native}) round as this CPU's instruction set makes them; on a CPU "
            "with other avx512_bf16 / amx / avx512_vnni support, draft tokens, acceptance and tau may differ slightly.")


def record_markdown(record: Mapping) -> str:
    """The visible form of a :func:`run_record`: a short table."""
    revision = record.get("revision") or {}
    rev = "unknown (not a git checkout)"
    if revision:
        rev = f"`{revision['commit'][:12]}`" + (
            f" **dirty**: {len(revision['changed'])} file(s) changed ({', '.join(revision['changed'][:8])}"
            f"{', …' if len(revision['changed']) > 8 else ''})" if revision["dirty"] else " (clean)")
    machine = record.get("machine") or {}
    flags = ", ".join(f"{f}: {'yes' if on else 'no'}" for f, on in machine.get("kernel_flags", {}).items())
    models = record.get("models")
    models_text = (f"{models['name']}: target {models['target']}, draft {models['draft'] or 'none'}" if models
                   else "not reported")
    rows = [("preset", record.get("preset") or "none (run by hand)"), ("notebook", record.get("notebook") or "-"),
            ("revision", rev), ("date", record.get("date", "")), ("device", record.get("device") or "unknown"),
            ("models", models_text),
            ("machine", f"{machine.get('cpu')}; torch {machine.get('torch')}, {machine.get('torch_threads')} threads, "
                        f"quantized engine {machine.get('quantized_engine')}, GPUs: {', '.join(machine.get('cuda', [])) or 'none'}"),
            ("CPU kernels", flags),
            ("parameters", ", ".join(f"`{k}={v!r}`" for k, v in record.get("parameters", {}).items())),
            ("derived", ", ".join(f"`{k}={v!r}`" for k, v in (record.get("derived") or {}).items()) or "-")]
    lines = ["**Run record**", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if record.get("kernel_note"):
        lines += ["", record["kernel_note"]]
    return "\n".join(lines)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def environment_record(device: torch.device | str | None = None) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    device = torch.device(device) if device is not None else torch.device("cpu")
    revision = revision_record()
    return {
        "time": _now(),
        "packages": versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "git_revision": revision["text"] if revision else None,
        "revision": revision,
        "machine": machine_record(),
        "argv": sys.argv,
    }
