"""What a request's output must be (OpenAI's ``response_format``), as data; no torch.

A ``StructuredOutput`` rides in ``SamplingParams.structured`` across the Ray handle; the engine
compiles it into a per-request grammar (``engine.grammar``) that masks the target's tokens. The HTTP
layer builds one from ``response_format`` (JSON object, JSON schema); other callers (tool calls
forced by ``tool_choice``) build one from any JSON schema with ``StructuredOutput.json_schema``, or
wrap a schema in text with ``StructuredOutput.lark`` (llguidance's Lark, where ``%json {schema}``
is a JSON value of that schema: ``start: "<tool_call>\n" %json {...} "\n</tool_call>"``; give the
schema ``"x-guidance": JSON_OPTIONS`` for the engine's compact JSON, else any whitespace is allowed).
``grammar()`` is its llguidance grammar and ``check()`` validates it without a tokenizer (the
ingress answers a schema the library cannot compile with a 400 before anything runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"
LARK = "lark"

# Any JSON object (OpenAI's json_object mode: "the model's output is valid JSON", an object).
_ANY_OBJECT = '{"type": "object"}'

# What JSON the grammar lets the model write: json.dumps' separators and no other whitespace. A
# flexible-whitespace grammar lets a small model run on in newlines and spaces until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar a request's output follows: ``kind`` and its ``source`` (a schema's JSON text,
    or a Lark grammar).

    A schema is kept as JSON text so the object stays hashable and pickles small; keys keep their
    order (the grammar writes an object's properties in the schema's order); ``schema`` gives it
    back as a dict.
    """

    kind: Literal["json_object", "json_schema", "lark"]
    source: str = _ANY_OBJECT

    def __post_init__(self) -> None:
        if self.kind not in (JSON_OBJECT, JSON_SCHEMA, LARK):
            raise ValueError(
                f"structured output is {JSON_OBJECT!r}, {JSON_SCHEMA!r} or {LARK!r}, not {self.kind!r}"
            )

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object."""
        return cls(JSON_OBJECT)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> StructuredOutput:
        """JSON that validates against ``schema`` (a JSON Schema document). Raises ValueError when
        it is not JSON-serialisable; whether the grammar library supports it is known when the
        engine compiles it (``engine.grammar``: a ValueError there too)."""
        if not isinstance(schema, dict | bool):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        return cls(JSON_SCHEMA, text)

    @classmethod
    def lark(cls, grammar: str) -> StructuredOutput:
        """Text of a Lark grammar in llguidance's dialect (``%json {schema}`` embeds a schema)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError("a Lark grammar must be a non-empty string")
        return cls(LARK, grammar)

    @property
    def schema(self) -> dict[str, Any] | bool:
        """The JSON schema (json_object: any object); a ValueError for a Lark grammar."""
        if self.kind == LARK:
            raise ValueError("a Lark grammar has no JSON schema")
        return json.loads(self.source)

    def grammar(self) -> str:
        """The llguidance grammar of this output; ValueError for a malformed schema."""
        import llguidance

        if self.kind == LARK:
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        schema = _ANY_OBJECT if self.kind == JSON_OBJECT else self.source
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None

    def check(self) -> None:
        """Raise ValueError (naming why) when the grammar library cannot compile this schema:
        invalid JSON Schema, or a feature it does not support."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(self.grammar())
        if error:
            raise ValueError(f"invalid {'grammar' if self.kind == LARK else 'JSON schema'}: {error}")
