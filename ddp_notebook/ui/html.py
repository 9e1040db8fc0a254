"""HTML for notebooks: validation reports and failure cards, as plain strings.

No IPython or widget imports: the panel and the magics put these strings on screen.
"""
from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any, Optional

from ..core.console import one_line, shown
from ..core.failures import CODE_ERRORS, FailureKind, Phase, WorkerFailure, ranks_text, worker_name
from ..core.state import TRAIN_LOSS, VALID_LOSS, CellRecord, epoch_label, train_loss_of, valid_loss_of
from ..core.tracebacks import file_name, name_cells_in
from ..core.validation import ValidationReport
from .text import format_duration, format_metric

__all__ = ["report_html", "failure_card_html", "cell_card_html", "hint_for", "cell_hint", "STATUS_COLORS"]

STATUS_COLORS = {
    "starting": "#6c757d", "running": "#0d6efd", "succeeded": "#198754", "failed": "#dc3545",
    "stopped": "#fd7e14",
    # a session's, and its ranks' (RunState.session_status, session_activity)
    "forming": "#6c757d", "ready": "#198754", "idle": "#198754", "finished": "#0aa2c0", "interrupted": "#fd7e14",
    "ended": "#495057", "closed": "#6c757d",
}
RED = "#dc3545"
ORANGE = "#fd7e14"


def badge(text: str, color: Optional[str] = None) -> str:
    color = color or STATUS_COLORS.get(text, "#6c757d")
    return (f'<span style="background:{color};color:white;padding:1px 7px;border-radius:9px;'
            f'font-size:85%">{escape(text)}</span>')


def report_html(report: ValidationReport) -> str:
    """A validation report as a table: ranks and devices, then every finding (errors in red)."""
    head = badge("valid", STATUS_COLORS["succeeded"]) if report.ok else badge(f"{len(report.errors)} error(s)", RED)
    rows = "".join(
        f"<tr><td>{rank}{' (main)' if rank == 0 else ''}</td><td><code>{d}</code></td></tr>"
        for rank, d in enumerate(report.devices))
    table = (f'<table><tr><th>rank</th><th>device</th></tr>{rows}</table>' if rows else "")
    findings = "".join(
        f'<li style="color:{RED if f.level == "error" else "#b8860b"}"><b>{f.level}</b>: {escape(f.message)}</li>'
        for f in report.findings)
    backend = f" · backend <code>{escape(report.backend)}</code>" if report.backend else ""
    return (f'<div class="ddp-report"><b>Devices</b> <code>{escape(report.spec)}</code> {head}{backend}'
            f'{table}<ul>{findings}</ul></div>')


def hint_for(failure: WorkerFailure, healthy: Sequence[str] = ()) -> str:
    """What to try next, drawn from the kind of failure (never from its message text) and from
    the devices whose workers did not cause it (``healthy``).

    >>> f = WorkerFailure(rank=1, device="cpu:1", kind="exception", time=0.0, exc_type="ValueError")
    >>> hint_for(f, ["cpu:0"])
    'Only worker 1 raised it: retry on cpu:1 alone to reproduce it in one process, or on cpu:0 to go on without it.'
    """
    if failure.same_on and failure.kind == FailureKind.STALL:
        return ("Each worker waits in a collective for another: the ranks called different collectives, or a "
                "different number of them (a rank-dependent branch, uneven batches). Compare their stacks below.")
    if failure.exc_type == "NonFiniteLossError":
        return ("The loss stopped being a number: lower the learning rate, clip the gradients, or look for nan or "
                "inf in this batch of the data; run.retry(resume=True) goes on from the last checkpoint.")
    if failure.same_on:
        return ("Every worker raised this same error: it comes from the code or the data, not from a device. "
                "Fix it and launch again.")
    if failure.kind == FailureKind.RESULT:
        return ("The function's return value could not be pickled: return plain data (numbers, tensors, a "
                "state_dict(), lists and dicts of them), not objects that hold locks, files, sockets or the ctx. "
                "This comes from the code, not from a device.")
    if failure.kind == FailureKind.EXCEPTION and failure.exc_type in CODE_ERRORS:
        return (f"A {failure.exc_type} comes from the code or its data, not from a device: fix it in the function "
                "(the traceback below shows where) and launch again.")
    if failure.kind == FailureKind.SIGNAL and failure.signal == "SIGKILL" or failure.exc_type == "OutOfMemoryError":
        return ("Out of memory is the usual cause: lower the batch size, use a smaller model or fewer workers "
                "per machine, or check what else uses the memory.")
    if failure.kind == FailureKind.SIGNAL:
        return "The process crashed inside native code: the stderr below holds its Python stack."
    if failure.kind == FailureKind.UNPICKLE:
        return ("The worker could not load the function or its arguments: define classes and functions in the "
                "notebook or in a module the workers can import, and pass picklable objects.")
    if failure.kind == FailureKind.INIT:
        return "Setting up the device or the process group failed: check that the device exists and is free."
    if failure.kind == FailureKind.EXIT and failure.phase == Phase.STARTUP:
        return "The worker died while starting: check the environment (imports, installed packages) in its stderr."
    if failure.kind == FailureKind.EXIT:
        return "The worker exited without an exception (os._exit or sys.exit from native code)."
    if failure.kind == FailureKind.ENGINE:
        return ("The engine process died: the cluster's engine log (ipcluster's log directory) holds its last "
                "words. Start a new engine before retrying on as many engines.")
    if failure.kind == FailureKind.NETWORK:
        return ("The worker's host stopped answering (its link, its switch, the host itself): its peers were "
                "released. Retry on the hosts that remain, or bring the host back and retry on as many engines.")
    if failure.kind == FailureKind.SERVER:
        return ("The process that forks the workers was ended (by hand, or by the out-of-memory killer), and "
                "every worker with it: the next run starts a new one.")
    if failure.kind == FailureKind.STALL and failure.message:
        return ("A worker returned while this one still calls collectives: every rank must run the same steps "
                "(as many batches on every rank, or an early stop agreed with an all_reduce, as ctx.batches does).")
    if failure.kind == FailureKind.STALL:
        return ("This worker stopped making progress while its peers waited for it in a collective: its stack "
                "below shows where it is stuck (a deadlock, a slow data loader, a rank-dependent branch).")
    elsewhere = f", or on {healthy[0]} to go on without it" if healthy else ""
    return (f"Only {worker_name(failure.rank)} raised it: retry on {failure.device} alone to reproduce it in one "
            f"process{elsewhere}.")


