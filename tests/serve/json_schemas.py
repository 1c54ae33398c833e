"""JSON schemas generated for the structured-output tests: objects of string / integer / boolean /
enum / array / nested-object fields with ``required`` lists, every one bounded (string lengths,
integer ranges, array sizes, nesting depth) so that any model, even a random one, ends inside
``max_tokens`` once the grammar holds it."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["name", "city", "score", "active", "tags", "kind", "owner", "size", "notes", "id", "level", "mode"]


def _field(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-50, 10)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "low", "high", "on", "off"], rng.randint(2, 4))}
    if kind == "array":
        items = rng.choice([{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": ["a", "b", "c"]},
                            {"type": "string", "maxLength": 6}, {"type": "boolean"}])  # fmt: skip
        return {"type": "array", "items": items, "minItems": rng.randint(0, 1), "maxItems": rng.randint(2, 4)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(WORDS, rng.randint(1, 4 if depth else 5))
    properties = {n: _field(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def generated_schemas(count: int = 20, seed: int = 22) -> list[dict[str, Any]]:
    """``count`` schemas, the same ones on every run."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(count)]
