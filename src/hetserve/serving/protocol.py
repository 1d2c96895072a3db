"""OpenAI-compatible request bodies (pydantic) and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..models.tokenizer import PROMPT_PARSES_SPECIAL
from ..sampling_params import SamplingParams
from ..structured import StructuredOutputError, StructuredOutputs

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


# vLLM's older guided_* names for structured_outputs' keys.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


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
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs (and guided_*),
    # llama.cpp's grammar (GBNF) and json_schema. At most one per request.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    json_schema: Any = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("functions") is not None or data.get("function_call") is not None:
                raise ValueError("functions/function_call (deprecated by OpenAI) are not supported: send tools "
                                 "and tool_choice")
            if data.get("stream_options") is not None and not data.get("stream"):
                raise ValueError("stream_options is only allowed when stream is true")
        return data

    def constraint(self) -> StructuredOutputs | None:
        """The output constraint the request asks for (StructuredOutputError names the field)."""
        found = []
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            found.append(_response_format(rf))
        so = self.structured_outputs
        if so:
            keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) is not None]
            unknown = sorted(set(so) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise StructuredOutputError(f"unknown key {unknown[0]!r} (json, regex, choice, grammar or "
                                            "json_object)", "structured_outputs")
            if len(keys) != 1:
                raise StructuredOutputError("give exactly one of json, regex, choice, grammar, json_object",
                                            "structured_outputs")
            found.append(_kind(keys[0], so[keys[0]], "structured_outputs"))
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                found.append(_kind(kind, getattr(self, name), name))
        if self.grammar is not None:
            found.append(_kind("grammar", self.grammar, "grammar"))
        if self.json_schema is not None:
            found.append(_kind("json", self.json_schema, "json_schema"))
        if len(found) > 1:
            raise StructuredOutputError(f"{found[0].field} and {found[1].field} both constrain the output; give "
                                        "one", found[1].field)
        if found:
            found[0].check()
            return found[0]
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, index: int,
                        structured: StructuredOutputs | None = None) -> SamplingParams:
        """Raises ValueError (-> 400) for out-of-range values, NaN and infinities."""
        return SamplingParams(
            structured=structured,
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


def _kind(kind: str, value: Any, field: str) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs.json_schema(value, field)
    if kind == "choice":
        return StructuredOutputs.choice(value, field)
    if kind == "json_object":
        return StructuredOutputs("json_object", "", field)
    if not isinstance(value, str) or not value:
        raise StructuredOutputError(f"{field}: {kind} must be a non-empty string", field)
    return StructuredOutputs(kind, value, field)


def _response_format(rf: dict) -> StructuredOutputs:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputs("json_object", "", "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise StructuredOutputError('response_format json_schema needs {"name": ..., "schema": {...}}',
                                        "response_format")
        return StructuredOutputs.json_schema(js["schema"], "response_format")
    raise StructuredOutputError(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                                "response_format")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # the text after the insertion point: a fill-in-the-middle prompt
    # Special-token spellings in a raw prompt ("<|im_start|>") are special tokens, as in HF,
    # vLLM and llama.cpp; false reads them as plain text.
    parse_special: bool = PROMPT_PARSES_SPECIAL


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
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    parse_special: bool = PROMPT_PARSES_SPECIAL


class DetokenizeRequest(_Body):

    model: str | None = None
    tokens: list[int]
