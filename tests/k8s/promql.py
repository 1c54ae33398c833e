"""A small PromQL reader for the monitoring tests: which metric names an expression references, which
labels each selector matches on, and which labels it groups or matches by.

Not a parser: a tokenizer that knows what is not a metric name (functions, aggregation operators
and keywords, label names inside braces and in ``by (...)`` / ``on (...)`` lists, strings, numbers,
durations, Grafana's ``$variables``, ranges and subqueries in brackets). That is enough to hold a
dashboard or an alert to the names a scrape can show: a name it cannot place is reported, never
skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

# PromQL's aggregation operators, set operators and other keywords: never metric names, even where
# a parenthesis follows (``sum(...)``) or none does (``x and y``).
KEYWORDS = frozenset(
    {
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
        "topk", "quantile", "limitk", "limit_ratio", "and", "or", "unless", "atan2", "bool", "offset",
        "inf", "nan",
    }
)  # fmt: skip
# Keywords followed by a parenthesised list of label names (group_left/right's list is optional).
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    |(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    |(?P<var>\$\{[^}]*\}|\$\w+)
    |(?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![\w.]))
    |(?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    |(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    |(?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=@])
    |(?P<punct>[(){}\[\],:])
    """,
    re.VERBOSE,
)


@dataclass
class References:
    """What one expression references."""

    names: set[str] = field(default_factory=set)
    # (metric name, label names its matchers use) per selector; the name is None for a selector
    # without one (``{__name__=~"..."}`` with a regex)
    selectors: list[tuple[str | None, frozenset[str]]] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)  # labels of by/without/on/ignoring/group_*


def tokens(expr: str) -> Iterator[tuple[str, str]]:
    """``(kind, text)`` for each token of ``expr``, spaces left out; an unknown character raises."""
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if not match:
            raise ValueError(f"cannot read {expr[pos : pos + 20]!r} at {pos} of {expr!r}")
        pos = match.end()
        kind = match.lastgroup or ""
        if kind != "space":
            yield kind, match.group()


def _closing(toks: list[tuple[str, str]], start: int, open_: str, close: str) -> int:
    """Index of the token closing the bracket opened at ``start``."""
    depth = 0
    for i in range(start, len(toks)):
        if toks[i][1] == open_:
            depth += 1
        elif toks[i][1] == close:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_!r} in {' '.join(t for _, t in toks)!r}")


def _matchers(toks: list[tuple[str, str]]) -> tuple[frozenset[str], str | None]:
    """Label names of a ``{...}`` block's matchers, and the metric name an ``__name__="x"`` gives."""
    labels: set[str] = set()
    name = None
    for i, (kind, text) in enumerate(toks):
        if kind in ("ident", "string") and i + 1 < len(toks) and toks[i + 1][0] == "op":
            label = text.strip("\"'`") if kind == "string" else text  # quoted label names (UTF-8)
            labels.add(label)
            if label == "__name__" and toks[i + 1][1] == "=" and i + 2 < len(toks):
                name = toks[i + 2][1][1:-1]
    return frozenset(labels - {"__name__"}), name


def references(expr: str) -> References:
    """The metric names, selector labels and grouping labels ``expr`` references."""
    toks = list(tokens(expr))
    for open_, close in ("()", "[]", "{}"):
        depth = 0
        for _, text in toks:
            depth += (text == open_) - (text == close)
            if depth < 0:
                break
        if depth != 0:
            raise ValueError(f"unbalanced {open_!r} in {expr!r}")
    out = References()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        following = toks[i + 1][1] if i + 1 < len(toks) else ""
        if text == "[":  # a range or a subquery's range and step: durations and Grafana variables
            i = _closing(toks, i, "[", "]") + 1
        elif text == "{":  # a selector without a name outside the braces
            end = _closing(toks, i, "{", "}")
            labels, name = _matchers(toks[i + 1 : end])
            out.selectors.append((name, labels))
            if name:
                out.names.add(name)
            i = end + 1
        elif kind == "ident" and text in LABEL_LIST_KEYWORDS:
            if following == "(":
                end = _closing(toks, i + 1, "(", ")")
                out.grouping |= {t for k, t in toks[i + 2 : end] if k in ("ident", "string")}
                i = end + 1
            else:
                i += 1
        elif kind == "ident" and (text in KEYWORDS or following == "("):
            i += 1  # an operator, a keyword or a function
        elif kind == "ident":
            out.names.add(text)
            if following == "{":
                end = _closing(toks, i + 1, "{", "}")
                labels, _ = _matchers(toks[i + 2 : end])
                out.selectors.append((text, labels))
                i = end + 1
            else:
                out.selectors.append((text, frozenset()))
                i += 1
        else:
            i += 1
    return out


def problems(expr: str, labels_by_name: Mapping[str, frozenset[str]]) -> list[str]:
    """Every reference of ``expr`` that ``labels_by_name`` (sample name -> its labels) does not
    allow: an unknown metric name, a matcher on a label the metric lacks, a grouping label that no
    metric of the expression carries, or no metric at all."""
    refs = references(expr)
    found: list[str] = []
    if not refs.names:
        found.append(f"no metric name in {expr!r}")
    for name in sorted(refs.names - set(labels_by_name)):
        found.append(f"unknown metric {name!r}")
    for name, labels in refs.selectors:
        if name in labels_by_name and not labels <= labels_by_name[name]:
            found.append(f"{name!r} has no label {sorted(labels - labels_by_name[name])}")
    carried = set().union(*(labels_by_name.get(n, frozenset()) for n in refs.names))
    if refs.names and refs.grouping - carried:
        found.append(f"grouping by {sorted(refs.grouping - carried)}, which none of {sorted(refs.names)} has")
    return found
