"""A run's state as plain text lines: for terminals, scripts, logs and ``text/plain`` reprs.

>>> from ddp_notebook.core.state import RunState
>>> s = RunState()
>>> s.apply({"kind": "run_started", "time": 0.0, "run_id": "r1", "devices": ["cpu:0", "cpu:1"]})
>>> s.apply({"kind": "progress", "time": 2.0, "rank": 0, "step": 5, "total": 10, "epoch": 1, "metrics": {"loss": 0.25}})
>>> print(format_worker(s.workers[0], now=2.0))
rank 0 cpu:0 (main) starting   step 5/10 ( 50%) epoch 1 loss 0.25
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

from ..core.console import one_line
from ..core.experiment import differing
from ..core.failures import ranks_text
from ..core.state import CellRecord, DataState, RunState, WorkerState

__all__ = ["format_worker", "format_run", "format_metric", "format_rate", "format_duration", "format_bytes",
           "format_data", "format_runs", "format_memory", "ended_because", "format_clock",
           "session_rank_text", "session_lines", "request_text"]


SHARE_HINT_FROM = 10**9
"""A copy of this many bytes or more says how to hold the data once (``share()``)."""


def format_metric(value: Any) -> str:
    """A metric as people read it: 4 significant digits, large numbers with k/M/G.

    >>> format_metric(0.123456), format_metric(15832.7), format_metric(2_500_000), format_metric("ok")
    ('0.1235', '15.8k', '2.5M', 'ok')
    >>> format_metric(6.77e33), format_metric(2.3e11)
    ('6.77e+33', '230G')
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) and abs(value) >= 10**18:  # (beyond a float's range, no float division)
        digits = str(abs(value))
        return f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"
    if abs(value) >= 1e12:  # past G: in powers of ten
        return f"{value:.3g}"
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
        if abs(value) >= size:
            scaled = value / (1e3 if suffix == "k" else size)
            return f"{scaled:.3g}{suffix}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_rate(w: WorkerState) -> str:
    """``12.5 steps/s, ETA 40 s``: a running rank's pace ('' until it is known)."""
    if w.rate is None:
        return ""
    if w.rate >= 1:
        pace = f"{format_metric(w.rate)} steps/s"
    else:
        pace = f"{format_duration(1 / w.rate)}/step" if w.rate > 0 else "no steps"
    eta = w.eta()
    return pace + (f", ETA {format_duration(eta)}" if eta is not None else "")


