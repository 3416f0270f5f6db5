"""OpenAI request bodies (pydantic, strict types) and the errors the API returns."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..api import encode_prompt
from ..config import SamplingParams, StructuredOutputs
from ..tools import compact, required_schema

MAX_STOPS = 16
MAX_N = 16  # completions per prompt
MAX_PROMPTS = 64  # prompts per completions request (a batch)


class APIError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, refused: bool = True):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.refused = refused  # before generation (the rejected-requests metric); else an admitted one failed

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# a sampling field's value when neither the request nor the model's generation config sets it
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(model: str, served: list[str]) -> APIError:
    """OpenAI's 404 for a model name this server does not serve (vLLM's status too)."""
    return APIError(404, f"the model {model!r} does not exist here; this server serves "
                         f"{', '.join(map(repr, served))}",
                    "invalid_request_error", "model", "model_not_found")


class _Strict(BaseModel):
    """A request part: strict types, unknown fields ignored (OpenAI clients send some), and a
    field sent as null takes its default (OpenAI's optional fields are nullable: clients
    generated from its spec send ``"n": null``)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k in cls.null_means_none}

    null_means_none: ClassVar[frozenset[str]] = frozenset()  # fields whose null is not their default

    def refuse_unsupported(self) -> None:
        """A body's checks beyond its fields' types (``parse`` calls it); none by default."""


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension (vLLM): usage in every chunk too


