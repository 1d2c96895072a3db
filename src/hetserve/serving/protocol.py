"""OpenAI-compatible request bodies (pydantic) and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sampling_params import SamplingParams

MAX_N = 16
MAX_PROMPTS = 64
MAX_MESSAGES = 2048  # checked while parsing, before any template or tokenizer work


def _check_text(value: Any, where: str = "") -> None:
    """Lone surrogates ("\ud800" in JSON) are valid JSON but not text: no tokenizer can take them."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{at or 'body'}: the string contains a lone UTF-16 surrogate (not text)") from None
        elif isinstance(v, dict):
            stack.extend((x, f"{at}.{k}" if at else str(k)) for k, x in v.items())
            stack.extend((k, at) for k in v if isinstance(k, str))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        _check_text(data)
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields of the OpenAI, vLLM and llama.cpp schemas that constrain the output. They are refused
# (400) rather than ignored, so a client never believes it got JSON or a tool call it did not.
_CONSTRAINTS = ("response_format", "tools", "functions", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "grammar", "json_schema")


class _Sampling(_Body):

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # Extras beyond the OpenAI schema (vLLM names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    worker: str | None = None  # hetserve: run on this worker whatever the route policy (cache warming)
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM: top-N log-probabilities of every prompt token

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in _CONSTRAINTS:
                v = data.get(name)
                if v is None or (name == "response_format" and isinstance(v, dict) and v.get("type") == "text"):
                    continue
                raise ValueError(f"{name} is not supported yet (structured outputs and tool calling are not "
                                 "implemented); the request was not run")
            if data.get("tool_choice") not in (None, "none"):
                raise ValueError("tool_choice is not supported yet (no tool calling); the request was not run")
            if data.get("stream_options") is not None and not data.get("stream"):
                raise ValueError("stream_options is only allowed when stream is true")
        return data

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, index: int) -> SamplingParams:
        """Raises ValueError (-> 400) for out-of-range values, NaN and infinities."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=None if self.seed is None else self.seed + index,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self._bias(),
        )

    def _bias(self) -> dict[int, float]:
        out = {}
        for k, v in (self.logit_bias or {}).items():
            if not k.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            out[int(k)] = v
        return out


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    # Special-token spellings in a raw prompt ("<|im_start|>") are special tokens, as in HF,
    # vLLM and llama.cpp; false reads them as plain text.
    parse_special: bool = True


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    parse_special: bool = True


class DetokenizeRequest(_Body):

    model: str | None = None
    tokens: list[int]
