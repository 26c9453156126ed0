"""Re-entrant monkey-patching: every vLLM process calls the plugin's register functions, maybe twice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def wrap_once(owner: Any, name: str, make: Callable[[Any], Any], mark: str) -> None:
    """Replace ``owner.name`` by ``make(original)`` unless a wrapper carrying ``mark`` is already there."""
    original = getattr(owner, name)
    if getattr(original, mark, False):
        return
    wrapped = make(original)
    setattr(wrapped, mark, True)
    setattr(owner, name, wrapped)
