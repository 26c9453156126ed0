"""Errors raised for bad input. Each message says what was wrong and how to fix it."""

from __future__ import annotations

import sys
from collections.abc import Callable


class DropMatchError(Exception):
    """Base class for every error this package raises on purpose."""


class ConfigError(DropMatchError, ValueError):
    """An option is out of range or unknown (K < 1, p_drop outside [0, 1), unknown criterion...)."""


class ModelNotFoundError(DropMatchError, OSError):
    """A model id could not be resolved (no local directory and no reachable hub)."""


class VocabularyMismatchError(DropMatchError, ValueError):
    """Draft and target do not share a vocabulary."""


class PromptTooLongError(DropMatchError, ValueError):
    """The prompt plus the requested new tokens do not fit the model's context."""


class DataError(DropMatchError, OSError):
    """A benchmark file is missing or does not hold what it should."""


class SandboxError(DropMatchError, OSError):
    """The code sandbox cannot run generated code here (HumanEval cannot be scored)."""


class JudgeError(DropMatchError, OSError):
    """The LLM judge endpoint cannot be reached, refuses the request, or does not answer as an OpenAI-compatible
    chat-completions server does."""


def run_command(func: Callable[..., int | None], *args: object) -> int:
    """Call ``func(*args)`` as a command-line entry point and return its exit status: its own (0 for ``None``),
    or 2 after printing ``error: <message>`` for bad input (any :class:`DropMatchError`, a missing file), so
    that bad input never ends in a traceback."""
    try:
        return func(*args) or 0
    except (DropMatchError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
