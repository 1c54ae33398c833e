"""Locust users for specserve: streamed chat completions with speculation left to the server.

    locust -f loadtest/locustfile.py --headless -u 4 -r 4 -t 60s --host http://127.0.0.1:8000 \
        --records out/records.jsonl MixedUser

User classes (one per workload of ``loadtest/prompts``; pick them by name on the command line):

- ``ChatUser``: interactive chat, a few turns per conversation, long answers, think time between
  turns (temperature 0.7).
- ``CodeUser``: code completion with repetitive structure (greedy): where speculation helps most.
- ``JsonUser``: JSON extraction (greedy).
- ``CreativeUser``: creative writing at temperature 1.0: where it helps least.
- ``BulkUser``: short requests with no think time; many of them make a large batch.
- ``MixedUser``: every request drawn from all five by their weights (so one user sees the mix).

Each request streams ``/v1/chat/completions`` and fires three Locust events (so Locust's own
statistics and CSVs have them): ``POST <workload>`` (response time = the whole stream, response
length = output tokens), ``TTFT <workload>`` and ``TPOT <workload>`` (milliseconds). Every
request is also one JSON line in ``--records`` (``loadtest.streaming.RequestRecord``: timings,
tokens and the server's ``speculation`` block), which the matrix runner reads; at the end a
per-workload summary (tokens, acceptance) is printed.

With ``LOADTEST_RAMP=peak,duration`` in the environment (``specserve loadtest --ramp``) a shape
class drives the number of users over time instead of ``-u`` and ``-t`` (``loadtest.ramp``).

``--max-requests N`` bounds the run by request count: users stop starting requests after N and the
run quits when the last one finishes. ``--stop-timeout`` lets requests running at the end of
``-t`` finish, so every token the server generated is counted by the client too.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import IO, Any

import gevent
import requests
from locust import LoadTestShape, User, events, task
from locust.env import Environment
from locust.exception import StopUser

from loadtest.ramp import ramp_from_environment, users_at
from loadtest.streaming import RequestRecord, stream_chat
from loadtest.workloads import USER_CLASSES, Conversation, Workload, load_workloads


@dataclass
class LoadState:
    """Per-run state shared by the users of one Locust process (held by the environment)."""

    workloads: dict[str, Workload]
    model: str
    seed: int
    max_requests: int
    max_tokens: int | None
    records: IO[str] | None
    users: int = 0
    started: int = 0
    running: int = 0
    summary: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, record: RequestRecord) -> None:
        if self.records is not None:
            self.records.write(record.to_json() + "\n")
            self.records.flush()
        row = self.summary.setdefault(
            record.workload, {"requests": 0, "failures": 0, "tokens": 0, "drafted": 0, "accepted": 0}
        )
        row["requests"] += 1
        row["failures"] += 0 if record.ok else 1
        row["tokens"] += record.output_tokens
        row["drafted"] += record.drafted
        row["accepted"] += record.accepted


@events.init_command_line_parser.add_listener
def _arguments(parser: Any) -> None:
    parser.add_argument("--model", default="", help="model name to send (default: the server's /v1/models)")
    parser.add_argument("--records", default="", help="write one JSON line per request to this file")
    parser.add_argument(
        "--max-requests", type=int, default=0, help="stop after this many requests (0: no bound)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=0, help="cap every workload's max_tokens (0: no cap)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds prompt choice and sampling per user")


def _served_model(host: str) -> str:
    response = requests.get(f"{host.rstrip('/')}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


@events.test_start.add_listener
def _start(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    records = open(options.records, "w", encoding="utf-8") if options.records else None  # noqa: SIM115
    environment.specserve = LoadState(  # type: ignore[attr-defined]
        workloads=load_workloads(),
        model=options.model or _served_model(environment.host or ""),
        seed=options.seed,
        max_requests=options.max_requests,
        max_tokens=options.max_tokens or None,
        records=records,
    )


@events.quitting.add_listener
def _quit(environment: Environment, **_: Any) -> None:
    state: LoadState | None = getattr(environment, "specserve", None)
    if state is None:
        return
    if state.records is not None:
        state.records.close()
        state.records = None
    print("specserve per workload: requests, failures, output tokens, drafted, accepted, acceptance")
    for name, row in sorted(state.summary.items()):
        rate = row["accepted"] / row["drafted"] if row["drafted"] else 0.0
        print(f"  {name:10s} {json.dumps(row)} acceptance {rate:.0%}")


class _LLMUser(User):
    """A user that sends one streamed chat completion per task, from its workloads by weight."""

    abstract = True
    workload_names: tuple[str, ...] = ()

    def on_start(self) -> None:
        self.state: LoadState = self.environment.specserve  # type: ignore[attr-defined]
        self.index = self.state.users
        self.state.users += 1
        self.rng = random.Random(f"{self.state.seed}:{type(self).__name__}:{self.index}")
        self.conversations = {
            name: Conversation(self.state.workloads[name], random.Random(f"{self.rng.random()}"))
            for name in self.workload_names
        }
        self.current = next(iter(self.conversations.values()))
        self.session = requests.Session()
        self.retry_after_s = 0.0
        self.url = f"{(self.host or '').rstrip('/')}/v1/chat/completions"

    def on_stop(self) -> None:
        self.session.close()

    def wait_time(self) -> float:
        # A refused request is retried no sooner than the server asked (as OpenAI's client does).
        return max(self.current.think_time(), self.retry_after_s)

    def _pick(self) -> Conversation:
        if self.current.turn and self.current.turn < self.current.workload.turns:
            return self.current  # finish the running conversation first
        names = list(self.conversations)
        weights = [self.conversations[n].workload.weight for n in names]
        return self.conversations[self.rng.choices(names, weights)[0]]

    @task
    def ask(self) -> None:
        state = self.state
        if state.max_requests and state.started >= state.max_requests:
            if state.running == 0:
                gevent.spawn(self.environment.runner.quit)
            raise StopUser()
        conversation = self.current = self._pick()
        workload = conversation.workload
        body = workload.body(
            state.model, conversation.next_messages(), self.rng.randrange(2**31), state.max_tokens
        )
        state.started += 1
        state.running += 1
        try:
            record = stream_chat(self.session, self.url, body, RequestRecord(workload.name, self.index, 0.0))
        finally:
            state.running -= 1
        conversation.answered(record.text if record.ok else None)
        self.retry_after_s = record.retry_after_s or 0.0
        state.add(record)
        self._fire(record)

    def _fire(self, record: RequestRecord) -> None:
        fire = self.environment.events.request.fire
        error = None if record.ok else RuntimeError(record.error)
        fire(
            request_type="POST",
            name=record.workload,
            response_time=record.latency_s * 1000,
            response_length=record.output_tokens,
            exception=error,
            context={},
        )
        for kind, value in (("TTFT", record.ttft_s), ("TPOT", record.tpot_s)):
            if value is not None and record.ok:
                fire(
                    request_type=kind,
                    name=record.workload,
                    response_time=value * 1000,
                    response_length=0,
                    exception=None,
                    context={},
                )


class ChatUser(_LLMUser):
    workload_names = USER_CLASSES["ChatUser"]


class CodeUser(_LLMUser):
    workload_names = USER_CLASSES["CodeUser"]


class JsonUser(_LLMUser):
    workload_names = USER_CLASSES["JsonUser"]


class CreativeUser(_LLMUser):
    workload_names = USER_CLASSES["CreativeUser"]


class BulkUser(_LLMUser):
    workload_names = USER_CLASSES["BulkUser"]


class MixedUser(_LLMUser):
    workload_names = USER_CLASSES["MixedUser"]


_RAMP = ramp_from_environment()
if _RAMP is not None:  # only then: Locust uses any shape class it finds in the locustfile

    class RampShape(LoadTestShape):
        """``loadtest.ramp``'s users over time (``specserve loadtest --ramp``); replaces ``-u``/``-t``."""

        def tick(self) -> tuple[int, float] | None:
            peak, duration = _RAMP
            users = users_at(self.get_run_time(), peak, duration)
            return None if users is None else (users, float(peak))
