"""How much of a run the notebook holds: the size of one event, the tail of a run's progress and
output kept in memory, and the size of its log on disk.

A run may print without end or log a huge string every step; the notebook must not grow with
it. So each text an event carries is cut (``bound_event``: metric strings and names, printed
chunks, error messages and tracebacks), the in-memory stream keeps every lifecycle event but only
the most recent progress and output (``EventStream``; the rest is in the log on disk), and the
log stops taking progress and output once it reaches ``LOG_BYTES`` (saying so in a
``log_truncated`` event). What was cut says so where it was cut.

>>> cut("x" * 10, 4)
'xxxx… [6 more characters not kept]'
>>> cut_middle("head-" + "x" * 100 + "-tail", 20)
'head-xxxxx… [90 more characters not kept] …xxxxx-tail'
"""
from __future__ import annotations

import re
from typing import Any

_CUT_MARK = re.compile(r"… \[\d+ more characters not kept\]$")  # what cut() appends

__all__ = ["cut", "cut_middle", "bound_event", "escape_surrogates", "bound_metrics", "event_weight", "METRIC_CHARS",
           "NAME_CHARS", "METRICS_KEPT", "TEXT_CHARS", "OUTPUT_CHARS",
           "TAIL_EVENTS", "TAIL_BYTES", "ENDED_TAIL_EVENTS", "ENDED_TAIL_BYTES", "LOG_BYTES", "LINE_CHARS"]

METRIC_CHARS = 1000
"""Characters kept of a metric's string value (the panel shows a few dozen)."""
NAME_CHARS = 100
"""Characters kept of a metric's name."""
METRICS_KEPT = 200
"""Metrics kept in one report, and names a worker's state keeps (the first ones logged)."""
TEXT_CHARS = 64 * 1024
"""Characters kept of one error message or traceback (each keeps its head and its end, where the
error is)."""
OUTPUT_CHARS = 1024 * 1024
"""Characters kept of one printed chunk (the local transport sends at most 128 KiB at a time:
this only bounds an executor that would send more)."""
LINE_CHARS = 2000
"""Characters kept of one printed line in a worker's in-memory tail (``WorkerState.output``)."""
TAIL_EVENTS = 20_000
"""Progress and output events kept in memory per run (the most recent); the log has the rest."""
TAIL_BYTES = 16 * 2**20
"""Bytes of progress and output kept in memory per run (the most recent)."""
ENDED_TAIL_EVENTS, ENDED_TAIL_BYTES = 2_000, 2**20
"""What memory keeps of a run's progress and output once it has ended (a notebook holds its last
100 runs: ``lifecycle.launch.runs()``)."""
LOG_BYTES = 512 * 2**20
"""Bytes of a run's event log on disk past which progress and output are no longer written
(lifecycle events, failures and checkpoints always are)."""


def cut(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters, saying how much more there was; a text cut already is
    kept as it is (a held report merged into the next is bounded again)."""
    if len(text) <= limit:
        return text
    marked = _CUT_MARK.search(text)
    if marked is not None and marked.start() <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters not kept]"


def cut_middle(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters: its head and its end, saying how much was left out."""
    if len(text) <= limit:
        return text
    head, tail = limit // 2, limit - limit // 2
    return f"{text[:head]}… [{len(text) - limit} more characters not kept] …{text[-tail:]}"


def bound_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with names and string values cut, and at most ``METRICS_KEPT`` of them."""
    if len(metrics) <= METRICS_KEPT and not any(
            len(str(k)) > NAME_CHARS or (isinstance(v, str) and len(v) > METRIC_CHARS) for k, v in metrics.items()):
        return metrics
    items = list(metrics.items())[:METRICS_KEPT]
    return {cut(str(k), NAME_CHARS): cut(v, METRIC_CHARS) if isinstance(v, str) else v for k, v in items}


def _bound_text(key: str, text: str) -> str:
    """One text of an event cut to its limit: printed output keeps its head, a message or a
    traceback its head and its end."""
    return cut(text, OUTPUT_CHARS) if key == "text" else cut_middle(text, TEXT_CHARS)


def bound_event(event: dict[str, Any]) -> dict[str, Any]:
    """``event`` with every text it carries cut to its limit (the event itself when nothing is
    too long, as almost always)."""
    metrics = event.get("metrics")
    small = bound_metrics(metrics) if isinstance(metrics, dict) else metrics
    texts = {key: _bound_text(key, event[key]) for key in ("text", "message", "traceback", "exc_type")
             if isinstance(event.get(key), str)}
    if small is metrics and all(texts[key] is event[key] for key in texts):  # cut() returns a short text itself
        return event
    return dict(event, **texts, **({"metrics": small} if isinstance(metrics, dict) else {}))


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _escaped(found: re.Match[str]) -> str:
    return f"\\u{ord(found.group()):04x}"


def escape_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings (in dicts, lists and tuples too) written
    as its escape, ``\\ud800``: no front end can carry one (the UTF-8 of Jupyter's messages has no
    place for it: a widget or display holding one fails to send, and every later update with it),
    and a rank's error, a logged string or a variable's name may hold one. The value itself
    when it holds none, as almost always.

    >>> print(escape_surrogates({"message": "bad " + chr(0xD800), "step": 3})["message"])
    bad \\ud800
    """
    if isinstance(value, str):  # (an ASCII text, as almost every one, is known clean at once)
        return value if value.isascii() or not _LONE_SURROGATE.search(value) else _LONE_SURROGATE.sub(_escaped, value)
    if isinstance(value, dict):
        items = [(escape_surrogates(k), escape_surrogates(v)) for k, v in value.items()]
        same = all(new_k is k and new_v is v for (new_k, new_v), (k, v) in zip(items, value.items()))
        return value if same else dict(items)
    if isinstance(value, (list, tuple)):
        escaped = [escape_surrogates(v) for v in value]
        return value if all(a is b for a, b in zip(escaped, value)) else type(value)(escaped)
    return value


def event_weight(event: dict[str, Any]) -> int:
    """About how many bytes ``event`` holds in memory: a dict's overhead, and per metric its name,
    its value and their entry (a report of 150 metrics weighs about 25 KB)."""
    metrics = event.get("metrics")
    weight = 400
    if isinstance(metrics, dict):
        weight += sum(120 + len(str(k)) + (len(v) if isinstance(v, str) else 32) for k, v in metrics.items())
    text = event.get("text")
    points = event.get("points")
    weight += 150 * len(points) if isinstance(points, list) else 0  # rank 0's logged values since its last report
    return weight + (len(text) if isinstance(text, str) else 0)
