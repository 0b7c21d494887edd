"""A small PromQL parser: enough to reject a malformed dashboard query and list its metrics.

Covers what a Grafana panel uses: selectors with label matchers, range vectors,
functions, aggregations with ``by``/``without``, binary operators with ``bool``,
``on``/``ignoring`` and ``group_left``/``group_right``, numbers and strings. Grafana's
``$variables`` are replaced first (``expand``). It raises ``PromQLError`` naming the
position; ``metric_names`` returns every metric a query selects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp",
    "clamp_max", "clamp_min", "count_over_time", "delta", "deriv", "exp", "floor",
    "histogram_quantile", "histogram_count", "histogram_sum", "idelta", "increase",
    "irate", "label_join", "label_replace", "last_over_time", "ln", "log2", "log10",
    "max_over_time", "min_over_time", "predict_linear", "quantile_over_time", "rate",
    "resets", "round", "scalar", "sort", "sort_desc", "sqrt", "stddev_over_time",
    "sum_over_time", "time", "timestamp", "vector"})
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk",
                          "bottomk", "quantile", "count_values", "group"})
BINARY = ("==", "!=", ">=", "<=", ">", "<", "+", "-", "*", "/", "%", "^")
SET_OPS = frozenset({"and", "or", "unless"})
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){}\[\],:])
""", re.X)
# What Grafana puts for its variables when a query runs.
GRAFANA = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


class PromQLError(ValueError):
    pass


def expand(expr: str, variables: dict[str, str] | None = None) -> str:
    """``expr`` with Grafana's variables replaced (``$name`` -> a value)."""
    for name, value in {**GRAFANA, **(variables or {})}.items():
        expr = expr.replace(name, value)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def tokens(expr: str) -> list[tuple[str, str, int]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise PromQLError(f"unexpected character {expr[pos]!r} at {pos} in {expr!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup or "", m.group(), pos))
        pos = m.end()
    return out


@dataclass
class _Parser:
    expr: str
    toks: list[tuple[str, str, int]]
    i: int = 0
    metrics: list[str] = field(default_factory=list)

    def peek(self, offset: int = 0) -> tuple[str, str, int]:
        j = self.i + offset
        return self.toks[j] if j < len(self.toks) else ("eof", "", len(self.expr))

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        k, v, pos = self.peek()
        if (value is not None and v != value) or (kind is not None and k != kind):
            raise PromQLError(f"expected {value or kind} at {pos}, found {v or 'the end'!r} "
                              f"in {self.expr!r}")
        self.i += 1
        return v

    def binary(self) -> None:
        self.unary()
        while True:
            k, v, _ = self.peek()
            if not ((k == "op" and v in BINARY) or (k == "ident" and v in SET_OPS)):
                return
            self.i += 1
            if self.peek()[1] == "bool":
                self.i += 1
            if self.peek()[1] in ("on", "ignoring"):
                self.i += 1
                self.labels()
            if self.peek()[1] in ("group_left", "group_right"):
                self.i += 1
                if self.peek()[1] == "(":
                    self.labels()
            self.unary()

    def unary(self) -> None:
        if self.peek()[1] in ("-", "+"):
            self.i += 1
        self.primary()
        if self.peek()[1] == "[":
            self.range()

    def range(self) -> None:
        self.take("[")
        self.take(kind="duration")
        if self.peek()[1] == ":":
            self.i += 1
            if self.peek()[0] == "duration":
                self.i += 1
        self.take("]")

    def labels(self) -> list[str]:
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            names.append(self.take(kind="ident"))
            if self.peek()[1] == ",":
                self.i += 1
        self.take(")")
        return names

    def args(self) -> None:
        self.take("(")
        while self.peek()[1] != ")":
            self.binary()
            if self.peek()[1] == ",":
                self.i += 1
        self.take(")")

    def primary(self) -> None:
        k, v, pos = self.peek()
        if k in ("number", "string"):
            self.i += 1
        elif v == "(":
            self.i += 1
            self.binary()
            self.take(")")
        elif v == "{":
            self.matchers()
        elif k == "ident" and v in AGGREGATIONS and self.peek(1)[1] in ("(", "by", "without"):
            self.i += 1
            if self.peek()[1] in ("by", "without"):
                self.i += 1
                self.labels()
            self.args()
            if self.peek()[1] in ("by", "without"):
                self.i += 1
                self.labels()
        elif k == "ident" and self.peek(1)[1] == "(":
            if v not in FUNCTIONS:
                raise PromQLError(f"unknown function {v!r} at {pos} in {self.expr!r}")
            self.i += 1
            self.args()
        elif k == "ident":
            self.i += 1
            self.metrics.append(v)
            if self.peek()[1] == "{":
                self.matchers()
        else:
            raise PromQLError(f"unexpected {v or 'end'!r} at {pos} in {self.expr!r}")

    def matchers(self) -> None:
        self.take("{")
        while self.peek()[1] != "}":
            self.take(kind="ident")
            if self.peek()[1] not in ("=", "!=", "=~", "!~"):
                raise PromQLError(f"expected a label matcher at {self.peek()[2]} in "
                                  f"{self.expr!r}")
            self.i += 1
            self.take(kind="string")
            if self.peek()[1] == ",":
                self.i += 1
        self.take("}")


def metric_names(expr: str, variables: dict[str, str] | None = None) -> list[str]:
    """Every metric ``expr`` selects; raises ``PromQLError`` when it does not parse."""
    text = expand(expr, variables)
    parser = _Parser(text, tokens(text))
    parser.binary()
    if parser.peek()[0] != "eof":
        raise PromQLError(f"trailing {parser.peek()[1]!r} at {parser.peek()[2]} in {text!r}")
    return parser.metrics
