"""specdec: lossless speculative decoding for Hugging Face causal LMs."""
from .api import LLM, RequestOutput
from .config import EngineConfig, SamplingParams, SpecConfig

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpecConfig", "EngineConfig"]
__version__ = "0.1.0"
