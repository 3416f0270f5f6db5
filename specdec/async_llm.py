"""vLLM's ``AsyncLLM`` for asyncio code: an ``LLM`` whose engine steps on a thread of its own
(the server's scheduler: continuous batching, requests join and leave between steps), each
request streamed as ``RequestOutput``s while its tokens are verified."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from .api import LLM, CompletionOutput, Prompt, RequestOutput, render_prompt
from .config import RequestOutputKind, SamplingParams
from .lora import LoRARequest
from .server.metrics import ServerMetrics
from .server.scheduler import Closing, ServerRequest, Scheduler, Update, merged_updates
from .server.text import TextStream


class AsyncLLM:
    """``AsyncLLM(model, ...)`` takes ``LLM``'s arguments (or ``AsyncLLM(llm)`` an ``LLM``,
    whose ``generate`` refuses until ``shutdown``); ``max_queue``: requests that may wait
    beside the running ``max_batch_size`` (None: no limit, as vLLM's engine; past it
    ``generate`` raises ``RuntimeError``). ``async for out in engine.generate(prompt, sp,
    request_id)`` yields ``RequestOutput``s as ``sp.output_kind`` says (vLLM's
    ``RequestOutputKind``: by default each the whole output so far, the last with
    ``finished`` True, equal to what ``LLM.generate`` returns for the request); text that
    could begin a stop string waits until it does not. Leaving the loop early, or ``abort``,
    ends the request (finish reason ``abort``)."""

    def __init__(self, model: str | LLM | None = None, *args, max_queue: int | None = None, **kwargs):
        if isinstance(model, LLM) and (args or kwargs):
            raise ValueError("AsyncLLM(llm) takes a made LLM alone; give LLM's arguments instead of one")
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 or None (no limit), got {max_queue}")
        self.llm = model if isinstance(model, LLM) else LLM(model, *args, **kwargs)
        self.llm.serve(True)
        slots = self.llm.engine_config.max_batch_size
        self.metrics = ServerMetrics(self.llm.target.name, slots)
        self.scheduler = Scheduler(self.llm.engine, self.metrics, slots,
                                   sys.maxsize - slots if max_queue is None else max_queue)
        self.scheduler.start()
        self._preparing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-prepare")
        self._running: dict[str, list[ServerRequest]] = {}  # request id -> its completions
        self._ids = itertools.count()
        self._closed = False

    # vLLM's names for the state
    @property
    def is_running(self) -> bool:
        return not self._closed and self.scheduler.alive

    @property
    def errored(self) -> bool:
        return self.scheduler.error is not None

    async def get_tokenizer(self):
        return self.llm.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm.get_default_sampling_params()

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one prompt's completions (``request_id``: a name no running request has;
        default "async-0", "async-1", ...; ``lora_request``: its LoRA adapter, as
        ``LLM.generate``'s). Bad input raises ``ValueError`` before anything is yielded."""
        if self._closed:
            raise RuntimeError("this AsyncLLM is shut down")
        sp = self.get_default_sampling_params() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sp).__name__}")
        rid = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        if rid in self._running:
            raise ValueError(f"request id {rid!r} is running already")
        self._running[rid] = reqs = []  # taken now: a second request with the id is refused while this one prepares
        try:
            loop = asyncio.get_running_loop()
            text, seqs = await loop.run_in_executor(self._preparing, self._prepare, prompt, sp, lora_request)
            if len(seqs) > self.scheduler.capacity:
                raise ValueError(f"{len(seqs)} completions exceed what this engine holds at once "
                                 f"({self.scheduler.capacity}: max_batch_size + max_queue)")
            reqs += [ServerRequest(s, loop) for s in seqs]
            try:
                self.scheduler.submit(reqs)
            except Closing:
                raise RuntimeError("this AsyncLLM is shut down") from None
            except Exception as e:  # QueueFull
                raise RuntimeError(str(e)) from None
            async for out in self._outputs(rid, text, reqs, sp.output_kind):
                yield out
        finally:  # finished, or the caller left early (or was cancelled): free the slots
            del self._running[rid]
            for r in reqs:
                if not r.finished:
                    self.scheduler.abort(r)

    def _prepare(self, prompt: Prompt, sp: SamplingParams, lora_request: LoRARequest | None):
        text, ids = render_prompt(self.llm.tokenizer, prompt)
        return text, self.llm.make_sequences({"prompt_token_ids": ids}, sp, cap_max_tokens=True,
                                             lora_request=lora_request)

    async def _outputs(self, rid: str, prompt: str | None, reqs: list[ServerRequest],
                       kind: RequestOutputKind) -> AsyncIterator[RequestOutput]:
        """The request's outputs from its completions' updates, as ``kind`` says."""
        seqs = [r.seq for r in reqs]
        streams = [Streamed(self.llm, s.sampling, s.text_context) for s in seqs]
        ids = seqs[0].ids[:seqs[0].prompt_len]  # the prompt's
        lora = seqs[0].lora and seqs[0].lora.request
        left, prompt_logprobs, unsent = len(reqs), None, None
        async with contextlib.aclosing(merged_updates(reqs)) as updates:  # (completion, Update)
            async for i, u in updates:
                if u.error:  # what the request's logits processor raised, else the engine's failure
                    raise u.failure or RuntimeError(u.error)
                delta = streams[i].add(u)
                left -= bool(u.finish_reason)
                if prompt_logprobs is None and i == 0 and u.token_ids:  # prefilled: vLLM sends them first
                    prompt_logprobs = self.llm._prompt_logprobs(seqs[0])
                    unsent = prompt_logprobs
                news = [CompletionOutput(i, delta, list(u.token_ids), u.finish_reason, streams[i].logprobs_since(u),
                                         streams[i].cumulative_logprob, seqs[i].stop_reason)]
                if not left:  # the whole result, as LLM.generate's (with DELTA, the last news)
                    final = self.llm._output(seqs, prompt, rid)
                    if kind == RequestOutputKind.DELTA:
                        final.outputs, final.prompt_logprobs = news, unsent
                    yield final
                elif kind == RequestOutputKind.CUMULATIVE:
                    yield RequestOutput(rid, prompt, ids, [st.output(j) for j, st in enumerate(streams)], {},
                                        finished=False, prompt_logprobs=prompt_logprobs,
                                        num_cached_tokens=seqs[0].metrics.cached_prompt_tokens, lora_request=lora)
                elif kind == RequestOutputKind.DELTA and (u.token_ids or delta or u.finish_reason):
                    yield RequestOutput(rid, prompt, ids, news, {}, finished=False, prompt_logprobs=unsent,
                                        num_cached_tokens=seqs[0].metrics.cached_prompt_tokens, lora_request=lora)
                    unsent = None

    async def abort(self, request_id: str | list[str]) -> None:
        """End running requests (vLLM's): each one's stream ends with finish reason ``abort``."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            for r in self._running.get(rid, ()):
                self.scheduler.abort(r)

    def shutdown(self) -> None:
        """Stop the engine's thread (running requests end with finish reason ``abort``); the
        ``LLM``'s ``generate`` works again."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.close()
        self.scheduler.stop(timeout=None)  # a step under way ends first: then the LLM is free again
        self._preparing.shutdown(wait=False)
        self.llm.serve(False)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