def locals_html(failure: WorkerFailure) -> str:
    """What the failed rank's variables held: a table for the innermost frame of user code, and
    the frames above it toward the function folded ("" when none was recorded)."""
    if not failure.locals_frames:
        return ""

    def table(names: dict[str, str]) -> str:
        rows = "".join(f"<tr><td><code>{escape(n)}</code></td><td><code>{escape(v)}</code></td></tr>"
                       for n, v in names.items())
        return f'<table class="ddp-locals">{rows}</table>' if rows else "<i>no local variables</i>"

    html = [f"<details open><summary>{escape(failure.locals_title(file_name))}</summary>"
            f"{table(failure.locals)}</details>"]
    for frame in failure.locals_frames[1:]:
        where = f"{frame.get('function')} ({file_name(str(frame.get('file')))}:{frame.get('line')})"
        html.append(f"<details><summary>Locals in {escape(where)}</summary>"
                    f"{table(frame.get('locals') or {})}</details>")
    return "".join(html)


def failure_card_html(root: WorkerFailure, failures: Sequence[WorkerFailure], healthy: Sequence[str] = (),
                      hint: Optional[str] = None) -> str:
    """The red card: headline, hint (``hint_for``'s unless given), traceback and stderr tail
    (collapsible), knock-on failures."""
    hint = hint if hint is not None else hint_for(root, healthy)
    parts = [f'<div class="ddp-failure" style="border-left:4px solid {RED};padding:4px 10px;background:#fff5f5">',
             f'<div style="color:{RED};font-weight:bold">{escape(one_line(root.headline()))}</div>',
             f'<div style="margin:4px 0"><b>Hint:</b> {escape(hint)}</div>']
    if root.traceback:
        parts.append(f"<details open><summary>{escape(root.traceback_title().rstrip(':'))}</summary>"
                     f"<pre>{escape(plain_lines(name_cells_in(root.traceback)))}</pre></details>")
    parts.append(locals_html(root))
    tail = [line for line in root.stderr_tail if line.strip()][-20:]
    if tail:
        parts.append(f"<details><summary>Last lines of its stderr</summary><pre>{escape(chr(10).join(tail))}"
                     "</pre></details>")
    for f in failures:
        if f is not root and not root.covers(f):
            how = "as a consequence" if f.consequence else "as well"
            parts.append(f'<div style="color:#6c757d">{escape(worker_name(f.rank))} ({f.device}) failed {how}: '
                         f"{escape(one_line(f.summary()))}</div>")
    parts.append("</div>")
    return "".join(parts)


def plain_lines(text: str) -> str:
    """Lines a run sent, as a terminal shows them: no escape sequence drawn as a glyph.

    >>> plain_lines("ValueError: \\x1b[31mred\\x1b[0m\\nnext")
    'ValueError: red\\nnext'
    """
    return "\n".join(shown(line) for line in text.split("\n"))


def cell_card_html(cell: CellRecord) -> str:
    """A session's failed cell as a run's failure card (the failed rank's traceback and locals),
    with a session's hint (``cell_hint``)."""
    root = cell.failures[0]
    return failure_card_html(root, cell.failures, hint=cell_hint(root, sorted({f.rank for f in cell.failures})))


