"""What a request asks its output to match, checked where it is made (before anything is queued).

The kinds follow vLLM's `structured_outputs` (json, regex, choice, grammar), plus `json_object`
(OpenAI's any-JSON-object mode) and `lark` (grammars hetserve builds itself, e.g. for tool calls).
The value is text (a schema as JSON, a regex, a JSON list of choices, a GBNF or Lark grammar) so
that it crosses process boundaries as it is; `grammar()` turns it into llguidance's grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark")
# Bounds on what a client may send: compiling is bounded by llguidance's parser limits (lexer
# fuel, items per row, grammar size), these keep the text itself and a schema's nesting small.
MAX_SPEC_CHARS = 256 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 1024
# A compile that ran through this much lexer fuel (about 20 ms of regex analysis) stops with an
# error instead of going on; llguidance's default allows 50x more.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_grammar_size=200_000)


class StructuredOutputError(ValueError):
    """An unusable constraint; `field` names the request field it came from."""

    def __init__(self, message: str, field: str = "structured_outputs"):
        super().__init__(message)
        self.field = field


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def _depth(value, limit: int) -> int:
    """Nesting depth of a JSON value, without recursion (a deep schema must not overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return d
        deepest = max(deepest, d)
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


# A number the schema leaves unbounded is held to what every JSON parser keeps (RFC 7493's
# I-JSON), so that its digits end: a model can otherwise write "5000000000000000000000..." or
# "0.5000000000..." until max_tokens inside one number. Each unbounded side of an integer or a
# number is held to +-(2**53 - 1), a double's exact integers; a number without its own
# multipleOf gets at most NUMBER_FRACTION_DIGITS digits after the point, and with its range
# bounded, llguidance writes it without an exponent (llama.cpp's grammar caps a number at 16
# digits each side). 10 is the most llguidance's multipleOf takes (1e-11 is not exact in a
# double and is refused).
JSON_INT_MAX = 2**53 - 1
NUMBER_FRACTION_DIGITS = 10
_NOT_SCHEMAS = ("const", "enum", "default", "examples")  # values, not subschemas


def bounded_numbers(node):
    """The schema with every integer and number node bounded as above; the caller's is unchanged."""
    if isinstance(node, list):
        return [bounded_numbers(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _NOT_SCHEMAS else bounded_numbers(v) for k, v in node.items()}
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if "integer" in types or "number" in types:
        if "minimum" not in node and "exclusiveMinimum" not in node:
            out["minimum"] = -JSON_INT_MAX
        if "maximum" not in node and "exclusiveMaximum" not in node:
            out["maximum"] = JSON_INT_MAX
        if "number" in types and "multipleOf" not in node:
            out["multipleOf"] = 10.0 ** -NUMBER_FRACTION_DIGITS
    return out


@dataclass(frozen=True)
class StructuredOutputs:
    kind: str
    value: str = ""
    field: str = "structured_outputs"  # the request field it came from, for error messages

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {self.kind!r} ({', '.join(KINDS)})",
                                        self.field)
        if not isinstance(self.value, str):
            raise StructuredOutputError("the constraint must be text", self.field)
        if len(self.value) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"the constraint is {len(self.value)} characters; at most {MAX_SPEC_CHARS} "
                                        "are accepted", self.field)

    # -- constructors from request fields ---------------------------------------------------------
    @classmethod
    def json_schema(cls, schema, field: str = "response_format") -> StructuredOutputs:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}", field) from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError("a JSON schema must be an object", field)
        if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
            raise StructuredOutputError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", field)
        return cls("json", json.dumps(schema, ensure_ascii=False), field)

    @classmethod
    def choice(cls, options, field: str = "structured_outputs") -> StructuredOutputs:
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise StructuredOutputError("choice must be a non-empty list of non-empty strings", field)
        if len(options) > MAX_CHOICES:
            raise StructuredOutputError(f"at most {MAX_CHOICES} choices are accepted", field)
        return cls("choice", json.dumps(options, ensure_ascii=False), field)

    # -- the grammar ------------------------------------------------------------------------------
    def grammar(self) -> str:
        """llguidance's grammar text (JSON), unchecked; `check` validates it."""
        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
            if self.kind == "json":
                # Compact separators, no free whitespace: a model cannot pad its output with
                # endless newlines, and outputs are what json.dumps(separators) would write.
                return llguidance.LLMatcher.grammar_from_json_schema(
                    bounded_numbers(json.loads(self.value)),
                    defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
            fmt = {"regex": "regex", "choice": "choice", "grammar": "grammar", "lark": "lark"}[self.kind]
            return llguidance.grammar_from(fmt, self.value)
        except Exception as e:  # the GBNF converter and the JSON front end raise their own kinds
            raise StructuredOutputError(f"invalid {self.kind}: {e}", self.field) from None

    def check(self) -> str:
        """The grammar, validated (syntax, schema features, resource limits) without a tokenizer:
        under a millisecond for typical schemas, so the server does it before queueing."""
        grammar = self.grammar()
        err = llguidance.LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
        if err:
            detail = " ".join(line.strip() for line in err.strip().splitlines() if line.strip())
            raise StructuredOutputError(f"invalid {self.kind}: {detail[:500]}", self.field)
        return grammar

    def to_wire(self) -> dict:
        return {"kind": self.kind, "value": self.value, "field": self.field}
