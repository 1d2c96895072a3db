"""Structured outputs: a grammar (JSON schema, regex, choice, GBNF/Lark) per request, compiled off
the step loop by llguidance, whose token mask goes into every token pick of the request."""

from .params import StructuredOutputError, StructuredOutputs

__all__ = ["StructuredOutputError", "StructuredOutputs"]
