"""specdec: lossless speculative decoding for Hugging Face causal LMs."""
from .api import LLM, CompletionOutput, Logprob, RequestOutput, TextPrompt, TokensPrompt
from .async_llm import AsyncLLM, AsyncLLMEngine
from .config import EngineConfig, RequestOutputKind, SamplingParams, SpecConfig, StructuredOutputs
from .lora import LoRARequest

StructuredOutputsParams = GuidedDecodingParams = StructuredOutputs  # vLLM's names (current, and before 0.10.2)

__all__ = ["LLM", "AsyncLLM", "AsyncLLMEngine", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob", "SamplingParams", "StructuredOutputs",
           "StructuredOutputsParams", "GuidedDecodingParams", "TextPrompt", "TokensPrompt", "SpecConfig", "EngineConfig",
           "LoRARequest"]
__version__ = "0.1.0"
