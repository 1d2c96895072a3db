"""Rendering a GGUF's Jinja chat template the way HF transformers does, inside a sandbox.

Chat templates ship inside model files, so they are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment, with only the globals and filters HF exposes, and every failure
(syntax, sandbox violation, `raise_exception`, type errors) comes out as ChatTemplateError.

The caller's data (messages, tools, extra variables) is rebuilt from plain JSON types before the
template sees it, so no object with dangerous methods ever reaches the sandbox.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)
# Private-use code points for the markers that stand in for special spellings in caller data.
_MARKER_PAIRS = (("\ue000", "\ue001"), ("\U000f0000", "\U000f0001"), ("\U00100000", "\U00100001"))


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, unsafe, rejected the conversation, or the messages are malformed."""


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """What `raise_exception(...)` throws, so its message reaches the client verbatim."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # HF overrides jinja's tojson: no HTML escaping, non-ASCII kept, and indent/separators exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # `dict(...)` without exposing the dict type itself (whose attributes a template could poke at).
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # As HF: a namespace refuses underscore names, so a template cannot plant dunders on it.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick (allows `self=` kw)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(jinja2.ext.Extension):
    # HF templates may wrap assistant turns in {% generation %}...{% endgeneration %} to build
    # training masks; for inference the block just renders its body.
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    # jinja's sandbox answers an unsafe attribute (`''.__class__`, `messages.append`) with an
    # Undefined that renders as ''; fail loudly instead, so escape attempts surface as errors.
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


def compile_template(source: str) -> jinja2.Template:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not compile: {e} (line {e.lineno})") from None


# Output budget of one rendering: far above any prompt a context window holds, and it stops a
# template that loops writing text before it eats the memory. (A template that loops without
# writing is stopped by its caller's time budget: the server renders in a process it can kill.)
MAX_RENDER_CHARS = 16 << 20


def render(template: jinja2.Template, variables: Mapping[str, Any], max_chars: int = MAX_RENDER_CHARS) -> str:
    try:
        parts, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > max_chars:
                raise ChatTemplateError(f"the chat template's output exceeded {max_chars} characters")
            parts.append(piece)
        return "".join(parts)
    except _TemplateRaised as e:
        raise ChatTemplateError(str(e)) from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template tried an operation the sandbox forbids: {e}") from None
    except ChatTemplateError:
        raise
    except Exception as e:  # UndefinedError, TypeError, RecursionError...: all the template's fault
        raise ChatTemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None


def plain_data(value: Any, where: str) -> Any:
    """A deep copy of `value` made of JSON types only (tuples become lists); anything else is rejected."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # str subclasses (enums...) could carry methods: strip to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ChatTemplateError(f"{where}: keys must be strings, got {k!r}")
            out[str.__str__(k)] = plain_data(v, f"{where}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [plain_data(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ChatTemplateError(f"{where}: unsupported value of type {type(value).__name__}")


def normalize_messages(messages: Any) -> list[dict]:
    """Validated plain copies of the messages, with list-of-parts contents joined into one string.

    Text parts are joined with "\\n" (vLLM's choice for OpenAI-style content arrays); other part
    types are rejected because this engine is text-only (HF would hand the list to the template
    as is). `content` may be None or absent (an assistant turn that only carries tool_calls).
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError("messages must be a list of {'role': ..., 'content': ...} objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string")
        msg = plain_data(msg, f"messages[{i}]")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(
                        f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}} (only text is supported)"
                    )
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
        # As HF: reasoning under any of its names is visible under the two that templates read.
        names = ("reasoning_content", "thinking", "reasoning")
        reasoning = next((msg[k] for k in names if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def _neutralize(data: Any, specials: re.Pattern[str], open_: str, close: str, found: list[str]) -> Any:
    """Copy of `data` whose strings have every special-token spelling replaced by a marker.

    Marker k is `open_ + str(k) + close`; `found[k]` is the spelling it stands for. Rendering the
    neutralized data tells us exactly where caller-supplied special spellings land in the output,
    even when the template trims, splits or repeats the content.
    """
    if isinstance(data, str):

        def sub(m: re.Match[str]) -> str:
            found.append(m.group(0))
            return f"{open_}{len(found) - 1}{close}"

        return specials.sub(sub, data)
    if isinstance(data, dict):
        return {_neutralize(k, specials, open_, close, found): _neutralize(v, specials, open_, close, found)
                for k, v in data.items()}
    if isinstance(data, list):
        return [_neutralize(v, specials, open_, close, found) for v in data]
    return data


def contains_match(data: Any, pattern: re.Pattern[str]) -> bool:
    if isinstance(data, str):
        return pattern.search(data) is not None
    if isinstance(data, dict):
        return any(contains_match(k, pattern) or contains_match(v, pattern) for k, v in data.items())
    if isinstance(data, list):
        return any(contains_match(v, pattern) for v in data)
    return False


def render_marking_data(
    source: str, template: jinja2.Template, variables: dict, data: dict, specials: re.Pattern[str], rendered: str
) -> tuple[str, list[tuple[int, int]]]:
    """(text, spans): the chat rendered with the special spellings in `data` located.

    `rendered` is the ordinary rendering. The template is run again on data whose special
    spellings are markers; putting the spellings back where the markers landed gives the text,
    and `spans` (ascending) are where the caller's spellings sit in it. The text equals
    `rendered` unless the template's output depends on those spellings (it tests for them, or
    measures lengths); then the marker rendering wins, because it is the safe one, with a warning.
    """
    seen = "".join([source, rendered, json.dumps(data, ensure_ascii=False)])
    open_, close = next(((o, c) for o, c in _MARKER_PAIRS if o not in seen and c not in seen), (None, None))
    if open_ is None:
        raise ChatTemplateError("cannot tokenize this chat safely: it uses every private-use marker character")
    found: list[str] = []
    neutral = {k: _neutralize(v, specials, open_, close, found) for k, v in data.items()}
    marked = render(template, {**variables, **neutral})

    pieces, spans, pos, n = [], [], 0, 0
    for m in re.finditer(re.escape(open_) + r"(\d+)" + re.escape(close), marked):
        k = int(m.group(1))
        if k >= len(found):
            raise ChatTemplateError("the chat template altered the message content in an unsupported way")
        pieces.append(marked[pos : m.start()])
        n += m.start() - pos
        spans.append((n, n + len(found[k])))
        pieces.append(found[k])
        n += len(found[k])
        pos = m.end()
    pieces.append(marked[pos:])
    text = "".join(pieces)
    if open_ in text or close in text:  # a marker was cut apart (slicing, per-character filters)
        raise ChatTemplateError("the chat template altered the message content in an unsupported way")
    if text != rendered:
        logger.warning("chat template output depends on special-token text in messages; tokenizing it as plain text")
    return text, spans
