"""specdec: lossless speculative decoding for Hugging Face causal LMs."""
from .api import LLM, CompletionOutput, Logprob, RequestOutput
from .config import EngineConfig, SamplingParams, SpecConfig, StructuredOutputs

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "Logprob", "SamplingParams", "StructuredOutputs", "SpecConfig", "EngineConfig"]
__version__ = "0.1.0"
