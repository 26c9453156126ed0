"""The plugin's settings: ``additional_config={"dropmatch": {...}}`` parsed and checked (no vLLM import)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError
from ..heads.dropout import check_dropout_args
from ..rules.dropmatch import check_criterion_args

CONFIG_KEY = "dropmatch"
_FIELDS = ("k", "p_drop", "criterion", "majority", "seed", "enabled")


@dataclass(frozen=True)
class DropMatchVllmConfig:
    """DropMatch inside vLLM: K dropout heads with keep probability 1 - ``p_drop`` on the LM-head input.

    ``enabled=False`` keeps the plugin attached but leaves vLLM's rule untouched (used by the
    benchmark and the tests to run stock speculative decoding on the same engine).
    """

    k: int = 5
    p_drop: float = 0.3
    criterion: str = "js+majority"
    majority: str = "strict"
    seed: int = 0
    enabled: bool = True

    def __post_init__(self) -> None:
        check_dropout_args(self.k, self.p_drop)
        check_criterion_args(self.criterion, self.majority)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"dropmatch seed must be an integer, got {self.seed!r}")
        if not isinstance(self.enabled, bool):  # "false" from a JSON string would be truthy
            raise ConfigError(f"dropmatch enabled must be true or false, got {self.enabled!r}")

    def updated(self, **changes: Any) -> DropMatchVllmConfig:
        """A copy with ``changes`` applied (checked like the original)."""
        return replace(self, **_known(changes))


def _known(values: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"unknown dropmatch option(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    return dict(values)


def from_additional_config(additional_config: Any) -> DropMatchVllmConfig | None:
    """The DropMatch settings in vLLM's ``additional_config``, or ``None`` when it names none."""
    if not isinstance(additional_config, Mapping) or CONFIG_KEY not in additional_config:
        return None
    section = additional_config[CONFIG_KEY]
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f"additional_config['{CONFIG_KEY}'] must be a mapping, got {type(section).__name__}")
    return DropMatchVllmConfig(**_known(section))
