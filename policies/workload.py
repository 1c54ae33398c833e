"""Workload class of a request: "code", "json" or "prose" (or the request's own tag).

Acceptance depends far more on what is being generated than on anything else (code ~0.95 per
position with the Qwen coder pair, chat about code ~0.75-0.8, prose ~0.4-0.6), so priors and
shared statistics are kept per class. A tag given with the request wins: it is free and exact (the
client knows what it asks for). Without one, ``classify`` guesses from the prompt text with a few
substring tests over at most ``WINDOW`` characters from each end of the prompt
(instructions sit at the start of a raw prompt and at the end of a chat transcript): tens of
microseconds, once per request, against a decode step of 100+ ms. It is a fallback; a wrong guess
costs only a less apt prior, which the per-request estimate corrects within a few steps.
"""

from __future__ import annotations

import re

CODE = "code"
JSON = "json"
PROSE = "prose"
WINDOW = 1500  # characters from each end of the prompt

# Plain substring tests and one line loop: Python's regex engine scans prose slowly (a \b-prefixed
# pattern costs ~50 us per 4 kB), str methods are C loops.
_CODE_LINE_START = (
    "def ", "class ", "import ", "from ", "async def ", "return", "for ", "while ", "if ", "elif ",
    "#include", "using ", "package ", "func ", "fn ", "let ", "const ", "var ", "function", "public ",
    "private ", "static ", "interface ", "struct ", "impl ", "SELECT ", "INSERT ", "CREATE TABLE", "@",
)  # fmt: skip
_CODE_LINE_END = (";", "{", "}", "):", ") {", "=>")
_CODE_WORDS = (
    "python", "javascript", "typescript", "java ", "rust", "golang", "c++", "sql", "bash", "function",
    "method", "class ", "compile", "unit test", "regex", "algorithm", "snippet", "script", "stack trace",
)  # fmt: skip
_CODE_OPERATORS = ("=>", "->", "::", "==", "!=", "+=", "()")
_ASK_VERBS = ("write", "implement", "fix", "refactor", "complete", "debug", "optimi")
_ASK_NOUNS = ("function", "class", "method", "script", "program", "code", "module", "test", "query")
_JSON_PAIR = re.compile(r'"[^"\n]{1,80}"\s*:\s*\S')
_JSON_OPEN = re.compile(r'[{\[]\s*"')


def _window(text: str) -> str:
    return text if len(text) <= 2 * WINDOW else text[:WINDOW] + "\n" + text[-WINDOW:]


def _asks_for_code(lower: str) -> bool:
    """A verb like "write"/"fix" followed within 40 characters by a noun like "function"."""
    for verb in _ASK_VERBS:
        at = lower.find(verb)
        while at >= 0:
            tail = lower[at : at + len(verb) + 40]
            if any(noun in tail for noun in _ASK_NOUNS):
                return True
            at = lower.find(verb, at + 1)
    return False


def scores(prompt_text: str) -> dict[str, float]:
    """The evidence for each class (for tests and debugging; ``classify`` takes the best)."""
    text = _window(prompt_text)
    lower = text.lower()
    code_lines = indented = line_ends = 0
    for line in text.splitlines():
        body = line.strip()
        if not body:
            continue
        code_lines += body.startswith(_CODE_LINE_START)
        indented += line.startswith(("    ", "\t"))
        line_ends += body.endswith(_CODE_LINE_END)
    code = (
        4.0 * ("```" in text)
        + 3.0 * _asks_for_code(lower)
        + 2.0 * min(6, code_lines)
        + 1.0 * min(4, sum(word in lower for word in _CODE_WORDS))
        + 0.5 * min(4, indented)
        + 0.25 * min(8, line_ends + sum(op in text for op in _CODE_OPERATORS))
    )
    stripped = text.strip()
    json = (
        2.5 * min(2, lower.count("json"))
        + 0.75 * min(8, len(_JSON_PAIR.findall(text)))
        + 1.5 * bool(_JSON_OPEN.search(text))
        + (2.0 if stripped[:1] in "{[" and stripped[-1:] in "}]" else 0.0)
    )
    return {CODE: code, JSON: json, PROSE: 2.0}


def classify(prompt_text: str, tag: str | None = None) -> str:
    """The request's workload class: its tag if given (stripped, lower case), else a guess.

    JSON wins ties with code (a prompt that asks for JSON output is about JSON even if it shows
    some code); prose is what neither reaches (a threshold of 2).
    """
    if tag is not None and tag.strip():
        return tag.strip().lower()
    s = scores(prompt_text)
    if s[JSON] >= s[CODE] and s[JSON] > s[PROSE]:
        return JSON
    if s[CODE] > s[PROSE]:
        return CODE
    return PROSE