AsyncLLMEngine = AsyncLLM  # vLLM's older name


class Streamed:
    """One completion's output so far, from its updates: token ids, the text that is safe to
    show (``TextStream``) and its logprobs in vLLM's form."""

    def __init__(self, llm: LLM, sp: SamplingParams, context: tuple[int, ...] = ()):
        self.llm, self.sp = llm, sp
        self.text = TextStream(llm.tokenizer, sp, context) if sp.detokenize else None
        self.ids: list[int] = []
        self.logprobs: list | None = [] if sp.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if sp.logprobs is not None else None
        self.finish_reason: str | None = None

    def add(self, u: Update) -> str:
        """Take the update; the text it adds."""
        self.ids += u.token_ids
        if self.logprobs is not None:
            self.logprobs += self.llm._logprobs(u.token_ids, u.logprobs, self.sp.detokenize)
            self.cumulative_logprob += sum(e.logprob for e in u.logprobs)
        self.finish_reason = u.finish_reason
        if self.text is None:
            return ""
        return self.text.finish(u.token_ids, u.text) if u.finish_reason else self.text.add(u.token_ids)

    def logprobs_since(self, u: Update) -> list | None:
        """The logprobs of ``u``'s tokens (the last taken)."""
        return None if self.logprobs is None else self.logprobs[len(self.logprobs) - len(u.token_ids):]

    def output(self, index: int) -> CompletionOutput:
        """The completion so far (its finish reason once it finished; no stop reason yet)."""
        text = "" if self.text is None else self.text.text[:self.text.sent]
        return CompletionOutput(index, text, list(self.ids), self.finish_reason,
                                None if self.logprobs is None else list(self.logprobs), self.cumulative_logprob)
