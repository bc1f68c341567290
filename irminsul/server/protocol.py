"""The OpenAI request bodies the server accepts, and OpenAI-style errors.

Only the fields the server acts on are declared; unknown fields are ignored, as OpenAI clients
send many. Declared fields are strict, as OpenAI's API is: no string or boolean for a number,
finite numbers in documented ranges, integers within 64 bits. Requests asking for what the
engine cannot do (several choices, log-probabilities, images) are refused with a 400 rather than
silently answered differently.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..engine import SamplingParams

if TYPE_CHECKING:
    from starlette.requests import Request

INT32_MAX, INT64 = 2**31 - 1, 2**63
# Stop strings: OpenAI takes up to 4; up to this many are served, each at most this long, since
# every output token's text is searched for each of them on the event loop.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 512
# Fields the engine does not apply: accepted at their neutral values only, since a request
# asking for more would otherwise get another answer than it asked for. Field: (neutral
# values, the error).
NEUTRAL_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "logprobs": ((None, False, 0), "logprobs are not supported"),
    "top_logprobs": ((None, False, 0), "logprobs are not supported"),
    "presence_penalty": ((None, 0), "penalties are not supported (only 0)"),
    "frequency_penalty": ((None, 0), "penalties are not supported (only 0)"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    # vLLM's sampling extensions beside top_k, which clients written for vLLM send along.
    "min_p": ((None, 0), "min_p is not supported (only 0)"),
    "repetition_penalty": ((None, 1), "repetition_penalty is not supported (only 1)"),
    "min_tokens": ((None, 0), "min_tokens is not supported (only 0)"),
    "ignore_eos": ((None, False), "ignore_eos is not supported (only false)"),
    "stop_token_ids": ((None, []), "stop_token_ids is not supported: use stop"),
    "include_stop_str_in_output": ((None, False),
                                   "include_stop_str_in_output is not supported (only false)"),
    # Nothing constrains decoding, so structured output is refused. (A required tool call is
    # served by opening the call in the prompt: see ChatCompletionRequest.tool_choice.)
    "response_format": ((None, {"type": "text"}),
                        "only response_format {'type': 'text'} is supported"),
    # OpenAI's deprecated forms of tools and tool_choice, which the server does not read.
    "functions": ((None, []), "functions are not supported: use tools"),
    "function_call": ((None, "none", "auto"),
                      "function_call is not supported: use tool_choice"),
    "modalities": ((None, ["text"]), "only text output is supported (modalities ['text'])"),
    "audio": ((None,), "audio output is not supported"),
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "suffix": ((None, ""), "suffix is not supported"),
}


def _neutral(value: Any, info: ValidationInfo) -> Any:
    """A field of :data:`NEUTRAL_ONLY` at one of its neutral values, else its error."""
    allowed, error = NEUTRAL_ONLY[info.field_name]
    if value not in allowed:
        raise ValueError(error)
    return value


class RequestError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status (400 unless said)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (message, param, code,
                                                                      status, kind)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
Seed = Annotated[int, Field(ge=-INT64, le=INT64 - 1)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # extension (vLLM, SGLang): 0 or -1 = no cut
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False  # OpenAI's nullable fields: null is the default
    stream_options: StreamOptions | None = None
    n: int | None = 1
    # NEUTRAL_ONLY's: refused unless neutral.
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    cache_salt: str | None = None  # extension: a tenant's private cache namespace
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported")
        return n

    # One name a class: a subclass's validator of the same name would replace this one.
    _neutral_sampling = field_validator(
        "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
        "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
        "include_stop_str_in_output")(_neutral)

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are served, got "
                             f"{len(stops)}")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string of {longest} characters is longer than the "
                             f"{MAX_STOP_CHARS} served")
        return stop

    @model_validator(mode="after")
    def _options_with_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, *, max_tokens: int, stop_token_ids: tuple[int, ...]
                        ) -> SamplingParams:
        """The engine's parameters (OpenAI defaults: temperature 1, top_p 1); ValueError from
        SamplingParams' own checks becomes a 400 naming the bad value."""
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k,
                seed=self.seed, stop_token_ids=stop_token_ids)
        except ValueError as err:
            raise RequestError(f"invalid sampling parameters: {err}", code="invalid_value",
                               param=str(err).split(" ", 1)[0]) from err