class _Request(_Strict):
    """Fields shared by both endpoints. Unknown fields are ignored, as OpenAI clients send
    some (``user``, ``metadata``...); known fields we do not implement are refused when set
    to anything but their neutral value."""

    model: str | None = None
    max_tokens: int | None = None
    # left out: the model's generation config (LLM.sampling_defaults), else OPENAI_DEFAULTS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 = off
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2 ** 63), lt=2 ** 64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # extension (vLLM)
    repetition_penalty: float | None = None  # extension (vLLM)
    min_p: float | None = None  # extension (vLLM)
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    min_tokens: int = 0  # extension (vLLM)
    include_stop_str_in_output: bool = False  # extension (vLLM)
    skip_special_tokens: bool = True  # extension (vLLM)
    allowed_token_ids: list[int] | None = None  # extension (vLLM)
    bad_words: list[str] | None = None  # extension (vLLM)
    truncate_prompt_tokens: int | None = None  # extension (vLLM): the prompt's last this many tokens (-1: all that fit)
    # extension (vLLM): each prompt token's logprob and this many alternatives, in prompt_logprobs
    prompt_logprobs: int | None = Field(default=None, ge=-1)  # at most --max-logprobs (-1: the vocabulary)
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprobs name tokens "token_id:<id>"
    use_beam_search: bool = False  # extension (vLLM); refused
    num_draft_tokens: int | None = None  # extension: cap this request's k (0 = no speculation)
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", ...}}
    response_format: dict | None = None
    # extension (vLLM): {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: dict | None = None
    # vLLM's older names for the same (before structured_outputs)
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def refuse_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if self.use_beam_search:
            raise bad_request("beam search is not supported", "use_beam_search")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is returned in whole responses only (stream=false)", "prompt_logprobs")

    def sampling(self, max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        """The request as ``SamplingParams``; a sampling field it leaves out takes ``defaults``
        (the model's generation config), else OpenAI's default."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOPS:
            raise bad_request(f"at most {MAX_STOPS} stop strings", "stop")
        if self.top_k is not None and self.top_k < -1:
            raise bad_request(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}", "top_k")
        chosen = {**OPENAI_DEFAULTS, **(defaults or {}),
                  **{f: getattr(self, f) for f in OPENAI_DEFAULTS if getattr(self, f) is not None}}
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=chosen["temperature"], top_p=chosen["top_p"],
                                  top_k=max(chosen["top_k"], 0), min_p=chosen["min_p"], seed=self.seed, stop=tuple(stop),
                                  stop_token_ids=tuple(self.stop_token_ids or ()), min_tokens=self.min_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  skip_special_tokens=self.skip_special_tokens,
                                  ignore_eos=self.ignore_eos, repetition_penalty=chosen["repetition_penalty"],
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  logit_bias=self._logit_bias(), n=self.n, logprobs=self.requested_logprobs,
                                  prompt_logprobs=self.requested_prompt_logprobs,
                                  structured_outputs=self._structured_outputs(),
                                  allowed_token_ids=self.allowed_token_ids, bad_words=tuple(self.bad_words or ()),
                                  truncate_prompt_tokens=self.truncate_prompt_tokens)
        except ValueError as e:
            raise bad_request(str(e), self.field_of(str(e))) from None

    def field_of(self, message: str) -> str | None:
        """The request field a ``SamplingParams`` or ``LLM.make_sequences`` error is about (its
        message's first word), named as this request gave it; None when none is to blame."""
        word = message.split(maxsplit=1)[0].rstrip(":,") if message.strip() else ""
        if word == "prompt":
            return self.prompt_field
        if word == "max_tokens":
            return self.max_tokens_field
        if word == "logprobs" and "top_logprobs" in type(self).model_fields:  # a chat's alternatives
            return "top_logprobs"
        if word.split(".")[0] == "structured_outputs":
            return self.structure_field
        return word if word in type(self).model_fields else None

    @property
    def prompt_field(self) -> str:
        """The field that holds the prompt."""
        return "prompt"

    @property
    def max_tokens_field(self) -> str:
        """The field that holds the output's length limit."""
        return "max_tokens"

    @property
    def structure_field(self) -> str:
        """The field the output's constraint comes from: ``response_format``,
        ``structured_outputs`` or one of vLLM's older ``guided_*`` fields."""
        if (self.response_format or {}).get("type", "text") != "text":
            return "response_format"
        guided = [f for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                  if getattr(self, f) is not None]
        return guided[0] if guided and not self.structured_outputs else "structured_outputs"

    @property
    def requested_logprobs(self) -> int | None:
        """Alternatives per output token when log-probabilities are asked for, else None."""
        return None

    @property
    def requested_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (``prompt_logprobs``, completions' echo)."""
        return self.prompt_logprobs

    @property
    def prompt_only(self) -> bool:
        """The prompt is the whole response (completions' echo with max_tokens 0)."""
        return False

    def chat_options(self) -> dict | None:
        """``apply_chat_template`` options (chat requests)."""
        return None

    def _structure_fields(self) -> dict:
        """The ``StructuredOutputs`` fields asked for: ``structured_outputs``, or vLLM's older
        ``guided_*`` fields."""
        guided = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                    ("choice", self.guided_choice), ("grammar", self.guided_grammar)) if v is not None}
        if guided and self.structured_outputs:
            raise bad_request("give structured_outputs or the guided_* fields, not both", "structured_outputs")
        return self.structured_outputs or guided

    def _structured_outputs(self) -> StructuredOutputs | None:
        """The output's constraint, from ``response_format``, vLLM's ``structured_outputs`` or
        its ``guided_*`` fields."""
        fmt = self.response_format or {"type": "text"}
        kind = fmt.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise bad_request("response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format")
        spec = self._structure_fields()
        if kind != "text" and spec:
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        try:
            if kind == "json_object":
                return StructuredOutputs(json_object=True)
            if kind == "json_schema":
                schema = (fmt.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise ValueError("response_format.json_schema.schema must be a JSON schema (an object)")
                return StructuredOutputs(json=schema)
            if spec:
                known = {"json", "regex", "choice", "grammar", "json_object"}
                if set(spec) - known:
                    raise ValueError(f"structured_outputs takes {', '.join(sorted(known))}; got "
                                     f"{', '.join(sorted(set(spec) - known))}")
                return StructuredOutputs(**spec)
        except ValueError as e:
            raise bad_request(str(e), self.structure_field) from None
        return None

    def _logit_bias(self) -> dict[int, float]:
        """OpenAI's ``{"token id": bias}``, each bias clamped into [-100, 100] as vLLM's server
        clamps it (OpenAI's range; a nan stays, for the library's check to refuse)."""
        try:
            return {int(t): b if b != b else min(100.0, max(-100.0, b)) for t, b in (self.logit_bias or {}).items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids", "logit_bias") from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats`` (with ``include_usage``): usage in every chunk."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; null: the model's generation
    # config's max_new_tokens, else the rest of the window (vLLM's)
    null_means_none: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    logprobs: int | None = Field(default=None, ge=-1)  # at most --max-logprobs (-1: the vocabulary)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_bool(cls, value):
        """``logprobs: true`` (false) is 1 (0), as vLLM's lax integer field reads it."""
        return int(value) if isinstance(value, bool) else value

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo and self.logprobs is not None else self.prompt_logprobs

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, as lm-eval's
        loglikelihood requests ask."""
        return self.echo and self.max_tokens == 0

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be >= 1 (0 only with echo, to score the prompt)", "max_tokens")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise bad_request("only best_of=1 is supported", "best_of")
        if self.echo and self.logprobs is not None and self.prompt_logprobs not in (None, self.logprobs):
            raise bad_request("with echo, prompt_logprobs must equal logprobs (the echoed prompt's logprobs "
                              "are those)", "prompt_logprobs")

    def prompt_inputs(self) -> list[str | dict]:
        """The prompts, each text or ``{"prompt_token_ids": [...]}`` (a list of several is a
        batch: choice ``i * n + j`` is prompt i's completion j)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if len(batch) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}", "prompt")
        for one in batch:
            if isinstance(one, list) and not one:
                raise bad_request("the prompt is empty", "prompt")
        return [{"prompt_token_ids": one} if isinstance(one, list) else one for one in batch]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text


class MessageToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in (None, "text"):  # one error, not one per branch of the union
                raise ValueError(f"only text content parts are served (this is a text model), not {kind!r}")
        return content

    def for_template(self) -> dict:
        """The message as ``api.render_prompt`` takes it (which joins text parts and reads
        tool calls' arguments as objects, ``api.text_messages``), optional fields only when
        given."""
        content = [p.model_dump() for p in self.content] if isinstance(self.content, list) else self.content or ""
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        out.update({k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v is not None})
        return out


class FunctionSpec(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ChosenFunction


class _ChatTemplate(_Strict):
    """Messages through the chat template, with vLLM's template options."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    chat_template_kwargs: dict[str, object] | None = None  # extension (vLLM), e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True  # extension (vLLM)
    continue_final_message: bool = False  # extension (vLLM): continue the last assistant message
    # extension (vLLM): a Jinja chat template for this request (the server must trust them)
    chat_template: str | None = None

    def template_options(self, tools: bool) -> dict:
        """``apply_chat_template`` options (``tools``: show them to the template)."""
        shown = {"tools": [t.model_dump(exclude_none=True) for t in self.tools]} if tools and self.tools else {}
        own = {"chat_template": self.chat_template} if self.chat_template is not None else {}  # over the kwargs'
        return {**(self.chat_template_kwargs or {}), **shown, **own, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def conversation(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def refuse_unsupported(self) -> None:
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:  # both asked for (vLLM's 400)
            raise bad_request("cannot set both continue_final_message and add_generation_prompt to true: the "
                              "last message is continued, not followed by a new one", "continue_final_message")


class ChatCompletionRequest(_Request, _ChatTemplate):
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=-1)  # at most --max-logprobs (-1: the vocabulary)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool = True
    echo: bool = False  # extension (vLLM); refused

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        _ChatTemplate.refuse_unsupported(self)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.named_function is None:
            raise bad_request(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools",
                              "tool_choice")
        constrained = self._structure_fields() or (self.response_format or {}).get("type", "text") != "text"
        if self.tool_mode in ("required", "function") and constrained:
            raise bad_request("a required or named tool_choice constrains the output already; drop "
                              "response_format / structured_outputs", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.echo:
            raise bad_request("echo is not supported on chat completions", "echo")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise bad_request(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}",
                              "max_completion_tokens")

    @property
    def tool_mode(self) -> str | None:
        """How the answer may call tools: None (no tools, or tool_choice "none"), "auto" (the
        model decides; a parser reads the calls), "required" (one call or more) or
        "function" (the named one)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or "auto"

    @property
    def named_function(self) -> FunctionSpec | None:
        """The function a named tool_choice calls, from ``tools``."""
        name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        return next((t.function for t in self.tools or [] if t.function.name == name), None)

    def _structured_outputs(self) -> StructuredOutputs | None:
        """A required or named tool_choice constrains the output to the calls' JSON."""
        try:
            if self.tool_mode == "required":
                functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
                return StructuredOutputs(json=required_schema(functions, self.parallel_tool_calls))
            if self.tool_mode == "function":
                return StructuredOutputs(json=compact(self.named_function.parameters or {"type": "object"}))
        except ValueError as e:
            raise bad_request(str(e), "tools") from None
        return super()._structured_outputs()

    def chat_options(self) -> dict:
        return self.template_options(tools=True)  # "none" too, as vLLM shows them by default

    @property
    def prompt_field(self) -> str:
        return "messages"

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def structure_field(self) -> str:
        return "tools" if self.tool_mode in ("required", "function") else super().structure_field

    def prompt_inputs(self) -> list[list[dict]]:
        return [self.conversation()]

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a ``prompt`` (special tokens added unless ``add_special_tokens``
    is false), or chat ``messages`` through the chat template (as a chat request's prompt)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # a prompt's
    return_token_strs: bool = False  # vLLM's: the tokens' strings too

    def refuse_unsupported(self) -> None:
        if self.prompt is None:
            raise bad_request("give a prompt (or messages)", "prompt")

    def token_ids(self, tok) -> list[int]:
        return tok(self.prompt, add_special_tokens=self.add_special_tokens)["input_ids"]


class TokenizeChatRequest(_ChatTemplate):
    model: str | None = None
    return_token_strs: bool = False

    def token_ids(self, tok) -> list[int]:
        return encode_prompt(tok, self.conversation(), self.template_options(tools=True))


class DetokenizeRequest(_Strict):
    """vLLM's ``/detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's ``/v1/load_lora_adapter``: serve the adapter at ``lora_path`` as ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's ``/v1/unload_lora_adapter``: stop serving ``lora_name`` (``lora_int_id`` is taken and unread)."""

    lora_name: str
    lora_int_id: int | None = None


def parse(model: type[_Strict], body: object) -> _Strict:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        field_name = str(err["loc"][0]) if err["loc"] else None
        if len(errors) > 1 and all(x["loc"][:1] == err["loc"][:1] for x in errors):
            # a union (prompt, stop, content...): pydantic reports every branch that failed
            msg = f"{field_name}: wrong type or value ({errors[0]['msg'].lower()}, ...)"
        else:
            path = ".".join(str(x) for x in err["loc"])
            msg = f"{path or 'body'}: {err['msg'].removeprefix('Value error, ')}"  # our validators' words
        raise bad_request(msg, field_name) from None
    req.refuse_unsupported()
    return req
