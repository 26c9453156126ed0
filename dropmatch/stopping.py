"""Stop strings for :func:`~dropmatch.engine.generate`."""

from __future__ import annotations

from collections.abc import Sequence


class StopOnText:
    """Stop strings for :func:`~dropmatch.engine.generate`: once the decoded tail of the output (its
    last ``window`` tokens, enough for any stop string plus one speculative step) contains one of
    ``stop``, returns the length of the shortest output prefix that does; else ``None``."""

    def __init__(self, decode, stop: Sequence[str], window: int = 48):
        self.decode, self.stop, self.window = decode, tuple(s for s in stop if s), window

    def _contains(self, ids: Sequence[int]) -> bool:
        tail = self.decode(list(ids))
        return any(s in tail for s in self.stop)

    def __call__(self, output_ids: list[int]) -> int | None:
        start = max(0, len(output_ids) - self.window)
        if not self._contains(output_ids[start:]):
            return None
        low, high = start, len(output_ids)  # output[start:high] contains a stop, output[start:low] does not
        while high - low > 1:
            mid = (low + high) // 2
            if self._contains(output_ids[start:mid]):
                high = mid
            else:
                low = mid
        return high
