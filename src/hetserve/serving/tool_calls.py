"""Tool calling for models that write `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
(the Qwen2.5 family, Hermes format): request checks, the grammar that makes calls well-formed,
and the parser (whole answers and streams) that turns the output into OpenAI `tool_calls`.

tool_choice `required` or a named function constrains the whole output to calls. `auto` leaves
text free and applies the call grammar lazily, from the `<tool_call>` token on (as llama.cpp's
lazy grammars do). Qwen2.5-Coder often answers with a fenced JSON block or `<tools>` instead;
the parser reads those as calls too when they name a known tool and nothing else is said.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..structured import StructuredOutputError, StructuredOutputs
from ..structured.params import MAX_SCHEMA_DEPTH, _depth, bounded_numbers

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    def __init__(self, message: str, field: str = "tools"):
        super().__init__(message)
        self.field = field


@dataclass
class Tools:
    functions: dict[str, dict]  # name -> parameters schema
    choice: str  # "auto", "required", or the one function's name
    parallel: bool
    template_tools: list[dict]  # what the chat template renders

    @classmethod
    def parse(cls, tools, tool_choice, parallel_tool_calls) -> Tools | None:
        """None when no tools are offered or tool_choice is "none" (the template then shows none)."""
        if tool_choice is not None and not tools:
            raise ToolError("tool_choice requires tools", "tool_choice")
        if not tools:
            return None
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise ToolError(f"tools must be a list of at most {MAX_TOOLS} functions")
        functions, shown = {}, []
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
                raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
            name = fn.get("name")
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
            if name in functions:
                raise ToolError(f"tools[{i}]: the function {name!r} is defined twice")
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict) or _depth(params, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
                raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object nesting at most "
                                f"{MAX_SCHEMA_DEPTH} levels")
            functions[name] = params
            shown.append({"type": "function", "function": fn})
        if tool_choice is None or tool_choice == "auto":
            choice = "auto"
        elif tool_choice == "none":
            return None
        elif tool_choice == "required":
            choice = "required"
        elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
            choice = tool_choice["function"].get("name")
            if choice not in functions:
                raise ToolError(f"tool_choice names the function {choice!r}, which is not among the tools",
                                "tool_choice")
        else:
            raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', "tool_choice")
        return cls(functions, choice, parallel_tool_calls is not False, shown)

    # -- the constraint ------------------------------------------------------------------------
    def constraint(self, tokenizer) -> StructuredOutputs:
        """The Lark grammar of this request's calls. A call marker is the vocabulary's own token
        (`<tool_call>` in the Qwen2.5 family) where `tokenizer` has one, else literal text."""
        def tag(text: str) -> str:
            return text if tokenizer.token_to_id(text) is not None else json.dumps(text)

        names = [self.choice] if self.choice not in ("auto", "required") else list(self.functions)
        lines = ["%llguidance {}"]
        for i, name in enumerate(names):
            schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": bounded_numbers(self.functions[name])},
                      "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": _COMPACT}
            lines.append(f"fn_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        body = f"\"\\n\" ({' | '.join(f'fn_{i}' for i in range(len(names)))}) \"\\n\" {tag(CLOSE)}"
        opener = tag(OPEN)
        if self.choice != "auto":
            lines.append(f"call: {opener} {body}")
            lines.append('start: call ("\\n" call)*' if self.parallel and self.choice == "required" else "start: call")
        else:
            # Free text; the grammar binds from the opening marker on. Text cannot hold a special
            # token, so a special marker ends it; a literal one ends it through a lazy lexeme (the
            # shortest text that reaches the marker).
            if opener.startswith('"'):
                lines += [f"head[lazy]: TEXT {opener}", f"call: head {body}"]
            else:
                lines.append(f"call: TEXT {opener} {body}")
            lines += ["start: call* TEXT" if self.parallel else "start: call? TEXT", r"TEXT: /(.|\n)*/"]
        spec = StructuredOutputs("lark", "\n".join(lines) + "\n", "tools")
        try:
            spec.check()
        except StructuredOutputError as e:
            raise ToolError(str(e)) from None
        return spec


# -- parsing -------------------------------------------------------------------------------------
def _call(obj, tools: Tools) -> dict | None:
    """An OpenAI tool call from {"name", "arguments"} (or "parameters"), if it names a known tool."""
    if not isinstance(obj, dict) or obj.get("name") not in tools.functions:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


_TAGGED = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_FENCED = re.compile(r"```(?:json|tool_call|tools)?\s*(.*?)\s*```", re.S)
_TOOLS_TAG = re.compile(r"<tools>\s*(.*?)\s*</tools>", re.S)


def _lenient(text: str, tools: Tools) -> list[dict]:
    """Calls written as a whole answer in another shape: a fenced JSON block, <tools>...</tools>,
    or bare JSON (an object or a list of them), each naming a known tool."""
    body = text.strip()
    for rx in (_FENCED, _TOOLS_TAG):
        m = rx.fullmatch(body)
        if m:
            body = m.group(1)
            break
    try:
        obj = json.loads(body)
    except ValueError:
        return []
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call(o, tools) for o in objs]
    return calls if calls and all(calls) else []


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` for an answer that ended by itself with calls in it."""
    return "tool_calls" if called and reason == "stop" else reason


