"""Workloads, prompts and the Locust file's user classes.

The Locust file is parsed, not imported: importing Locust monkey-patches the whole process with
gevent, which the rest of the test session must not inherit.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from loadtest.workloads import (
    MIXES,
    USER_CLASSES,
    WORKLOAD_NAMES,
    Conversation,
    Workload,
    load_workloads,
    mix_classes,
    mix_workloads,
)

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"


def test_every_workload_loads_with_its_own_character() -> None:
    workloads = load_workloads()
    assert set(workloads) == set(WORKLOAD_NAMES)
    for w in workloads.values():
        assert len(w.prompts) >= 5 and len(set(w.prompts)) == len(w.prompts)
        assert w.max_tokens >= 16 and w.weight > 0
    assert workloads["creative"].temperature == 1.0
    assert workloads["code"].temperature == 0 and workloads["json"].temperature == 0
    assert workloads["chat"].turns > 1 and workloads["chat"].followups
    assert workloads["chat"].max_tokens > workloads["bulk"].max_tokens  # long answers vs short requests
    assert workloads["bulk"].think_time_s == (0.0, 0.0)


def test_locust_classes_match_the_mixes() -> None:
    tree = ast.parse(LOCUSTFILE.read_text())
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert set(USER_CLASSES) <= classes
    for mix, users in MIXES.items():
        assert set(users) <= set(USER_CLASSES), mix
    assert mix_workloads("mixed") == WORKLOAD_NAMES
    assert mix_workloads("structured") == ("code", "json")
    with pytest.raises(ValueError, match="unknown workload mix"):
        mix_classes("nope")


def test_request_body_streams_and_seeds_only_sampled_requests() -> None:
    workloads = load_workloads()
    messages = [{"role": "user", "content": "hi"}]
    greedy = workloads["code"].body("m", messages, seed=7)
    assert greedy["stream"] is True and greedy["stream_options"] == {"include_usage": True}
    assert greedy["speculation"] == {"mode": "auto"} and "seed" not in greedy
    assert greedy["max_tokens"] == workloads["code"].max_tokens
    sampled = workloads["creative"].body("m", messages, seed=7, max_tokens=8)
    assert sampled["seed"] == 7 and sampled["temperature"] == 1.0 and sampled["max_tokens"] == 8


def test_conversation_runs_turns_then_starts_over() -> None:
    chat = load_workloads()["chat"]
    conv = Conversation(chat, random.Random(1))
    first = conv.next_messages()
    assert first[0]["role"] == "system" and first[-1]["content"] in chat.prompts
    conv.answered("answer one")
    second = conv.next_messages()
    assert second[: len(first)] == first
    assert second[len(first)] == {"role": "assistant", "content": "answer one"}
    assert second[-1]["content"] in chat.followups
    for _ in range(chat.turns - 2):
        conv.answered("more")
        conv.next_messages()
    conv.answered("last")
    fresh = conv.next_messages()
    assert len(fresh) == 2 and fresh[-1]["content"] in chat.prompts  # a new conversation
    conv.answered(None)  # a failed request ends the conversation
    assert len(conv.next_messages()) == 2


def test_same_seed_same_prompt_sequence() -> None:
    code = load_workloads()["code"]
    a = [Conversation(code, random.Random(3)).next_messages() for _ in range(3)]
    b = [Conversation(code, random.Random(3)).next_messages() for _ in range(3)]
    assert a == b


def test_bad_workloads_are_refused() -> None:
    with pytest.raises(ValueError, match="no prompts"):
        Workload("x", "x", (), 8, 0.0)
    with pytest.raises(ValueError, match="follow-up"):
        Workload("x", "x", ("p",), 8, 0.0, turns=2)
    with pytest.raises(ValueError, match="think_time_s"):
        Workload("x", "x", ("p",), 8, 0.0, think_time_s=(2.0, 1.0))
