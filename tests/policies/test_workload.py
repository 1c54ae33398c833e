"""Workload classification: a tag wins; otherwise a cheap guess from the prompt text."""

from __future__ import annotations

import time

import pytest

from policies import classify
from policies.workload import scores

EXAMPLES = {
    "code": [
        "def quicksort(arr):\n    ",
        'def load_config(path):\n    """Load a YAML config file and validate it."""\n',
        "user: Can you write a class for an LRU cache in Python?\nassistant:",
        "Write a Python function that parses JSON",
        "```js\nconst x = [1, 2, 3].map((v) => v * 2);\n```\nWhat does this print?",
        '#include <stdio.h>\nint main(void) {\n    printf("hi");\n    return 0;\n}\n',
        "Fix the bug in this method:\n    public int size() {\n        return n;\n    }",
    ],
    "json": [
        "Give me a JSON object describing a user with a name and an age.",
        '{"name": "specserve", "version": 1, "tags": ["fast", "lossless"]}',
        "Return the answer as JSON with the keys city and country.",
        'Extract the fields into {"title": ..., "year": ...} for: The Matrix (1999).',
    ],
    "prose": [
        "Tell me a story about a dragon who loves tea.",
        "Explain why the sky is blue in simple terms.",
        "If you were a bird, where would you fly? For example: to the sea.",
        "Summarize the following article: The economy grew three percent last year. " * 40,
        "",
    ],
}


@pytest.mark.parametrize(("expected", "text"), [(k, t) for k, texts in EXAMPLES.items() for t in texts])
def test_examples(expected, text):
    assert classify(text) == expected, scores(text)


def test_a_tag_wins_and_is_normalised():
    assert classify("def f():\n    pass", tag="Poetry ") == "poetry"
    assert classify("Tell me a story.", tag="code") == "code"
    assert classify("Tell me a story.", tag="  ") == "prose"  # blank: no tag


def test_cheap_on_long_prompts():
    text = "The quick brown fox jumps over the lazy dog. " * 5000  # 225 kB
    start = time.process_time()
    for _ in range(20):
        classify(text)
    assert (time.process_time() - start) / 20 < 0.005  # only both ends are read
