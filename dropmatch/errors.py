"""Errors raised for bad input. Each message says what was wrong and how to fix it."""


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
