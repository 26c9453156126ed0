"""Stop strings for :func:`~dropmatch.engine.generate`."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import ConfigError


def stop_strings(stop: str | Sequence[str]) -> tuple[str, ...]:
    """``stop`` as a tuple of its non-empty strings; a bare ``str`` is one stop string, not its characters."""
    return tuple(s for s in ((stop,) if isinstance(stop, str) else stop) if s)


class StopOnText:
    """Stop strings for :func:`~dropmatch.engine.generate`: ``stop`` is one string or several.

    The first ``m`` output tokens end in a stop string when the decoded text of their last ``window``
    tokens (a stop string's tokens plus context: some tokens decode differently after others) contains
    one. Called after every step, returns the smallest such ``m`` among the tokens not checked yet (those
    past the output it last saw, when this one extends it), else ``None``: a speculative step of any
    length is cut where plain decoding, asked after every token, stops.
    """

    def __init__(self, decode, stop: str | Sequence[str], window: int = 48):
        if window < 1:
            raise ConfigError(f"the stop-string window must be >= 1 token, got {window}")
        self.decode, self.stop, self.window = decode, stop_strings(stop), window
        self._checked: list[int] = []  # the latest output seen without a stop string

    def _contains(self, ids: Sequence[int]) -> bool:
        tail = self.decode(list(ids))
        return any(s in tail for s in self.stop)

    def __call__(self, output_ids: list[int]) -> int | None:
        checked = len(self._checked)
        if output_ids[:checked] != self._checked:  # not an extension: a new output
            checked = 0
        # one decode spans the windows of all new tokens; they are scanned one by one only if it holds a stop
        if self._contains(output_ids[max(0, checked + 1 - self.window) :]):
            for m in range(checked + 1, len(output_ids) + 1):
                if self._contains(output_ids[max(0, m - self.window) : m]):
                    return m
        self._checked = list(output_ids)
        return None