def format_duration(seconds: float) -> str:
    """``45 s``, ``2 min``, ``1 h 5 min``.

    >>> format_duration(45.2), format_duration(150), format_duration(3900)
    ('45 s', '2 min', '1 h 5 min')
    """
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = int(seconds // 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def format_bytes(n: float) -> str:
    """``512 kB``, ``1.2 GB`` (powers of 1000, as people read sizes).

    >>> format_bytes(999), format_bytes(524_288), format_bytes(1_234_567_890)
    ('999 B', '524 kB', '1.2 GB')
    """
    for size, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= size:
            return f"{n / size:.2g} {unit}" if n < 10 * size else f"{n / size:.0f} {unit}"
    return f"{n:.0f} B"


def format_data(data: DataState) -> str:
    """How the call's tensors and arrays reach the ranks: ``sending data 1.2 GB/4.0 GB`` while
    they are copied into shared memory, then what was shared and how. A copy is held twice while
    the run lives (the notebook's data and the ranks' copy): from 1 GB on, the line says how to
    hold it once.

    >>> format_data(DataState(total=4_000_000_000, sent=1_200_000_000))
    'sending data 1.2 GB/4 GB'
    >>> format_data(DataState(total=200_000_000, sent=200_000_000, files=["/data/x.npy"], seconds=0.1))
    'data: 200 MB copied to shared memory in 0.1 s (held twice while the run lives), /data/x.npy mapped from its file'
    >>> print(format_data(DataState(total=4_000_000_000, sent=4_000_000_000, seconds=0.9)))
    data: 4 GB copied to shared memory in 0.9 s (held twice while the run lives: ddp_notebook.share() holds it once)
    >>> format_data(DataState(seconds=0.0, in_place=2_000_000_000))
    'data: 2 GB already in shared memory (no copy)'
    """
    if data.sending:
        return f"sending data {format_bytes(data.sent)}/{format_bytes(data.total)}"
    parts = []
    if data.total:
        hint = ": ddp_notebook.share() holds it once" if data.total >= SHARE_HINT_FROM else ""
        parts.append(f"{format_bytes(data.total)} copied to shared memory in {data.seconds:.1f} s "
                     f"(held twice while the run lives{hint})")
    if data.in_place:
        parts.append(f"{format_bytes(data.in_place)} already in shared memory (no copy)")
    if data.files:
        parts.append(f"{', '.join(data.files[:3])}{' …' if len(data.files) > 3 else ''} mapped from its file")
    return "data: " + ", ".join(parts)


def format_memory(w: WorkerState) -> str:
    """A rank's peak memory so far: ``peak 1.2 GB RSS, 3.4 GB CUDA`` ('' before it said).

    >>> format_memory(WorkerState(0, "cpu:0", peak_rss=1_234_000_000))
    'peak 1.2 GB RSS'
    """
    parts = [f"{format_bytes(n)} {what}" for n, what in ((w.peak_rss, "RSS"), (w.peak_cuda, "CUDA")) if n]
    return "peak " + ", ".join(parts) if parts else ""


def format_worker(w: WorkerState, now: Optional[float] = None, activity: Optional[str] = None) -> str:
    """One rank in a line; ``activity``: what a session's rank does (``session_rank_text``), said
    instead of its status (a rank idle between cells makes no progress, and that is fine)."""
    name = f"rank {w.rank} {w.label}" + (" (main)" if w.is_main else "")
    parts = [f"{name:<19} {activity or w.shown_status:<10}"]
    if w.step is not None:
        if w.total:
            parts.append(f"step {w.step}/{w.total} ({100 * w.step / w.total:3.0f}%)")
        else:
            parts.append(f"step {w.step}")
    if w.epoch is not None:
        parts.append(w.epoch_text)
    parts += [one_line(f"{k} {format_metric(v)}") for k, v in w.metrics.items()]  # (names, values from the run)
    if w.status == "running" and format_rate(w):
        parts.append(f"· {format_rate(w)}")
    silent = w.silent_for(time.time() if now is None else now) if activity is None else None
    if silent is not None:
        parts.append(f"· no progress for {format_duration(silent)}")
    if w.note and w.status == "running":  # the run is quiet: where this rank waits or runs (from its stack)
        parts.append(f"· {one_line(w.note)}")
    if format_memory(w):
        parts.append(f"· {format_memory(w)}")
    return " ".join(parts).rstrip()


def format_run(state: RunState, now: Optional[float] = None, frozen: bool = False) -> str:
    """Several lines: the run's status, one line per rank, the root failure if any; for a
    session's run, what runs now and how the last request ended. ``frozen``: for a text not
    redrawn as time passes (a notebook without widgets), a session's request says since when it
    runs, not for how long."""
    now = time.time() if now is None else now
    end = state.ended_at or now
    elapsed = f" after {end - state.started_at:.1f} s" if state.started_at is not None else ""
    stopping = state.stop_reason is not None and not state.finished
    etas = [e for e in (w.eta() for w in state.workers.values()) if e is not None]
    left = f", ETA {format_duration(max(etas))}" if etas and not state.finished and not stopping else ""
    status = f"stopping ({state.stop_reason})" if stopping else str(state.status)
    if state.waiting_for is not None and not stopping:
        status = f"starting workers ({state.waiting_for})"
    if state.data is not None and state.data.sending and not state.finished:
        status = format_data(state.data)
    named = f" {one_line(state.name)}" if state.name else ""
    where = f"on {','.join(state.devices)} ({state.backend or '?'})"
    session = state.origin == "session"
    if session:  # a session is said by what it does (ready, running a cell), not how long its run has lasted
        cells = f", {state.cells} cell{'' if state.cells == 1 else 's'} run" if state.cells else ""
        lines = [f"Session{named} {state.run_id} {status if stopping else state.session_status} {where}{cells}"]
    else:
        lines = [f"Run{named} {state.run_id} {status}{elapsed}{left} {where}"]
    if state.data is not None and not state.data.sending:
        lines.append("  " + format_data(state.data))
    lines += ["  " + format_worker(state.workers[r], now, session_rank_text(state, r, now, frozen))
              for r in sorted(state.workers)]
    root = state.root_failure
    if root is not None:
        lines.append("  " + one_line(root.headline()))  # (its message is the worker's)
    elif state.finished and state.stop_reason:
        lines.append("  reason: " + one_line(state.stop_reason))
    if state.supervisor_error is not None:
        lines.append(f"  ddp_notebook's supervision of this run failed: {state.supervisor_error}")
    lines += [f"  tracker: {one_line(note)}" for note in state.tracker_notes]
    lines += ["  " + line for line in session_lines(state, now, frozen)]
    return "\n".join(lines)


def format_clock(seconds: float) -> str:
    """A duration as a ticking clock shows it: tenths under a minute (a cell often takes 0.04 s),
    then minutes and hours.

    >>> format_clock(0.04), format_clock(12.34), format_clock(75), format_clock(3720)
    ('0.0 s', '12.3 s', '1 min 15 s', '1 h 2 min')
    """
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60)} s"
    return f"{minutes // 60} h {minutes % 60} min"


