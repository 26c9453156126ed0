"""The CPU's model name and feature flags, from ``/proc/cpuinfo`` (Linux; nothing elsewhere), read once."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType


@functools.cache
def cpu_fields() -> Mapping[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (``model name``, ``flags``, ...), read-only; empty where
    the file cannot be read."""
    try:
        with open("/proc/cpuinfo") as info:
            first = info.read().split("\n\n", 1)[0]
    except OSError:
        return MappingProxyType({})
    pairs = (line.split(":", 1) for line in first.splitlines() if ":" in line)
    return MappingProxyType({key.strip(): value.strip() for key, value in pairs})
