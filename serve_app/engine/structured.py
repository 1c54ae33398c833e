"""What a request's output must be (OpenAI's ``response_format``), as data; no torch.

A ``StructuredOutput`` rides in ``SamplingParams.structured`` across the Ray handle; the engine
compiles it into a per-request grammar (``engine.grammar``) that masks the target's tokens. The HTTP
layer builds one from ``response_format`` (JSON object, JSON schema); other callers (tool calls
forced by ``tool_choice``) build one from any JSON schema with ``StructuredOutput.json_schema``.
``grammar()`` is its llguidance grammar and ``check()`` validates it without a tokenizer (the
ingress answers a schema the library cannot compile with a 400 before anything runs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"

# Any JSON object (OpenAI's json_object mode: "the model's output is valid JSON", an object).
_ANY_OBJECT = '{"type": "object"}'

# What JSON the grammar lets the model write: json.dumps' separators and no other whitespace. A
# flexible-whitespace grammar lets a small model run on in newlines and spaces until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar a request's output follows: ``kind`` and, for a schema, its JSON text.

    The schema is kept as JSON text so the object stays hashable and pickles small; keys keep their
    order (the grammar writes an object's properties in the schema's order); ``schema`` gives it
    back as a dict.
    """

    kind: Literal["json_object", "json_schema"]
    schema_json: str = _ANY_OBJECT

    def __post_init__(self) -> None:
        if self.kind not in (JSON_OBJECT, JSON_SCHEMA):
            raise ValueError(f"structured output is {JSON_OBJECT!r} or {JSON_SCHEMA!r}, not {self.kind!r}")

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

    @property
    def schema(self) -> dict[str, Any] | bool:
        return json.loads(self.schema_json)

    def grammar(self) -> str:
        """The llguidance grammar (JSON text) of this output; ValueError for a malformed schema."""
        import llguidance

        schema = _ANY_OBJECT if self.kind == JSON_OBJECT else self.schema_json
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
            raise ValueError(f"invalid JSON schema: {error}")
