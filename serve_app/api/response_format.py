"""OpenAI's ``response_format`` (structured output) for both endpoints; torch-free.

- ``{"type": "text"}`` (or none): free text.
- ``{"type": "json_object"}``: the output is a JSON object (OpenAI's JSON mode).
- ``{"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}``: the
  output is JSON that validates against ``schema``. It is enforced whatever ``strict`` says (as
  vLLM does): the grammar masks every token the schema cannot continue with.

``/v1/completions`` takes the same field (vLLM's extension). A schema the grammar library cannot
compile (invalid JSON Schema, or a feature llguidance does not support) is a 400 naming
``response_format`` and why, answered by the ingress before anything is queued
(``StructuredOutput.check`` needs no tokenizer). The engine masks the target's tokens with it
(``engine.grammar``); speculation stays exact.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.api.errors import APIError
from serve_app.engine.structured import StructuredOutput


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(BaseModel):
    """``response_format``: text, json_object or json_schema."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only allowed with type json_schema, not {self.type}")
        return self


def structured_output(fmt: ResponseFormat | None) -> StructuredOutput | None:
    """The engine's ``StructuredOutput`` for a request's ``response_format`` (None: free text).
    Raises ``APIError`` 400 for a schema the grammar cannot be built from."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
        return StructuredOutput.json_object()
    try:
        structured = StructuredOutput.json_schema(fmt.json_schema.schema_)
        structured.check()
    except ValueError as e:
        why = f"response_format: {e}"
        raise APIError(400, why, param="response_format", code="invalid_json_schema") from None
    return structured