def _since(when: float) -> str:
    return "since " + time.strftime("%H:%M:%S", time.localtime(when))


def session_rank_text(state: RunState, rank: int, now: Optional[float] = None, frozen: bool = False) -> Optional[str]:
    """What a session's rank does (``RunState.session_activity``) on its clock: ``in cell 3 for
    2.0 s`` (``frozen``: since when), ``finished cell 3 in 0.5 s, waits``; None for a run that is
    no session's, or has ended while its rank failed or was stopped.

    >>> s = RunState()
    >>> s.apply({"kind": "run_started", "time": 0.0, "devices": ["cpu:0", "cpu:1"], "origin": "session"})
    >>> s.apply({"kind": "request", "time": 1.0, "what": "cell 3", "cell": 3, "ranks": [0, 1]})
    >>> s.apply({"kind": "answered", "time": 1.5, "rank": 1, "status": "done"})
    >>> session_rank_text(s, 0, now=3.0), session_rank_text(s, 1, now=3.0)
    ('in cell 3 for 2.0 s', 'finished cell 3 in 0.5 s, waits')
    """
    activity = state.session_activity(rank)
    request = state.request
    if activity is None or request is None or rank not in request.ranks:
        return activity
    now = time.time() if now is None else now
    how, when = request.answered.get(rank, ("", now))
    if how == "done":
        return f"{activity} in {format_clock(when - request.started)}, waits"
    if how:
        return activity
    return f"{activity} " + (_since(request.started) if frozen else f"for {format_clock(now - request.started)}")


def request_text(record: CellRecord) -> str:
    """How a session's request ended, in one line: ``cell 3 on ranks 0, 1: ok in 0.1 s ([rank 0]
    1, [rank 1] 2)``, or what it raised and how long it took.

    >>> request_text(CellRecord(3, [0, 1], "ok", "x", 0.0, 0.12, what="cell 3", values=["[rank 0] 1"]))
    'cell 3 on ranks 0, 1: ok in 0.1 s ([rank 0] 1)'
    """
    took = format_clock(record.seconds)
    if record.status == "failed" and record.failures:  # said from its data: a message may be stale when read back
        root, code = record.failures[0], f" ({record.first_line()})" if record.code.strip() else ""
        where = f"on every rank ({', '.join(root.same_on)}) the same way" if root.same_on else \
            f"on rank {root.rank} ({root.device})"
        return one_line(f"{record.what}{code} failed {where}: {root.summary()} (after {took})")
    if record.status == "ok":
        values = f" ({', '.join(record.values)})" if record.values else ""
        return one_line(f"{record.what} on {ranks_text(record.ranks)}: ok in {took}{values}")
    if record.status == "ended" or not record.message:  # why it ended is said by the run
        code = f" ({record.first_line()})" if record.code.strip() else ""
        after = f" after {took}" if record.seconds > 0 else ""  # (one the notebook's end cut: when is not known)
        return one_line(f"{record.what}{code} on {ranks_text(record.ranks)}: {record.status}{after}")
    message = " ".join(one_line(record.message).split())
    return f"{message} It took {took}." if message.endswith(".") else f"{message} (after {took})"


