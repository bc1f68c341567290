"""The OpenAI request bodies the server accepts, and OpenAI-style errors.

Only the fields the server acts on are declared; unknown fields are ignored, as OpenAI clients
send many. Requests asking for what the engine cannot do (several choices, log-probabilities)
are refused with a 400 rather than silently answered differently.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..engine import SamplingParams


class RequestError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status (400 unless said)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (message, param, code,
                                                                      status, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, SGLang): 0 or -1 = no cut
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    cache_salt: str | None = None  # extension: a tenant's private cache namespace
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value not in (None, False, 0):
            raise ValueError("logprobs are not supported")
        return value

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
            raise RequestError(f"invalid sampling parameters: {err}",
                               param=str(err).split(" ", 1)[0]) from err


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id, ...

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

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

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


def parse(model: type[_Sampling], body: Any) -> Any:
    """Validate a decoded JSON body; a RequestError names the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            message = f"'{where}' is a required property"
        raise RequestError(f"{message} ({where})" if where else message,
                           param=str(first["loc"][0]) if first["loc"] else None) from err
