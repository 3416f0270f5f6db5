"""Model runtimes: the torch runtime (Llama and Gemma families), llama.cpp (GGUF) and the transformers fallback."""
from .loading import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