def session_lines(state: RunState, now: Optional[float] = None, frozen: bool = False) -> list[str]:
    """What a session's run does, in lines: the request in flight (which ranks have answered,
    whether they were asked to leave it, what stops it, its first line of code), else how the
    last one ended; and the last cell that failed, when it was not the last request ([] for a
    run that is no session's).

    >>> s = RunState()
    >>> s.apply({"kind": "run_started", "time": 0.0, "run_id": "r1", "devices": ["cpu:0", "cpu:1"],
    ...          "origin": "session"})
    >>> s.apply({"kind": "request", "time": 1.0, "what": "cell 3", "cell": 3, "ranks": [0, 1], "first_line": "x = 1"})
    >>> s.apply({"kind": "answered", "time": 1.5, "rank": 1, "status": "done"})
    >>> session_lines(s, now=3.0)
    ['Running cell 3 on ranks 0, 1 for 2.0 s (rank 1 finished; Kernel → Interrupt stops it): x = 1']
    """
    if state.origin != "session":
        return []
    now = time.time() if now is None else now
    request, last, out = state.request, state.last_request, []
    if request is not None and not state.finished:
        notes = []
        for status, said in (("done", "finished"), ("error", "failed"), ("interrupted", "interrupted")):
            rs = sorted(r for r, (how, _) in request.answered.items() if how == status)
            if rs:
                notes.append(f"{ranks_text(rs)} {said}")
        if request.interrupting:
            notes.append("interrupting on every rank")
        elif request.cell is not None:
            notes.append("Stop or session.interrupt() stops it" if request.background
                         else "Kernel → Interrupt stops it")
        clock = _since(request.started) if frozen else f"for {format_clock(now - request.started)}"
        code = f": {request.first_line}" if request.first_line else ""
        out.append(one_line(f"Running {request.what} on {ranks_text(request.ranks)} {clock}"
                            + (f" ({'; '.join(notes)})" if notes else "") + code))
    elif last is not None:
        out.append("Last: " + request_text(last))
    failed = state.failed_cell
    if failed is not None and failed is not last:
        out.append("Last failure: " + request_text(failed))
    return out


def ended_because(state: RunState) -> str:
    """Why a run ended, in one line ('' for a run that succeeded or goes on): its root failure,
    the failure of its supervision, or the reason it was stopped.

    >>> s = RunState()
    >>> s.apply({"kind": "run_started", "time": 0.0, "run_id": "r1", "devices": ["cpu:0"]})
    >>> s.apply({"kind": "stopping", "time": 1.0, "reason": "stopped by the user"})
    >>> s.apply({"kind": "run_finished", "time": 2.0, "status": "stopped"})
    >>> ended_because(s)
    'stopped by the user'
    """
    root = state.root_failure
    if root is not None:
        return one_line(root.headline())
    if state.supervisor_error is not None:
        return one_line(f"ddp_notebook's supervision failed: {state.supervisor_error}")
    return one_line(state.stop_reason) if state.finished and state.stop_reason else ""


def _grouped(states: Sequence[RunState]) -> list[tuple[RunState, bool]]:
    """``states`` (newest first) with each retry right under the run it retries (oldest retry
    first), marked as such; a group sits where its newest member is."""
    by_id = {s.run_id: s for s in states}

    def root(state: RunState) -> str:
        seen = {state.run_id}
        while state.parent in by_id and state.parent not in seen:
            state = by_id[state.parent]
            seen.add(state.run_id)
        return state.run_id

    groups: dict[str, list[RunState]] = {}
    for state in states:
        groups.setdefault(root(state), []).append(state)
    out: list[tuple[RunState, bool]] = []
    for first, members in groups.items():
        out.append((by_id[first], False))
        out += [(m, True) for m in sorted(members, key=lambda m: m.started_at or 0.0) if m.run_id != first]
    return out


CONFIG_CHARS = 60
"""Characters a list of runs gives what sets a run apart (its head and its end when longer)."""


def _apart_keys(states: Sequence[RunState]) -> dict[int, list[str]]:
    """For each run (by ``id``), the config keys that set it apart from the runs of the same
    function listed (``fit``'s runs differ from a loop's in every key: what sets the fits apart
    would be lost among them); a function with one run listed among others: its name.

    >>> fits, loop = [RunState(config={"function": "fit", "lr": lr, "seed": 0}) for lr in (0.1, 0.2)], RunState()
    >>> loop.config = {"function": "train", "steps": 9}
    >>> [v for v in _apart_keys([*fits, loop]).values()]
    [['lr'], ['lr'], ['function']]
    """
    groups: dict[str, list[RunState]] = {}
    for state in states:
        groups.setdefault(repr(state.config.get("function")), []).append(state)
    keys: dict[int, list[str]] = {}
    for group in groups.values():
        differ = [k for k in differing([s.config for s in group]) if k not in ("devices", "function")]
        for state in group:
            keys[id(state)] = differ or (["function"] if len(groups) > 1 and "function" in state.config else [])
    return keys


