"""CUDA graphs for the torch runtime's small forwards (``CudaGraphs``), as vLLM and SGLang
decode: a forward's rows padded to one of a few sizes (``GRAPH_TOKEN_SIZES``), one graph per
KV cache, batch size and size."""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .torch_llama import Batch, KVCache, TorchLlama

log = logging.getLogger(__name__)

# On CUDA, forwards of at most GRAPH_MAX_TOKENS tokens per row replay a CUDA graph, their rows
# padded to the next of these sizes: a handful of graphs per batch size serves every verify
# width, prompt chunk and catch-up (padding is nearly free in a launch-bound forward)
GRAPH_TOKEN_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
GRAPH_MAX_TOKENS = GRAPH_TOKEN_SIZES[-1]


def graph_tokens(n: int) -> int:
    """The tokens per row of the graph that serves a forward of ``n <= GRAPH_MAX_TOKENS``."""
    return next(size for size in GRAPH_TOKEN_SIZES if size >= n)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: Batch  # the buffers the graph reads
    logits: torch.Tensor  # [B, T, vocab] in the model's dtype, the buffer it writes
    features: torch.Tensor | None  # [B, T, features]: the runtime's taps (None without)


class CudaGraphs:
    """The layer stack (``TorchLlama._layers``) captured as CUDA graphs and replayed, as vLLM
    and SGLang run decoding: a small forward is a few hundred kernels of a few microseconds
    each, so launching them one by one from Python costs more than running them (eager
    Qwen2.5-Coder-1.5B in bfloat16 on an H200: ~19 ms per token, for ~0.7 ms of weights).

    One graph per KV cache, batch size and tokens per row (``GRAPH_TOKEN_SIZES``: a forward's
    rows are padded up to one), captured the first time that shape comes (the capture's
    warm-up run is that forward's own); a cache that grows gets new ones.
    Every graph attends over its cache's whole capacity under the mask, so a graph serves any
    position. A cache's graphs share one memory pool and are dropped together, with the cache
    or when it grows: PyTorch cannot capture into a pool whose graphs are all gone (an internal
    assert, seen on torch 2.11 when one pool served every cache). A capture that fails turns
    graphs off for the runtime (logged once): the forward then runs eagerly, as before."""

    def __init__(self, runtime: "TorchLlama"):
        self.runtime = runtime
        # cache -> (its K and V buffers' addresses and K's shape, its memory pool, its graphs by (batch, tokens))
        self.by_cache: "weakref.WeakKeyDictionary[KVCache, tuple[tuple, tuple, dict]]" = weakref.WeakKeyDictionary()

    def run(self, cache: KVCache, x: Batch, tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[B, tokens, vocab]`` (float32) of ``x``'s first ``tokens`` rows (the
        others are padding), and their tapped hidden states (``TorchLlama.capture``). On the
        runtime's GPU (``cuda:N``), whichever is current."""
        with torch.cuda.device(self.runtime.device):
            return self._run(cache, x, tokens)

    def _run(self, cache: KVCache, x: Batch, tokens: int) -> torch.Tensor:
        buffer, pool, graphs = self.by_cache.get(cache, (None, None, None))
        now = (*(getattr(cache, b).data_ptr() for b in cache.buffers), tuple(cache.k.shape))  # grown: new shape
        if buffer != now:  # new, or grown since (slots or capacity): old graphs read freed memory
            buffer, pool, graphs = now, torch.cuda.graph_pool_handle(), {}
            self.by_cache[cache] = (buffer, pool, graphs)
        key = tuple(x.ids.shape)
        g = graphs.get(key)
        if g is None:
            (logits, features), g = self._capture(cache, x, pool)
            if g is not None:
                graphs[key] = g
            return logits[:, :tokens], None if features is None else features[:, :tokens]
        for f in fields(x):
            if getattr(x, f.name) is not None:
                getattr(g.inputs, f.name).copy_(getattr(x, f.name), non_blocking=True)
        g.graph.replay()
        # copies: the buffers are the next replay's
        features = None if g.features is None else g.features[:, :tokens].clone()
        return g.logits[:, :tokens].to(torch.float32, copy=True), features

    def _capture(self, cache: KVCache, x: Batch, pool) -> tuple[tuple, _Graph | None]:
        """Run ``x`` eagerly on a side stream (as warm-up; its logits and features are the
        answer), then capture the same forward: its K/V writes go to the same rows with the
        same values."""
        rt = self.runtime
        side = torch.cuda.Stream(rt.device)
        side.wait_stream(torch.cuda.current_stream(rt.device))
        with torch.cuda.stream(side):
            answer = rt._layers(cache, x)
        torch.cuda.current_stream(rt.device).wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                logits, features = rt._layers(cache, x, to_float=False)  # the model's dtype: half the buffer in bf16
        except Exception as e:  # an op that cannot be captured: eager from now on
            log.warning("CUDA graph capture failed (%s: %s); running eagerly", type(e).__name__, e)
            rt.graphs = None
            return answer, None
        return answer, _Graph(graph, x, logits, features)
