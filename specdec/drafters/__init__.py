"""Drafters: ``ngram`` (prompt lookup), ``draft`` (a smaller model) and ``self`` (the target)."""
from .base import Draft, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter, lookup

__all__ = ["Draft", "Drafter", "ModelDrafter", "NgramDrafter", "lookup"]
