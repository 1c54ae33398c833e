"""`python -m loadtest.exactness --base-url URL`: is speculation exact through a running server?

Sends each prompt (chat, through the official ``openai`` client) with speculation off, with every
proposer the server lists and with "auto", greedy and seeded-sampled, streamed and not, and
compares each answer with the plain one (speculation off, not streamed). The API returns text,
so text is what is compared. Prints a Markdown table: per prompt and sampling, which modes gave
the plain answer. Exit status 1 if any differed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from serve_app.engine.proposers.registry import registered_proposers

PROMPTS = (  # not in the repository's other prompt sets
    "Write a Python function that merges overlapping intervals.",
    "Explain in two sentences why the sky is blue.",
    "Give a JSON object describing a book with title, author and year.",
)
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded T=0.8": {"temperature": 0.8, "top_p": 0.95, "seed": 17}}


def answer(
    client: Any, model: str, prompt: str, mode: str, stream: bool, max_tokens: int, **sampling: Any
) -> str:
    """The server's answer to one request (text of the first choice)."""
    kwargs = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
              "extra_body": {"speculation": {"mode": mode}}, **sampling}  # fmt: skip
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    parts = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        parts += [c.delta.content or "" for c in chunk.choices]
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    import openai

    parser = argparse.ArgumentParser(prog="python -m loadtest.exactness", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default: local)")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key, max_retries=0, timeout=600)
    card = client.models.list().data[0]
    info = card.model_extra or {}
    model = card.id
    modes = [*registered_proposers(), "auto"]  # a proposer the server did not load is reported n/a
    title = f"Model `{model}`, exact reported by the server: {info.get('exact')}, {args.max_tokens} tokens"
    lines = [title, "",
             "| prompt | sampling | " + " | ".join(f"{m} / {m} streamed" for m in ["off", *modes]) + " |",
             "|---|---|" + "---|" * (1 + len(modes))]  # fmt: skip
    differed = False
    for prompt in PROMPTS:
        for label, sampling in SAMPLINGS.items():
            plain = answer(client, model, prompt, "off", False, args.max_tokens, **sampling)
            cells = []
            for mode in ["off", *modes]:
                verdicts = []
                for stream in (False, True):
                    try:
                        same = (
                            answer(client, model, prompt, mode, stream, args.max_tokens, **sampling) == plain
                        )
                    except openai.BadRequestError:
                        verdicts.append("n/a")  # the server has no such proposer
                        continue
                    differed |= not same
                    verdicts.append("identical" if same else "DIFFERS")
                cells.append(" / ".join(verdicts))
            lines.append(f"| {prompt[:40]} | {label} | " + " | ".join(cells) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    return 1 if differed else 0


if __name__ == "__main__":
    sys.exit(main())