def cell_hint(root: WorkerFailure, raised: Sequence[int]) -> str:
    """What to do after a session's cell failed on some ranks: the session goes on, so fix the
    cell and run it again; where only some ranks raised, what they held tells why.

    >>> f = WorkerFailure(rank=1, device="cpu:1", kind="exception", time=0.0, exc_type="ValueError")
    >>> cell_hint(f, [1])[:72]
    'Only rank 1 raised it: compare what it held (its locals below) with the '
    """
    again = "fix the cell and run it again: the session goes on, its namespaces kept."
    if root.same_on:
        return f"Every rank raised this same error: it comes from the cell's code or data; {again}"
    return (f"Only {ranks_text(raised)} raised it: compare what it held (its locals below) with the other ranks' "
            f"(a shape, dtype or device that differs by rank is the usual cause); {again}")


# ---- the epoch table ----------------------------------------------------------------------------

EPOCH_ROWS_SHOWN = 12  # past this, the first epochs and the latest are shown, and how many are not
EPOCH_METRIC_COLUMNS = 6  # metric columns besides the losses (the first ones logged)
NOT_A_COLUMN = {"loss", "samples_per_s", *TRAIN_LOSS, *VALID_LOSS}


def epoch_seconds(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return ""
    return f"{seconds:.1f} s" if seconds < 90 else format_duration(seconds)


def epoch_table_html(records: Sequence[dict[str, Any]], epochs: Optional[int] = None, last: str = "") -> str:
    """The per-epoch table of a run (its main worker's records): epoch, train loss, valid loss,
    each metric logged in the epochs, and each epoch's time.

    ``last`` says what the latest record is when it is not a finished epoch: ``"running"`` (the
    epoch goes on) or ``"cut short"`` (the run ended in it).
    """
    if not records:
        return ""
    names: list[str] = []
    for record in records:
        for name in record.get("metrics") or {}:
            if name not in NOT_A_COLUMN and name not in names and len(names) < EPOCH_METRIC_COLUMNS:
                names.append(name)
    has_valid = any(valid_loss_of(r) is not None for r in records)
    head = ["epoch", "train loss"] + (["valid loss"] if has_valid else []) + names + ["time"]
    cell = 'style="padding:1px 10px;text-align:right;white-space:nowrap"'
    rows = [f"<tr>{''.join(f'<th {cell}>{escape(h)}</th>' for h in head)}</tr>"]
    shown: list[Optional[dict[str, Any]]] = list(records)
    if len(records) > EPOCH_ROWS_SHOWN:
        tail = EPOCH_ROWS_SHOWN - 3
        shown = [*records[:2], None, *records[-tail:]]
    for i, entry in enumerate(shown):
        if entry is None:
            hidden = len(records) - EPOCH_ROWS_SHOWN + 1
            rows.append(f'<tr><td colspan="{len(head)}" style="color:#6c757d;text-align:center">… {hidden} epochs '
                        "not shown …</td></tr>")
            continue
        metrics = entry.get("metrics") or {}
        values = [train_loss_of(entry)] + ([valid_loss_of(entry)] if has_valid else []) + [
            metrics.get(n) for n in names]
        texts = ["" if v is None else format_metric(v) for v in values]
        label = epoch_label(entry.get("epoch"), epochs)
        style = ""
        if i == len(shown) - 1 and last:
            label += f" ({last})"
            style = ' style="font-style:italic;color:#6c757d"'
        cells = [label, *texts, epoch_seconds(entry.get("seconds"))]
        rows.append(f"<tr{style}>{''.join(f'<td {cell}>{escape(c)}</td>' for c in cells)}</tr>")
    return f'<table class="ddp-epochs" style="border-collapse:collapse;font-size:12px">{"".join(rows)}</table>'


# ---- a view that stops receiving updates says so -----------------------------------------------

STALE_AFTER_S = 15


def liveness_html(token: str, tick: int) -> str:
    """What a live view re-renders every second while its run goes on: a style that restarts, on
    each render, a 15 s countdown on the view's controls (the keyframes' name changes with the
    tick, which restarts the animation), and a note revealed when it runs out.

    When the kernel stops sending (restarted, or too busy to run the view's thread), nothing
    renders it again: after ``STALE_AFTER_S`` seconds the note shows and Stop and Retry are dimmed
    and take no clicks, without any script (ipywidgets' HTML keeps ``<style>``).
    """
    name = f"ddp-stale-{token}-{tick % 2}"
    return (f"<style>@keyframes {name}{{to{{opacity:.35;pointer-events:none}}}}"
            f"@keyframes {name}-note{{to{{visibility:visible}}}}"
            f".ddp-view-{token} .ddp-dims{{animation:{name} 1ms linear {STALE_AFTER_S}s forwards}}"
            f".ddp-view-{token} .ddp-stale-note{{visibility:hidden;"
            f"animation:{name}-note 1ms linear {STALE_AFTER_S}s forwards}}</style>"
            f'<span class="ddp-stale-note" data-tick="{tick}" style="color:{ORANGE};white-space:nowrap">'
            f"⚠ no update from the kernel for {STALE_AFTER_S} s (restarted or busy?)"
            "</span>")
