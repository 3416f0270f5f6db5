"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses`` (over the chat machinery, ``responses.py``), ``/v1/models`` (and
``/v1/models/{model}``), ``/tokenize``, ``/detokenize``, ``/health``, ``/version`` and ``/metrics``.

A handler validates and encodes its request, hands a ``Sequence`` per completion (``n``) to
the scheduler and reads the committed tokens back from their asyncio queues, streaming them
(SSE) or collecting them. A client that disconnects, or a stream that is cancelled, aborts
its request; the scheduler frees its KV slots at the next engine step.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import hmac
import itertools
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..answer import END_THINK, HARMONY, REASONING_PARSERS, THINK, AnswerParser, opens_reasoning, reasoning_tokens
from ..api import LLM, encode_prompt, vllm_logprobs
from ..config import SamplingParams
from ..lora import LoRARequest
from ..sequence import output_text, settled_text
from ..tools import PARSERS, TOOL_PARSERS
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
                       TokenizeChatRequest, TokenizeRequest, UnloadLoRAAdapterRequest, bad_request, model_not_found,
                       parse)
from .responses import CHAT_FIELDS, ResponseShaper, ResponsesRequest
from .scheduler import Closing, QueueFull, Scheduler, ServerRequest, Update, merged_updates
from .text import TextStream, TokenOffsets, prompt_offsets

log = logging.getLogger("specdec.server")

MIN_LOGPROB = -9999.0  # JSON has no -inf


