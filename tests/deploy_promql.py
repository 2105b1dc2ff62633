"""Helpers for the deploy tests: PromQL names, exposition parsing, promtool input and templates."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

KEYWORDS = {"and", "or", "unless", "bool", "inf", "nan", "offset"}
_GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"


@dataclass(frozen=True)
class Refs:
    """The metric names and label names one PromQL expression mentions."""

    metrics: frozenset[str]
    labels: frozenset[str]


def promql_refs(expr: str) -> Refs:
    """Metric and label names in `expr`, without a full parser (the syntax is promtool's job)."""
    labels: set[str] = set()
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", expr, re.S)
    if m:  # a Grafana variable query
        inner = promql_refs(m.group(1))
        return Refs(inner.metrics, inner.labels | {m.group(2)})
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    for sel in re.findall(r"\{([^}]*)\}", s):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", sel))
    s = re.sub(r"\{[^}]*\}", " ", s)
    for group in re.findall(_GROUPING, s):
        labels |= {x.strip() for x in group.split(",") if x.strip()}
    s = re.sub(_GROUPING, " ", s)
    s = re.sub(r"\[[^\]]*\]|\$\w+|\boffset\s+\w+", " ", s)
    names = {
        t.group(1)
        for t in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", s)
        if not t.group(2) and t.group(1) not in KEYWORDS
    }
    return Refs(frozenset(names), frozenset(labels))


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def series(self, **extra: str) -> str:
        """The sample's series in PromQL selector syntax, with extra (target) labels."""
        pairs = sorted({**dict(self.labels), **extra}.items())
        body = ", ".join(f'{k}="{_escape(v)}"' for k, v in pairs)
        return f"{self.name}{{{body}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass(frozen=True)
class Exposition:
    """One scrape of /metrics: its samples and the names a query may use."""

    samples: tuple[Sample, ...]
    names: frozenset[str]
    labels: frozenset[str]

    @classmethod
    def parse(cls, text: str) -> Exposition:
        samples: list[Sample] = []
        names: set[str] = set()
        for fam in text_string_to_metric_families(text):
            # A family without samples yet (no purge so far) still names its series.
            names.add(f"{fam.name}_total" if fam.type == "counter" else fam.name)
            if fam.type == "info":
                names.add(f"{fam.name}_info")
            for s in fam.samples:
                names.add(s.name)
                samples.append(Sample(s.name, tuple(sorted(s.labels.items())), float(s.value)))
        labels = {k for s in samples for k, _ in s.labels}
        return cls(tuple(samples), frozenset(names), frozenset(labels))

    def get(self, name: str, **labels: str) -> Sample:
        """The one sample of `name` whose labels include `labels`."""
        (hit,) = [
            s for s in self.samples if s.name == name and labels.items() <= dict(s.labels).items()
        ]
        return hit

    def all(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]


def rule_exprs(groups: Iterable[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """(rule name, expr) of every recording and alerting rule."""
    for group in groups:
        for rule in group["rules"]:
            yield rule.get("record") or rule["alert"], rule["expr"]


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) of every query a Grafana dashboard runs: panels, variables, annotations."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard["panels"]):
        for t in p.get("targets", []):
            yield p["title"], t["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            yield f"${var['name']}", var["query"]["query"]
    for ann in dashboard["annotations"]["list"]:
        if "expr" in ann:
            yield ann["name"], ann["expr"]


def go_float(value: float) -> str:
    """Go's %v of a float64 for the values the tests use (integers and short decimals)."""
    return str(int(value)) if value == int(value) else repr(value)


def render(template: str, labels: dict[str, str], value: float) -> str:
    """Prometheus' alert template subset the rules use: $labels.X, $value, humanizePercentage."""

    def one(m: re.Match[str]) -> str:
        expr = m.group(1).strip()
        if expr.startswith("$labels."):
            return labels.get(expr.removeprefix("$labels."), "")
        if expr == "$value":
            return go_float(value)
        if expr == "$value | humanizePercentage":
            return f"{value * 100:.4g}%"
        raise AssertionError(f"template {expr!r} not supported by this test")

    return re.sub(r"\{\{(.*?)\}\}", one, template)