def _apart(state: RunState, keys: Sequence[str]) -> str:
    """What sets a run apart in a list: its differing config values; a session's cells."""
    if state.origin == "session":
        return f"session, {state.cells} cell{'' if state.cells == 1 else 's'}"
    if state.origin == "preflight":
        return "fit's preflight step"
    shown = [f"{k}={_short(state.config[k], 30)}" for k in keys if k in state.config]
    return _short(", ".join(shown), CONFIG_CHARS)  # (never so wide that why it ended is cut off)


def _short(value: Any, limit: int = 40) -> str:
    """A value in a list's column: its head and its end when long (a lambda's captured values,
    what sets runs apart, are at its end)."""
    text = one_line(format_metric(value) if isinstance(value, float) else str(value))
    return text if len(text) <= limit else text[:limit // 2 - 1] + "…" + text[-(limit - limit // 2):]


def format_runs(states: Sequence[RunState], current: Optional[str] = None, now: Optional[float] = None,
                width: int = 320) -> list[str]:
    """Runs as a table, newest first, a retry under the run it retries: id, name, status,
    devices, start, length, the config that sets each apart from the others listed (a session:
    its cells), its headline metric (``RunState.headline_metric``) and why it ended; ``current``
    marked with ``*``. Each row at most ``width`` characters.

    >>> a, b = RunState(), RunState()
    >>> for s, run_id, lr in ((a, "20261129-174217-5266c4", 0.1), (b, "20261129-174300-aaaaaa", 0.01)):
    ...     s.apply({"kind": "run_started", "time": 0.0, "run_id": run_id, "devices": ["cpu:0"],
    ...              "name": f"lr={lr}", "config": {"lr": lr, "epochs": 3}})
    ...     s.apply({"kind": "run_finished", "time": 15.0, "status": "succeeded"})
    >>> for line in format_runs([b, a], current=a.run_id, now=20.0):
    ...     print(line[:55], "...", line[-13:])
      run                     name     status     devices ...  took  config
      20261129-174300-aaaaaa  lr=0.01  succeeded  cpu:0   ... 15 s  lr=0.01
    * 20261129-174217-5266c4  lr=0.1   succeeded  cpu:0   ...  15 s  lr=0.1
    """
    now = time.time() if now is None else now
    keys = _apart_keys([s for s in states if s.origin not in ("session", "preflight")])
    head = ["", "run", "name", "status", "devices", "started", "took", "config", "metric", "why it ended"]
    rows = []
    for state, retry in _grouped(states):
        devices = ",".join(state.devices)
        if state.started_at is not None:
            start = time.strftime("%Y-%m-%d %H:%M", time.localtime(state.started_at))
            length = format_duration(max(0.0, (state.ended_at or now) - state.started_at))
        else:
            start, length = "?", "?"
        headline = state.headline_metric
        metric = f"{headline[0]} {format_metric(headline[1])}" if headline is not None else ""
        mark = "*" if current == state.run_id else " "
        rows.append([mark, ("↳ " if retry else "") + state.run_id, _short(state.name or "", 30), str(state.status),
                     devices if len(devices) <= 23 else devices[:22] + "…", start, length,
                     _apart(state, keys.get(id(state), [])),
                     metric, ended_because(state)])
    used = [i for i in range(len(head)) if i in (0, 1, 3, 4, 5, 6) or any(r[i] for r in rows)]  # no empty column
    widths = {i: max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i]) for i in used}
    lines = []
    for row in [head, *rows]:
        line = "  ".join(row[i].ljust(widths[i]) if i != used[-1] else row[i] for i in used)
        line = line.replace("  ", " ", 1) if line.startswith(("*", " ")) else line  # the mark takes one column
        line = line.rstrip()
        lines.append(line if len(line) <= width else line[:width - 1] + "…")
    return lines