def create_app(llm: LLM, *, served_model_name: str | list[str] | None = None, max_queue: int = 64,
               api_key: str | None = None, max_request_bytes: int = 2_000_000,
               enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None, chat_template: str | None = None,
               trust_request_chat_template: bool = False, allowed_origins: list[str] | tuple = ("*",),
               allowed_methods: list[str] | tuple = ("*",), allowed_headers: list[str] | tuple = ("*",),
               allow_credentials: bool = False, lora_modules: Iterable[LoRARequest] = (),
               allow_runtime_lora_updating: bool = False) -> FastAPI:
    """An app serving ``llm``: at most ``llm``'s max_batch_size requests run at once and
    ``max_queue`` more wait; beyond that a request gets 429. ``enable_auto_tool_choice``
    with a ``tool_call_parser`` (``tools.TOOL_PARSERS``: hermes, llama3_json, mistral,
    pythonic, qwen3_coder, openai) lets chat requests with tools have the model
    decide whether to call them (vLLM's flags); required and named tool choices need neither.
    ``reasoning_parser`` (``qwen3``, ``deepseek_r1``, ``openai_gptoss``) returns a thinking model's reasoning as
    ``reasoning_content``, apart from the content (``answer.py``); a GPT-OSS model's answers,
    and with auto tool choice by tool parser ``openai`` any model's, are read as harmony messages
    (``openai_gptoss``) unless another is given, as vLLM reads them. ``chat_template``: a Jinja
    template for chats instead of the tokenizer's (vLLM's ``--chat-template``); a request's own
    ``chat_template`` is taken only with ``trust_request_chat_template``, as vLLM. CORS, so that a
    browser page may call the API: ``allowed_origins`` / ``_methods`` / ``_headers`` and
    ``allow_credentials``, vLLM's flags with vLLM's defaults (any origin, no credentials).
    ``lora_modules``: LoRA adapters served beside the model (vLLM's ``--lora-modules``; the LLM
    made with ``enable_lora``): a request whose ``model`` is an adapter's ``lora_name`` runs
    through it; each is read and checked now. ``allow_runtime_lora_updating``: vLLM's
    ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and
    ``/v1/unload_lora_adapter`` (``{"lora_name"}``) add and remove adapters while serving
    (requests running through a removed one finish through it)."""
    if enable_auto_tool_choice and tool_call_parser not in PARSERS:
        raise ValueError(f"enable_auto_tool_choice needs a tool_call_parser: {', '.join(PARSERS)}")
    if reasoning_parser not in (None, *REASONING_PARSERS):
        raise ValueError(f"unknown reasoning_parser {reasoning_parser!r}; choose {', '.join(REASONING_PARSERS)}")
    missing = [t for t in (THINK, END_THINK) if t not in llm.tokenizer.get_vocab()] \
        if reasoning_parser in ("qwen3", "deepseek_r1") else []
    if missing:  # vLLM refuses such a model
        log.warning("reasoning parser %r: %s's tokenizer has no %s token, so the model likely never thinks in "
                    "%s...%s; a structured request's grammar starts after a %s in its answer (or in its prompt) "
                    "and is off until then", reasoning_parser, llm.target.name, " or ".join(missing), THINK,
                    END_THINK, END_THINK)
    if reasoning_parser is None and (getattr(llm.target.config, "model_type", None) == "gpt_oss" or
                                     (enable_auto_tool_choice and tool_call_parser == "openai")):
        reasoning_parser = HARMONY
    if max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {max_queue}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    # vLLM's served names: requests may name any; responses carry the first
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [llm.target.name]
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_name must be non-empty names, got {served_model_name!r}")
    name = names[0]
    loras = {}
    for r in lora_modules:
        if not isinstance(r, LoRARequest):
            raise ValueError(f"lora_modules must be LoRARequests, got {type(r).__name__}")
        if r.lora_name in names or r.lora_name in loras:
            raise ValueError(f"LoRA name {r.lora_name!r} is taken already (the served model's, or another adapter's)")
        llm.adapter(r)  # read and checked (enable_lora; an adapter of this model)
        loras[r.lora_name] = r
    if allow_runtime_lora_updating and not llm.engine_config.enable_lora:
        raise ValueError("allow_runtime_lora_updating: this LLM was made without enable_lora=True (--enable-lora)")
    slots = llm.engine_config.max_batch_size
    metrics = ServerMetrics(name, slots)
    scheduler = Scheduler(llm.engine, metrics, slots, max_queue)
    api = _API(llm, names, scheduler, metrics, api_key, max_request_bytes,
               tool_call_parser if enable_auto_tool_choice else None, reasoning_parser,
               chat_template=chat_template, trust_request_chat_template=trust_request_chat_template, loras=loras)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(llm.serve, True)  # after a generate call running now
        scheduler.start()
        # structured outputs' tokenizer (about 1 s for a 150k vocabulary), off the event loop
        # not a daemon: exiting while it runs inside llguidance's native code (a port in use,
        # say) would end the process with a segfault; it is joined instead (about 1 s at most)
        warm = threading.Thread(target=llm.grammars.warm, name="specdec-grammars")
        warm.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)
            await asyncio.to_thread(warm.join)
            api._preparing.shutdown(wait=False)
            llm.serve(False)

    app = FastAPI(title="specdec", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.served_model_name = scheduler, metrics, name
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers), allow_credentials=allow_credentials)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.refused:  # a failed admitted request is counted by its finish reason, "error"
            metrics.rejected(e.status).inc()
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        # an unknown route: OpenAI's words and type (a model's 404 is ``model_not_found``)
        message = f"Invalid URL ({request.method} {request.url.path})" if e.status_code == 404 else str(e.detail)
        return JSONResponse(APIError(e.status_code, message, "invalid_request_error").body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(bad_request(str(e.errors()[0].get("msg", e))).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(APIError(500, f"internal server error: {type(e).__name__}", "server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return JSONResponse({"status": "error", "error": scheduler.error or "scheduler stopped"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from .. import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        api.check_auth(request)
        return {"object": "list", "data": [api.model_card(n) for n in api.served()]}

    @app.get("/v1/models/{model_id:path}")  # a served name may hold '/' ("org/name", a file path)
    async def model(model_id: str, request: Request):
        api.check_auth(request)
        api.check_served(model_id)
        return api.model_card(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: a prompt's (or chat's) token ids, their count and the context window."""
        api.check_auth(request)
        body = await api.read_json(request)
        req = api.parse_named(TokenizeChatRequest if isinstance(body, dict) and "messages" in body
                              else TokenizeRequest, body)
        try:
            ids = req.token_ids(api.tok)
        except Exception as e:  # e.g. a chat template that rejects these roles
            raise bad_request(f"cannot encode the prompt: {type(e).__name__}: {e}", "prompt") from None
        strs = api.tok.convert_ids_to_tokens(ids) if req.return_token_strs else None  # vLLM's
        return {"count": len(ids), "max_model_len": llm.context_window, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: token ids back to text."""
        api.check_auth(request)
        req = api.parse_named(DetokenizeRequest, await api.read_json(request))
        vocab = llm.target.runtime.vocab_size
        if not all(0 <= t < vocab for t in req.tokens):
            raise bad_request(f"tokens must be ids in [0, {vocab})", "tokens")
        return {"prompt": api.tok.decode(req.tokens)}

    if allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            """vLLM's: serve one more LoRA adapter (read and checked off the event loop)."""
            api.check_auth(request)
            req = parse(LoadLoRAAdapterRequest, await api.read_json(request))
            await asyncio.get_running_loop().run_in_executor(api._preparing, api.load_lora, req.lora_name,
                                                             req.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            """vLLM's: stop serving a LoRA adapter."""
            api.check_auth(request)
            req = parse(UnloadLoRAAdapterRequest, await api.read_json(request))
            await asyncio.get_running_loop().run_in_executor(api._preparing, api.unload_lora, req.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await api.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await api.generate(request, chat=True)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await api.respond(request)

    return app


class _API:
    def __init__(self, llm: LLM, names: list[str], scheduler: Scheduler, metrics: ServerMetrics,
                 api_key: str | None, max_request_bytes: int, tool_call_parser: str | None,
                 reasoning_parser: str | None, *, chat_template: str | None = None,
                 trust_request_chat_template: bool = False, loras: dict[str, LoRARequest] | None = None):
        self.llm, self.scheduler, self.metrics = llm, scheduler, metrics
        self.names, self.name = names, names[0]  # the served names; responses carry the first
        self.loras = loras or {}  # LoRA adapters by name: a request naming one runs through it (its responses name it)
        # ids of adapters loaded while serving: past the given ones, never reused (cached prompts' KV is keyed by id)
        self.lora_ids = itertools.count(max((r.lora_int_id for r in self.loras.values()), default=0) + 1)
        self.tool_call_parser = tool_call_parser  # None: no "auto" tool choice
        self.reasoning_parser = reasoning_parser
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        # the handlers' own tokenizer: the scheduler thread decodes with the engine's
        self.tok = copy.deepcopy(llm.tokenizer)
        # requests are prepared (templates, tokenizing, grammars) one at a time off the event
        # loop, which a long one would stall for every stream, with a tokenizer of their own
        self._preparing = ThreadPoolExecutor(1, thread_name_prefix="specdec-prepare")
        self.prepare_tok = copy.deepcopy(llm.tokenizer)
        self.created = int(time.time())
        self.chat_template = chat_template  # chats' template instead of the tokenizer's
        self.trust_request_chat_template = trust_request_chat_template
        self._token_text: dict[int, str] = {}

    def model_card(self, name: str) -> dict:
        """The served model under ``name`` as OpenAI's model object, with vLLM's ``root`` (the
        model as loaded; an adapter's path), ``parent`` (an adapter's: the model's first served
        name), ``max_model_len`` and ``permission``."""
        permission = {"id": f"modelperm-{name}", "object": "model_permission", "created": self.created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"id": name, "object": "model", "created": self.created, "owned_by": "specdec",
                "root": self.loras[name].lora_path if name in self.loras else self.llm.target.name,
                "parent": self.name if name in self.loras else None, "max_model_len": self.llm.context_window,
                "permission": [permission]}

    # --- request intake ---------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> object:
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        too_big = declared.isdigit() and int(declared) > limit
        chunks, size = [], 0
        try:
            async for chunk in request.stream():  # read it all (a clean 413, not a reset), keep <= limit
                size += len(chunk)
                too_big = too_big or size > limit
                if not too_big:
                    chunks.append(chunk)
                elif size > max(64 << 20, 4 * limit):
                    break
        except ClientDisconnect:  # gone before its whole body came: nobody reads the answer (nginx's 499)
            raise APIError(499, "the client closed the connection before sending the whole body",
                           code="client_closed_request") from None
        if too_big:
            raise APIError(413, f"the request body is larger than {limit} bytes",
                           code="request_too_large")
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None

    def load_lora(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as ``name`` (on the preparing thread, as requests are prepared)."""
        if name in self.names or name in self.loras:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            r = LoRARequest(name, next(self.lora_ids), path)
            self.llm.adapter(r)
        except ValueError as e:
            raise bad_request(str(e), "lora_path") from None
        self.loras = {**self.loras, name: r}  # (a new dict: the event loop reads the old one meanwhile)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; the requests running through it finish through it."""
        if name not in self.loras:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        r = self.loras[name]
        self.loras = {n: x for n, x in self.loras.items() if n != name}
        self.llm.adapters.pop(r.lora_int_id, None)

    def served(self) -> list[str]:
        """The names requests may give as their ``model``: the served names, then the LoRA adapters'."""
        return [*self.names, *self.loras]

    def check_served(self, model: str) -> None:
        """OpenAI's 404 ``model_not_found`` for a name this server does not serve."""
        if model not in self.names and model not in self.loras:
            raise model_not_found(model, self.served())

    def model_named(self, model: str | None) -> str:
        """What a response names as its model: the adapter the request named, else the first served name."""
        return model if model in self.loras else self.name

    def parse_named(self, model, body: object):
        """``parse`` a body for this server's model (another ``model`` name is a 404)."""
        req = parse(model, body)
        if req.model is not None:
            self.check_served(req.model)
        smuggled = (getattr(req, "chat_template_kwargs", None) or {}).get("chat_template")  # vLLM refuses it too
        if (getattr(req, "chat_template", None) is not None or smuggled is not None) and \
                not self.trust_request_chat_template:
            raise bad_request("this server takes no chat template from requests (vLLM's "
                              "--trust-request-chat-template allows them)", "chat_template")
        if hasattr(req, "chat_template") and req.chat_template is None:
            req.chat_template = smuggled or self.chat_template  # the request's (trusted), else the server's
        return req

    def prepare(self, body: object, chat: bool):
        """Validate a request body; return the parsed request, one ``Sequence`` per
        completion (``n`` per prompt: with a seed, completion j draws from seed + j; prompt
        after prompt for a batch of prompts) and, with ``echo``, each completion's ``Echo``."""
        req = self.parse_named(ChatCompletionRequest if chat else CompletionRequest, body)
        if chat and req.tool_mode == "auto" and self.tool_call_parser is None:
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser (or give tool_choice "required", "none" or a function)',
                              "tool_choice")
        seqs, echoes = [], []
        for prompt in req.prompt_inputs():  # choice i * n + j: prompt i's completion j
            try:
                ids = encode_prompt(self.prepare_tok, prompt, req.chat_options())
            except ValueError as e:
                raise bad_request(str(e), req.prompt_field) from None
            except Exception as e:  # e.g. a chat template that rejects these roles (jinja2 errors)
                raise bad_request(f"cannot encode the prompt: {type(e).__name__}: {e}", req.prompt_field) from None
            max_tokens = req.requested_max_tokens if chat else req.max_tokens
            default = max_tokens is None  # chat's default: the model's max_new_tokens, else all the
            if default:  # context window leaves; make_sequences cuts it to what the window leaves
                max_tokens = self.llm.sampling_defaults.get("max_tokens")
            if req.prompt_only:
                max_tokens = 1  # one token is generated, then left out of the response
            sp = req.sampling(max_tokens, self.llm.sampling_defaults)
            if chat and ((req.tool_mode == "auto" and TOOL_PARSERS[self.tool_call_parser].special)
                         or self.reasoning_parser == HARMONY):
                sp = replace(sp, skip_special_tokens=False)  # the parser reads its special-token markers
            try:
                seqs += self.llm.make_sequences({"prompt_token_ids": ids}, sp, num_draft_tokens=req.num_draft_tokens,
                                                reasoning=self.reasoning_parser if chat else None,
                                                cap_max_tokens=default, tokenizer=self.prepare_tok,
                                                lora_request=self.loras.get(req.model))
            except ValueError as e:
                raise bad_request(str(e), req.field_of(str(e))) from None
            if not chat and req.echo:
                kept = seqs[-1].ids[:seqs[-1].prompt_len]  # truncate_prompt_tokens: its last tokens
                prompt, ids = (prompt, ids) if len(kept) == len(ids) else ({"prompt_token_ids": kept}, kept)
                echoes += [self.echo(prompt, ids, sp, req.logprobs is not None)] * req.n
        return req, seqs, echoes

    def echo(self, prompt: str | dict, ids: list[int], sp: SamplingParams, offsets: bool) -> "Echo":
        """A completion's echoed prompt: the prompt as given, or its ids' text decoded as the
        output's is (``sp``); with ``offsets``, where each of ``ids`` starts in it."""
        tok = self.prepare_tok  # called by prepare
        if isinstance(prompt, str):
            return Echo(prompt, tuple(prompt_offsets(tok, prompt, ids)) if offsets else ())
        text = output_text(tok, ids, sp)
        at = TokenOffsets(tok, sp).add(ids) if offsets else []
        return Echo(text, tuple(min(o, len(text)) for o in at))

    async def generate(self, request: Request, chat: bool):
        self.check_auth(request)
        out, watcher = await self._submit(request, await self.read_json(request), chat)
        return await self._reply(out, watcher, lambda: self._chunks(out), lambda whole: whole)

    async def respond(self, request: Request):
        """``/v1/responses``: the request as a chat completion's, its answer shaped as a response."""
        self.check_auth(request)
        req = self.parse_named(ResponsesRequest, await self.read_json(request))
        shaper = ResponseShaper(req, self.model_named(req.model))
        try:
            out, watcher = await self._submit(request, req.chat_body(), chat=True)
        except APIError as e:  # the chat request's field names: the request's own
            e.param = CHAT_FIELDS.get(e.param, e.param)
            raise
        return await self._reply(out, watcher, lambda: shaper.events(out.events()), shaper.from_chat)

    async def _reply(self, out: "_Output", watcher: asyncio.Task, lines, shape):
        """The answer to a submitted request: ``lines()`` (SSE lines) streamed, or the collected
        response as ``shape`` makes it; the request released at the end either way."""
        if out.req.stream:
            return self._sse(lines(), out, watcher)
        try:
            return JSONResponse(shape(await out.collect()))
        finally:
            self._release(out.sreqs, watcher)

    async def _submit(self, request: Request, body: object, chat: bool) -> tuple["_Output", asyncio.Task]:
        """Prepare a request body, hand its completions to the scheduler and watch for the
        client going away; the caller releases them (``_release``) when done."""
        req, seqs, echoes = await asyncio.get_running_loop().run_in_executor(self._preparing, self.prepare, body, chat)
        if len(seqs) > self.scheduler.capacity:
            raise bad_request(f"{len(seqs)} completions (prompts x n) exceed what this server holds at "
                              f"once ({self.scheduler.capacity}: running + queued requests)", "n")
        if not self.scheduler.alive:
            raise APIError(503, "the engine is not running", "server_error")
        sreqs = [ServerRequest(seq, asyncio.get_running_loop()) for seq in seqs]
        try:
            self.scheduler.submit(sreqs)
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
        except Closing as e:  # shutting down
            raise APIError(503, str(e), "server_error") from None
        watcher = asyncio.create_task(self._abort_on_disconnect(request, sreqs))
        return _Output(self, req, sreqs, chat, echoes), watcher

    async def _abort_on_disconnect(self, request: Request, sreqs: list[ServerRequest]) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for sreq in sreqs:
            self.scheduler.abort(sreq)

    def _release(self, sreqs: list[ServerRequest], watcher: asyncio.Task) -> None:
        watcher.cancel()
        for sreq in sreqs:
            if not sreq.finished:  # cancelled or failed mid-way: free the slot
                self.scheduler.abort(sreq)

    def _sse(self, lines, out: "_Output", watcher: asyncio.Task) -> StreamingResponse:
        """A stream of server-sent events (``lines``: formatted), the request released at its end."""
        async def body():
            try:
                async for line in lines:
                    yield line
            finally:
                self._release(out.sreqs, watcher)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @staticmethod
    async def _chunks(out: "_Output"):
        """Completions' and chats' stream: each chunk as a data line, then ``[DONE]``."""
        async for event in out.events():
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    # --- token text ---------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        """One token's text (a special token by name); a token that is part of a UTF-8
        character is ``bytes:\\xNN...``, as OpenAI writes it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tok.decode([token_id])
            if "\ufffd" in text:
                raw = self.token_bytes(token_id)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes: byte-fallback pieces (``<0xE2>``) and byte-level BPE pieces
        map back to raw bytes; any other token is its decoded text."""
        text = self.tok.decode([token_id])
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tok.convert_ids_to_tokens(token_id)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        table = _byte_decoder()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode("utf-8")


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, put before its output (``echo``): its text and, with logprobs,
    each prompt token's ``text_offset`` in it."""

    text: str
    offsets: tuple[int, ...] = ()


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: printable stand-in character -> byte (GPT-2's ``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class _Output:
    """Shapes one request's updates (one queue per completion, ``n``) into OpenAI responses or
    stream chunks; choice i is completion i."""

    def __init__(self, api: _API, req, sreqs: list[ServerRequest], chat: bool, echoes: list[Echo]):
        self.api, self.req, self.sreqs, self.chat = api, req, sreqs, chat
        self.model = api.model_named(req.model)
        self.echoes = echoes  # completions' echo: each choice's prompt, sent before its output
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.want_logprobs = sreqs[0].seq.logprobs is not None
        self.want_prompt_logprobs = req.prompt_logprobs is not None  # vLLM's extension (non-streamed)
        # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>"
        self.token_text = (lambda t: f"token_id:{t}") if req.return_tokens_as_token_ids else api.token_text
        # completions' logprobs: each choice's output tokens' text_offset, after its echoed prompt
        self.offsets = [TokenOffsets(api.tok, sreq.seq.sampling, len(echoes[i].text) if echoes else 0,
                                     sreq.seq.text_context) for i, sreq in enumerate(sreqs)]
        self.pending: list[list] = [[] for _ in sreqs]  # streamed completions' (id, logprobs, offset) not sent yet
        self.streamed = [0] * len(sreqs)  # tokens each choice's stream has received
        # a chat answer with reasoning or tool calls to read: split into parts (answer.py)
        tool_mode = req.tool_mode if chat else None
        self.parser = None
        if chat and (api.reasoning_parser or tool_mode):
            named = req.named_function
            tools = {t.function.name: t.function.parameters or {} for t in req.tools or []}  # name -> schema
            seq = sreqs[0].seq
            opened = api.reasoning_parser is not None and opens_reasoning(api.tok, seq.ids[:seq.prompt_len])
            self.parser = AnswerParser(api.reasoning_parser, tool_mode, tool_names=tools,
                                       function=named.name if named else None,
                                       tool_parser=api.tool_call_parser or "hermes",
                                       parallel=req.parallel_tool_calls, opened=opened)

    def usage(self, choice: int | None = None) -> dict:
        """The response's usage; with ``choice``, that choice's so far (vLLM's continuous usage
        stats: its prompt and the tokens streamed)."""
        if choice is not None:
            prompt, output = self.sreqs[choice].seq.prompt_len, self.streamed[choice]
            return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}
        firsts = self.sreqs[::self.req.n]  # each prompt once
        prompt = sum(r.seq.prompt_len for r in firsts)
        output = 0 if self.req.prompt_only else sum(r.seq.num_output for r in self.sreqs)
        cached = sum(r.seq.metrics.cached_prompt_tokens for r in firsts)
        usage = {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.parser is not None and self.parser.reasoning is not None:  # OpenAI's (and DeepSeek's) count
            thought = 0 if self.req.prompt_only else \
                sum(reasoning_tokens(self.api.tok, self.parser, r.seq.output_ids) for r in self.sreqs)
            usage["completion_tokens_details"] = {"reasoning_tokens": thought}
        return usage

    async def collect(self) -> dict:
        choices = [await self._collect(i, sreq) for i, sreq in enumerate(self.sreqs)]
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
        if self.want_prompt_logprobs and self.chat:  # vLLM's: the response's, for chats
            out["prompt_logprobs"] = self.vllm_prompt_logprobs(self.sreqs[0])
        return out

    def vllm_prompt_logprobs(self, sreq: ServerRequest) -> list:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token
        ``{id: {"logprob", "rank", "decoded_token"}}``, the token itself first."""
        ids, entries = self.prompt_logprobs(sreq)
        return [None] + [{str(a): {"logprob": max(lp.logprob, MIN_LOGPROB), "rank": lp.rank,
                                   "decoded_token": lp.decoded_token} for a, lp in entry.items()}
                         for entry in vllm_logprobs(ids[1:], entries[1:], self.token_text)]

    async def _collect(self, i: int, sreq: ServerRequest) -> dict:
        ids, lps = [], []
        while True:
            u: Update = await sreq.queue.get()
            if u.error:
                raise APIError(500, u.error, "server_error", refused=False)
            ids += u.token_ids
            lps += u.logprobs
            if u.finish_reason:
                break
        text = u.text if u.text is not None else settled_text(self.api.tok, ids, sreq.seq.sampling, sreq.seq.text_context)
        finish_reason = u.finish_reason
        if self.req.prompt_only:  # echo with max_tokens 0: no output
            text, ids, lps, finish_reason = "", [], [], "length"
        offsets = [] if self.chat or not self.want_logprobs else self.offsets[i].add(ids)
        if self.echoes:
            prompt_ids, prompt_lps = self.prompt_logprobs(sreq)
            echo = self.echoes[i]
            text, ids, lps, offsets = echo.text + text, prompt_ids + ids, prompt_lps + lps, [*echo.offsets, *offsets]
        # tokens past a stop string that the text leaves out sit at its end
        logprobs = self.logprobs(ids, lps, [min(o, len(text)) for o in offsets]) if self.want_logprobs else None
        if self.chat:
            message = {"role": "assistant", "content": text}
            if self.parser:
                answer = self.parser.view(text, final=True)
                finish_reason = self.parser.finish_reason(answer, finish_reason)
                message["content"] = answer.content
                if self.parser.reasoning:
                    message["reasoning_content"] = answer.reasoning
                if answer.calls:
                    message["tool_calls"] = [c.to_openai() for c in answer.calls]
            return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": self.stop_reason(i)}
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": self.stop_reason(i)}
        if self.want_prompt_logprobs:  # vLLM's: each choice's, for completions
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(sreq)
        return choice

    def prompt_logprobs(self, sreq: ServerRequest) -> tuple[list[int], list]:
        """A completion's prompt ids and their logprob entries (None for the first token),
        for ``echo``; read once its first update came (the prefill has filled them)."""
        seq = sreq.seq
        return seq.ids[:seq.prompt_len], [None] + seq.prompt_token_logprobs

    async def events(self):
        """Stream chunks: each choice's verified tokens as soon as they arrive (choices
        interleaved), each choice's finish reason last."""
        streams = [TextStream(self.api.tok, sreq.seq.sampling, sreq.seq.text_context) for sreq in self.sreqs]
        if self.chat:
            for i in range(len(self.sreqs)):
                yield self.chunk(i, {"role": "assistant", "content": ""}, None, None)
        echoed = [False] * len(self.sreqs)
        # parsed answers: characters of reasoning and content sent, then of each call's arguments
        shown = [[0, 0] for _ in self.sreqs]
        async with contextlib.aclosing(merged_updates(self.sreqs)) as updates:  # (choice, Update)
            async for i, u in updates:
                if u.error:
                    yield {"error": APIError(500, u.error, "server_error").body()["error"]}
                    return
                if self.echoes and not echoed[i]:  # the prompt first (its logprobs are ready now)
                    echoed[i] = True
                    ids, lps = self.prompt_logprobs(self.sreqs[i])
                    echo = self.echoes[i]
                    logprobs = self.logprobs(ids, lps, echo.offsets) if self.want_logprobs else None
                    yield self.chunk(i, echo.text, logprobs, None)
                if self.req.prompt_only:  # echo with max_tokens 0: no output
                    if u.finish_reason:
                        yield self.chunk(i, "", None, "length")
                    continue
                stream = streams[i]
                self.streamed[i] += len(u.token_ids)
                delta = stream.finish(u.token_ids, u.text) if u.finish_reason else stream.add(u.token_ids)
                logprobs = None
                if self.want_logprobs and self.chat and u.token_ids:
                    logprobs = self.logprobs(u.token_ids, u.logprobs, [])
                elif self.want_logprobs:
                    logprobs = self._sent_logprobs(i, u, stream)
                if self.parser:
                    for chunk in self._parsed_chunks(i, stream, logprobs, u.finish_reason, shown[i]):
                        yield chunk
                elif delta or logprobs or u.finish_reason:
                    yield self.chunk(i, {"content": delta} if self.chat else delta, logprobs, u.finish_reason)
        if self.req.include_usage:
            yield {**self.chunk(0, None, None, None), "choices": [], "usage": self.usage()}

    def _sent_logprobs(self, i: int, u: Update, stream: TextStream) -> dict | None:
        """A completion's logprobs of the tokens whose text starts in the text sent so far (a
        token in text held back for a stop string waits; those past the stop that ended the
        request sit at the text's end, as in a whole response)."""
        pending = self.pending[i]
        pending += zip(u.token_ids, u.logprobs, self.offsets[i].add(u.token_ids))
        start = len(self.echoes[i].text) if self.echoes else 0
        if u.finish_reason:
            ready = [(t, e, min(o, start + len(stream.text))) for t, e, o in pending]
        else:
            ready = list(itertools.takewhile(lambda p: p[2] < start + stream.sent, pending))
        del pending[:len(ready)]
        return self.logprobs(*map(list, zip(*ready))) if ready else None

    def _parsed_chunks(self, i: int, stream: TextStream, logprobs, finish_reason: str | None, shown: list[int]):
        """Choice i's chunks when its answer is parsed: the reasoning, content and tool calls
        the view of the text so far shows beyond ``shown`` (characters sent of the reasoning,
        the content and each call's arguments; a call's first delta has its id and name),
        then at the end the finish reason."""
        final = finish_reason is not None
        answer = self.parser.view(stream.text if final else stream.text[:stream.sent], final)
        if len(answer.calls) < len(shown) - 2:  # a call was streamed, then cut short (max_tokens): the whole
            answer = self.parser.view(stream.text)  # text reads it as content; the stream keeps it a call (vLLM's)
        delta = {}
        for j, (key, part) in enumerate((("reasoning_content", answer.reasoning), ("content", answer.content))):
            more = (part or "")[shown[j]:]
            if more:
                delta[key] = more
                shown[j] += len(more)
        calls = []
        for j, call in enumerate(answer.calls):
            if 2 + j == len(shown):  # a new call
                calls.append(call.to_openai(j))
                shown.append(len(call.arguments))
            elif len(call.arguments) > shown[2 + j]:
                calls.append({"index": j, "function": {"arguments": call.arguments[shown[2 + j]:]}})
                shown[2 + j] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        if delta or logprobs:
            yield self.chunk(i, delta, logprobs, None)
        if final:
            yield self.chunk(i, {}, None, self.parser.finish_reason(answer, finish_reason))

    def stop_reason(self, i: int) -> int | str | None:
        """vLLM's ``stop_reason`` of choice i: the stop string or stop token that ended it."""
        return None if self.req.prompt_only else self.sreqs[i].seq.stop_reason

    def chunk(self, i: int, delta, logprobs, finish_reason) -> dict:
        if self.chat:
            choice = {"index": i, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": i, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = self.stop_reason(i)
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if self.req.include_usage:  # OpenAI's: null in every chunk but the last (vLLM's continuous stats: not)
            out["usage"] = self.usage(i) if self.req.continuous_usage else None
        return out

    def logprobs(self, ids: list[int], entries: list, offsets) -> dict:
        """The logprobs of ``ids`` in the endpoint's format; ``offsets``: completions' text_offset
        of each (where its text starts in the choice's text)."""
        text = self.token_text
        if self.chat:
            def item(t, lp):
                return {"token": text(t), "logprob": max(lp, MIN_LOGPROB),
                        "bytes": list(self.api.token_bytes(t))}
            return {"content": [{**item(t, e.logprob), "top_logprobs": [item(a, alp) for a, alp in e.top]}
                                for t, e in zip(ids, entries)], "refusal": None}
        tokens = [text(t) for t in ids]
        tops = []
        for t, e in zip(ids, entries):
            if e is None:  # an echoed prompt's first token: nothing predicts it
                tops.append(None)
                continue
            top = {text(a): max(alp, MIN_LOGPROB) for a, alp in e.top}
            top.setdefault(text(t), max(e.logprob, MIN_LOGPROB))  # the sampled token is always listed
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [None if e is None else max(e.logprob, MIN_LOGPROB) for e in entries],
                "top_logprobs": tops, "text_offset": list(offsets)}