def parse(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole answer. A call left open at the end (the answer was cut
    by max_tokens; the grammar lets nothing else end inside one) is neither: it is dropped."""
    calls, kept, pos, end = [], [], 0, 0
    for m in _TAGGED.finditer(text):
        end = m.end()
        try:
            call = _call(json.loads(m.group(1)), tools)
        except ValueError:
            call = None
        if call is None:
            continue  # not a call we can run: it stays text
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    cut = text.find(OPEN, end)
    if cut >= 0:
        text = text[:cut]
    if calls:
        content = ("".join(kept) + text[pos:]).strip()
        return content or None, calls
    calls = _lenient(text, tools)
    if calls:
        return None, calls
    return (text, []) if cut < 0 else (text.strip() or None, [])


class ToolStream:
    """Splits a streamed answer into content deltas and whole tool calls. Text that may open a
    call (a partial `<tool_call>`, or an answer that starts like a fenced or bare JSON call) is
    held back until it is decided."""

    _MAYBE_CALL = ("```", "{", "[", "<tools>")

    def __init__(self, tools: Tools):
        self.tools = tools
        self.buffer = ""
        self.in_call = False
        self.said_anything = False  # content streamed (a lenient whole-answer call is then off)
        self.lead = ""  # leading whitespace held back
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content to send now, calls completed now)."""
        self.buffer += text
        content, calls = [], []
        while self.buffer:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                raw = self.buffer[:end + len(CLOSE)]
                self.buffer = self.buffer[end + len(CLOSE):]
                self.in_call = False
                _, got = parse(OPEN + raw, self.tools)
                if got:
                    calls += got
                else:
                    content.append(OPEN + raw)
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(OPEN):]
                self.in_call = True
                continue
            if not self.said_anything and not self.num_calls and not "".join(content).strip() and \
                    _may_open(self.buffer.lstrip(), self._MAYBE_CALL) and not final:
                break  # maybe a whole-answer call in another shape: decided at the end
            keep = _partial_suffix(self.buffer, OPEN) if not final else 0
            content.append(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        if final:
            if self.in_call:  # a call cut by max_tokens: dropped, as parse() drops it
                self.buffer, self.in_call = "", False
            text_out = "".join(content)
            if not self.said_anything and not self.num_calls and not calls:
                lenient = _lenient(text_out, self.tools)
                if lenient:
                    text_out, calls = "", lenient
            content = [text_out]
        out = "".join(content)
        if not self.said_anything:  # leading whitespace waits: dropped if only calls follow
            out, self.lead = self.lead + out, ""
            if out.strip():
                self.said_anything = True
            elif not final:
                out, self.lead = "", out
            elif self.num_calls or calls:
                out = ""
        self.num_calls += len(calls)
        return out, calls


def _may_open(text: str, openers: tuple[str, ...]) -> bool:
    """text starts with one of the openers, or is the start of one."""
    return any(text.startswith(o) or o.startswith(text) for o in openers)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def history_messages(messages: list[dict]) -> list[dict]:
    """Assistant tool calls in the history as the template reads them: OpenAI sends `arguments`
    as a JSON string; Qwen's template writes it with `tojson`, so it must be the object."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {}) if isinstance(c, dict) else {}
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn} if isinstance(c, dict) else c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
