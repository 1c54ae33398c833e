"""The prompts of the measuring tools, in one place: named prompt sets of ``Prompt``.

- ``BENCH``: ``specserve bench`` (every method on every prompt, batch 1; ``loadtest.bench.run``);
- ``TRACES``: ``specserve bench --policies`` (acceptance traces recorded per proposer and replayed
  through every policy, and the real closed-loop runs; ``loadtest.bench.policies``);
- ``CALIBRATION``: ``specserve calibrate self-spec`` (the skip-set search and its curve;
  ``loadtest.calibrate``), kept apart from the benchmark's prompts so that a skip set is not
  tuned on the prompts it is then measured on.

Each prompt is raw completion text or a user message sent through the chat template (``chat``),
of one kind of ``KINDS``. The texts are the ones the figures in BENCHMARKS.md were measured with:
change one and new figures no longer compare with the old.

The load tests (Locust, ``specserve loadtest``) draw their requests elsewhere: the workloads of
``loadtest/workloads.py``, whose prompts are in ``loadtest/prompts/*.yaml``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("code", "json", "chat", "prose")


@dataclass(frozen=True)
class Prompt:
    """One prompt: raw completion text, or a user message sent through the chat template."""

    kind: str  # one of KINDS
    name: str
    text: str
    chat: bool  # through the chat template, else a raw completion


_LOAD_CONFIG = (
    "import json\nfrom pathlib import Path\n\n\ndef load_config(path: str) -> dict:\n"
    '    """Load a JSON config file, fill in defaults and validate the types."""\n'
)
_PEOPLE = (
    "Extract each person's name, age, city and job as a JSON list of objects: Alice is a 34-year-old "
    "engineer living in Berlin. Bob, 27, works as a nurse in Madrid. Carol, a teacher from Toronto, is 45."
)

BENCH: tuple[Prompt, ...] = (
    Prompt("code", "quicksort", "def quicksort(arr):", False),
    Prompt("code", "load_config", _LOAD_CONFIG, False),
    Prompt("code", "LRU cache", "Write a Python class implementing an LRU cache.", True),
    Prompt("json", "JSON extraction", _PEOPLE, True),
    Prompt("prose", "printing press", "The printing press changed Europe in ways that", False),
    Prompt("chat", "sea poem", "Write a short poem about the sea at night.", True),
)

TRACES: tuple[Prompt, ...] = (
    Prompt("code", "quicksort", "def quicksort(arr):", False),
    Prompt("code", "binary search", "def binary_search(items: list[int], target: int) -> int:", False),
    Prompt("code", "LRU cache", "Write a Python class implementing an LRU cache.", True),
    Prompt("code", "word count", "Write a Python function that counts how often each word occurs in a "
           "text file and returns the ten most common words.", True),
    Prompt("json", "people", _PEOPLE, True),
    Prompt("json", "orders", "Return a JSON object with keys order_id, items (name, quantity, price) and "
           "total for this order: order 1182 has two notebooks at 3.50 each, one pen at 1.20 and three "
           "folders at 2.10 each.", True),
    Prompt("json", "config", "Write a JSON configuration for a web service with a server block (host, "
           "port, workers), a database block (url, pool size, timeout) and a logging block.", True),
    Prompt("chat", "sea poem", "Write a short poem about the sea at night.", True),
    Prompt("chat", "explain recursion", "Explain recursion to a new programmer, with one example.", True),
    Prompt("chat", "git advice", "How should a small team use git branches? Give practical advice.", True),
    Prompt("prose", "printing press", "The printing press changed Europe in ways that", False),
    Prompt("prose", "lighthouse", "The old lighthouse keeper climbed the stairs one last time, and", False),
    Prompt("prose", "rivers", "Rivers have shaped where people settle because", False),
)  # fmt: skip

CALIBRATION: tuple[Prompt, ...] = (
    Prompt("code", "binary search", "def binary_search(items, target):\n    \"\"\"Return the index of "
           "target in the sorted list items, or -1.\"\"\"\n", False),
    Prompt("code", "CSV average", "Write a Python function that reads a CSV file and returns the average "
           "of one column.", True),
    Prompt("json", "stock", "Convert this to JSON with keys name, price and stock: the red mug costs 8.50 "
           "and 12 are in stock; the blue plate costs 4 and 30 are in stock.", True),
    Prompt("chat", "hash table", "Explain in a few sentences what a hash table is and why lookups are "
           "fast.", True),
    Prompt("prose", "bicycle", "The history of the bicycle begins in the early nineteenth century, when",
           False),
    Prompt("code", "matrix", "class Matrix:\n    def __init__(self, rows):\n        self.rows = rows\n\n"
           "    def transpose(self):\n", False),
)  # fmt: skip

PROMPT_SETS: dict[str, tuple[Prompt, ...]] = {"bench": BENCH, "traces": TRACES, "calibration": CALIBRATION}


def of_kinds(prompts: Sequence[Prompt], kinds: Sequence[str] | None) -> list[Prompt]:
    """The prompts of ``kinds`` (all when none are given), in order; a ValueError when none is left."""
    chosen = [p for p in prompts if not kinds or p.kind in kinds]
    if not chosen:
        known = sorted({p.kind for p in prompts})
        raise ValueError(f"no prompts of kinds {list(kinds or [])}; known: {known}")
    return chosen