class ContentPart(BaseModel):
    """One part of a multi-part message content; only text parts are served."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"only text content parts are supported, got a '{self.type}' part")
        if self.text is None:
            raise ValueError("a text content part needs 'text'")
        return self


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, refusal, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    # Checked even when absent: a tool message must name the call it answers.
    tool_call_id: str | None = Field(default=None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_result_names_its_call(cls, call_id: str | None, info: ValidationInfo
                                    ) -> str | None:
        """A tool result without the id of the call it answers is refused, as OpenAI refuses
        it: with parallel calls nothing else pairs results with calls."""
        if call_id is None and info.data.get("role") == "tool":
            raise PydanticCustomError("missing", "Field required")
        return call_id


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1)  # "" names nothing (and as tool_choice reads as "required")
    description: str | None = None
    parameters: dict[str, Any] | None = None


def _with_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """``tool`` with ``"parameters": null`` added to a function that has none (keys in order)."""
    function = tool["function"]
    if "parameters" in function:
        return tool
    return {**tool, "function": {**function, "parameters": None}}


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming the one tool the reply must call."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: ToolName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: the reply ends after its first call
    response_format: Any = None  # NEUTRAL_ONLY's, as the next four
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    max_completion_tokens: MaxTokens | None = None

    # The tools as the client sent them: see template_tools.
    _sent_tools: list[dict[str, Any]] | None = PrivateAttr(default=None)

    _neutral_chat = field_validator("response_format", "functions", "function_call",
                                    "modalities", "audio")(_neutral)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_tools_as_sent(cls, data: Any, handler: ModelWrapValidatorHandler
                            ) -> ChatCompletionRequest:
        request = handler(data)
        if isinstance(data, dict) and request.tools:
            request._sent_tools = data["tools"]
        return request

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template, validated but as the client sent them: a template
        that shows whole tools as JSON (Qwen's, GLM's) must see the client's key order and
        nulls, as transformers' apply_chat_template hands them over (a dump of ``tools``
        puts undeclared keys such as "strict" last and drops nulls). A function sent without
        ``parameters`` (OpenAI: no parameters) gets ``"parameters": null``, as vLLM hands it
        over: templates that write ``tool.function.parameters | tojson`` (DeepSeek's, the
        embedded model's) fail on an undefined value."""
        if self._sent_tools is not None:
            return [_with_parameters(tool) for tool in self._sent_tools]
        return [_with_parameters(tool.model_dump(exclude_none=True)) for tool in self.tools] \
            if self.tools else None

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        names = {tool.function.name for tool in info.data.get("tools") or ()}
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names '{choice.function.name}', which is not among "
                             "the tools")
        return choice

    @property
    def forced_call(self) -> str | None:
        """What the reply must begin with: a call of this tool, of any tool (''), or None."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool | None = False
    best_of: Any = None  # NEUTRAL_ONLY's, as the next
    suffix: Any = None

    _neutral_completion = field_validator("best_of", "suffix")(_neutral)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        """A text or a list of token ids; a batch of one is unwrapped, larger ones refused."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt

    @field_validator("logprobs")
    @classmethod
    def _no_sampled_logprobs(cls, logprobs: Any) -> Any:
        """Here logprobs 0 still asks for the sampled tokens' logprobs (OpenAI: "the API will
        always return the logprob of the sampled token"): only null is neutral."""
        if logprobs is not None and logprobs is not False:
            raise ValueError(NEUTRAL_ONLY["logprobs"][1])
        return logprobs

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


# -- decoding and validating a body ---------------------------------------------------------------

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


async def read_body(request: Request, limit: int, setting: str,
                    timeout_s: float | None = None) -> bytes:
    """A request's body, refused (413) as soon as it is known to exceed ``limit`` bytes: by its
    declared length, else while it streams in; ``setting`` names what sets the limit. Not all
    received within ``timeout_s`` seconds (None: no limit): 408. A client gone before its body
    is: 499 (nginx's "client closed request"), its own doing, not a server error."""
    from starlette.requests import ClientDisconnect

    def too_large(size: int) -> RequestError:
        return RequestError(f"request body of {size} bytes or more exceeds the limit of {limit} "
                            f"bytes ({setting})", status=413, code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared))

    async def receive() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(size)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError as err:
        raise RequestError(f"request body not received within {timeout_s:g} s",
                           status=408, code="request_timeout") from err
    except ClientDisconnect as err:
        raise RequestError("the client disconnected before its request body arrived",
                           status=499, code="client_disconnected") from err


def decode_json(raw: bytes) -> Any:
    """The JSON value of a request body. RequestError for what JSON does not allow (NaN,
    Infinity), nesting too deep to decode, and text with a lone UTF-16 surrogate (no model
    tokenizer takes it), naming where it is."""
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError as err:
        raise RequestError("malformed JSON body: nested too deeply", code="invalid_json") from err
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(f"malformed JSON body: {err}", code="invalid_json") from err
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then look for an unpaired one
        where = _lone_surrogate(value, ())
        if where is not None:
            path = ".".join(map(str, where))
            raise RequestError(f"text with a lone UTF-16 surrogate is not valid Unicode ({path})",
                               param=str(where[0]) if where else None, code="invalid_value")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _lone_surrogate(value: Any, path: tuple) -> tuple | None:
    """The path of the first string (key or value) holding a lone surrogate, else None."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(item, dict):
            stack.extend((v, (*where, k)) for k, v in reversed(item.items()))
            stack.extend((k, where) for k in item)
        elif isinstance(item, list):
            stack.extend((v, (*where, i)) for i, v in reversed(list(enumerate(item))))
    return None


def parse(model: type[_Sampling], body: Any) -> Any:
    """Validate a decoded JSON body; a RequestError names the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", code="invalid_type")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        loc, message, kind = _first_error(err.errors())
        where = ".".join(str(p) for p in loc)
        code = "invalid_type" if kind.endswith("_type") else "invalid_value"
        if kind == "missing":
            message, code = f"'{where}' is a required property", "missing_required_parameter"
        raise RequestError(f"{message} ({where})" if where else message, code=code,
                           param=str(loc[0]) if loc else None) from err
    except RecursionError as err:
        raise RequestError("request body nested too deeply", code="invalid_value") from err


def _first_error(errors: list[dict]) -> tuple[tuple, str, str]:
    """The first bad field's error, said once: pydantic reports a value that fits no member of
    a union (``str | list[ContentPart]``) once per member; a member whose shape matched but
    whose value did not (an image part, an id out of range) says most, else the members'
    expected types are listed together."""
    field = errors[0]["loc"][:1]
    alike = [e for e in errors if e["loc"][:1] == field]
    specific = [e for e in alike if not e["type"].endswith("_type")]
    chosen = specific[0] if specific else alike[0]
    loc = tuple(p for p in chosen["loc"] if not _union_tag(p))
    message = chosen["msg"].removeprefix("Value error, ")
    if not specific and len(alike) > 1:
        wanted = dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in alike)
        message = "Input should be " + " or ".join(wanted)
    return loc, message, chosen["type"]


def _union_tag(part: Any) -> bool:
    """Whether a location part names a union member (``str``, ``list[...]``), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)
