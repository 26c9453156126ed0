"""Is the Hugging Face hub reachable? Decided fast, so offline machines fail at once, not after retries."""

from __future__ import annotations

import functools
import os
import socket
import threading
from urllib.parse import urlparse

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_reachable(timeout_s: float = 3.0) -> tuple[bool, str]:
    """(reachable, why not). Honours the HF offline variables; else one TCP connect (cached)."""
    for var in OFFLINE_VARIABLES:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False, f"{var} is set"
    return _probe(timeout_s)


@functools.cache
def _probe(timeout_s: float) -> tuple[bool, str]:
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    result: list[str] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            result.append("")
        except OSError as exc:
            result.append(f"{host}:{port} is not reachable ({exc})")

    thread = threading.Thread(target=probe, daemon=True)  # name resolution has no timeout of its own
    thread.start()
    thread.join(timeout_s + 0.5)
    if not result:
        return False, f"no answer from {host}:{port} within {timeout_s:.0f} s"
    return result[0] == "", result[0]
