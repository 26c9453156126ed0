"""Drafters propose tokens; the engine verifies them. One protocol (:class:`Drafter`), one module each."""

from .base import Draft, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter, lookup

__all__ = ["Draft", "Drafter", "ModelDrafter", "NgramDrafter", "lookup"]
