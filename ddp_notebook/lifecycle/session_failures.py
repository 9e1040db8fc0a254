"""A session request's failures, as data, and the one error that says them (``CellError``).

A request's outcome (``session_exchange.Gathered``) holds each rank's reply; from it come one
``WorkerFailure`` per rank that raised (the first to raise is the cause: replies carry the time
each error was raised), per rank interrupted because another had raised (a knock-on), and per
rank left in the request (waiting in a collective that cannot complete, or in native code that
an interrupt cannot stop).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

from ..core.errors import CellError
from ..core.failures import FailureKind, WorkerFailure, failure_from_error, order_failures
from .session_exchange import INTERRUPT_GRACE, Gathered

__all__ = ["failures_of", "cell_error", "push_hint", "ranks_text"]


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 0, 1``, ``no rank``."""
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


def failures_of(cell: Optional[int], outcome: Gathered, devices: Sequence[str],
                pids: dict[int, int]) -> tuple[list[WorkerFailure], dict[int, Any]]:
    """The request's failures (a rank that raised, one interrupted because another had, one
    left waiting or stuck in the cell) and the values of the ranks that finished (rank → value)."""
    def device(rank: int) -> str:
        return devices[rank] if rank < len(devices) else f"rank {rank}"

    now = time.time()
    failures: list[WorkerFailure] = []
    values: dict[int, Any] = {}
    errors = {r: m["error"] for r, m in outcome.replies.items() if m["op"] == "error" and not m.get("interrupted")}
    first = min(errors, key=lambda r: errors[r].get("time") or now) if errors else None
    for rank, reply in sorted(outcome.replies.items()):
        if reply["op"] != "error":
            values[rank] = reply.get("value")
            continue
        failure = failure_from_error(dict(reply.get("error") or {}, rank=rank), device(rank), pids.get(rank), None)
        if reply.get("interrupted") and rank in outcome.knocked_on and first is not None:
            failure.knock_on = True
            failure.message = f"interrupted: rank {first} had raised"
            failure.locals, failure.locals_frames = {}, []
        failures.append(failure)
    where = f"cell {cell}" if cell is not None else "the request"
    left = {r: f"did not leave {where} when interrupted (native code)" for r in outcome.stuck}
    left.update({r: f"waits in {w}" for r, w in outcome.left_waiting.items()})
    for rank, why in sorted(left.items()):
        failures.append(WorkerFailure(rank=rank, device=device(rank), kind=FailureKind.STALL, time=now,
                                      pid=pids.get(rank), message=why, knock_on=first is not None,
                                      stalled_for=outcome.waited.get(rank, INTERRUPT_GRACE)))
    return failures, values


def cell_error(cell: Optional[int], failures: list[WorkerFailure], values: dict[int, Any], world_size: int,
               note: str = "", formed_again: bool = False, what: str = "the request") -> CellError:
    """The one error a failed request raises: the cause named first, the ranks interrupted or
    left in it after, then what became of the session (it goes on; or ``note`` says it was formed
    again)."""
    ordered = order_failures(failures, world_size=len(failures) if len(failures) == world_size else 0)
    root = ordered[0]
    where = f"cell {cell}" if cell is not None else what
    knocked = [f for f in ordered[1:] if f.knock_on]  # interrupted, or left in it, after the root raised
    also = [f.rank for f in ordered[1:] if f not in knocked]
    if root.same_on:
        who = f"every rank ({', '.join(root.same_on)}) the same way"
    else:
        who = f"rank {root.rank} ({root.device})" + (f" and {ranks_text(also)}" if also else "")
    after = note if formed_again else "(the session goes on: its namespaces are kept)"
    if note and not formed_again:
        after += f"; {note}"
    if knocked:
        after = "(" + "; ".join(f"rank {f.rank}, still in it, was interrupted" if f.kind == FailureKind.EXCEPTION
                                else f"rank {f.rank} was left in it: {f.message}" for f in knocked) + ") " + after
    return CellError(f"{where} failed on {who}: {root.summary()} {after}", ordered, values)


def push_hint(replies: dict[int, dict], namespace: dict[str, Any]) -> str:
    """For a NameError of a name the notebook holds: how to send it to the ranks ("" otherwise)."""
    for reply in replies.values():
        name = (reply.get("error") or {}).get("name") if reply["op"] == "error" else None
        if isinstance(name, str) and name in namespace and name.isidentifier():
            return f"{name!r} is the notebook's, not the ranks': session.push({name}={name}) sends it to every rank"
    return ""
