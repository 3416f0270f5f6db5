"""Drafters: ``ngram`` (prompt lookup), ``draft`` (a smaller model), ``self`` (the target) and
``eagle`` / ``eagle3`` (a head over the target's hidden states)."""
from .base import Draft, Drafter
from .model import EagleDrafter, ModelDrafter
from .ngram import NgramCorpus, NgramDrafter, lookup

__all__ = ["Draft", "Drafter", "EagleDrafter", "ModelDrafter", "NgramCorpus", "NgramDrafter", "lookup"]
