"""Drafters propose tokens; the engine verifies them. One protocol (:class:`Drafter`), one module each."""

from .base import (
    Draft,
    Drafter,
    FeatureDrafter,
    FollowingDrafter,
    GuessingDrafter,
    check_stop_below,
    draft_confidence,
)
from .lookup_first import LookupFirstDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter, lookup

__all__ = ["Draft", "Drafter", "FeatureDrafter", "FollowingDrafter", "GuessingDrafter", "LookupFirstDrafter",
           "ModelDrafter", "NgramDrafter", "check_stop_below", "draft_confidence", "lookup"]
