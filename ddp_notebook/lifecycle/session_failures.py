"""A session request's failures, as data, and the one error that says them (``CellError``).

A request's outcome (``session_exchange.Gathered``) holds each rank's reply; from it come one
``WorkerFailure`` per rank that raised (the first to raise is the cause: replies carry the time
each error was raised; a rank that left when interrupted, by the user or because another had
raised, did not fail), and per rank left in the request (waiting in a collective that cannot
complete, or in native code that an interrupt cannot stop).
"""
from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any, Optional

from ..core.errors import CellError
from ..core.failures import FailureKind, WorkerFailure, failure_from_error, order_failures, ranks_text
from ..core.state import RunStatus
from .cell_phase import INTERRUPT_GRACE, Gathered
from .session_exchange import loaded_value

__all__ = ["failures_of", "cell_error", "push_hint", "ended_text"]


def failures_of(cell: Optional[int], outcome: Gathered, devices: Sequence[str],
                pids: dict[int, int]) -> tuple[list[WorkerFailure], dict[int, Any], list[int]]:
    """The request's failures (a rank that raised, one left waiting or stuck in the cell), the
    values of the ranks that finished (rank → value), and the ranks that left it when interrupted
    (by the user or a knock-on) while another had raised: they did not fail."""
    def device(rank: int) -> str:
        return devices[rank] if rank < len(devices) else f"rank {rank}"

    now = time.time()
    failures: list[WorkerFailure] = []
    values: dict[int, Any] = {}
    interrupted: list[int] = []
    errors = {r: outcome.replies[r]["error"] for r in outcome.raised}
    first = min(errors, key=lambda r: errors[r].get("time") or now) if errors else None
    for rank, reply in sorted(outcome.replies.items()):
        if reply["op"] != "error":
            values[rank] = loaded_value(rank, reply)
        elif reply.get("interrupted") and first is not None:  # left when asked (by the user or a knock-on)
            interrupted.append(rank)
        else:
            failures.append(failure_from_error(dict(reply.get("error") or {}, rank=rank), device(rank),
                                               pids.get(rank), None))
    where = f"cell {cell}" if cell is not None else "the request"
    left = {r: f"did not leave {where} when interrupted, " + (
        f"waiting in {outcome.places[r]}" if r in outcome.places else
        "given up on when interrupted again" if outcome.given_up else "in native code") for r in outcome.stuck}
    left.update({r: f"waits in {w}" for r, w in outcome.left_waiting.items()})
    for rank, why in sorted(left.items()):
        failures.append(WorkerFailure(rank=rank, device=device(rank), kind=FailureKind.STALL, time=now,
                                      pid=pids.get(rank), message=why, knock_on=first is not None,
                                      stalled_for=outcome.waited.get(rank, INTERRUPT_GRACE)))
    return failures, values, interrupted


def cell_error(cell: Optional[int], failures: list[WorkerFailure], values: dict[int, Any], world_size: int,
               interrupted: Sequence[int] = (), note: str = "", formed_again: bool = False,
               what: str = "the request") -> CellError:
    """The one error a failed request raises, in sentences: the cause first (the first rank to
    raise), what other ranks raised, the ranks left in it or interrupted, then what became of the
    session (it goes on; or ``note``, with ``formed_again``, says it was formed again)."""
    ordered = order_failures(failures, world_size=len(failures) if len(failures) == world_size else 0)
    root = ordered[0]
    # A session's rank raises on its own: a peer's error never reaches it (only a rank left in a
    # collective after one raised is a consequence), so the others raised as well.
    for f in ordered[1:]:
        f.consequence = f.knock_on
    where = f"cell {cell}" if cell is not None else what
    if root.same_on:
        sentences = [f"{where} failed on every rank ({', '.join(root.same_on)}) the same way: {root.summary()}"]
    else:
        sentences = [f"{where} failed on rank {root.rank} ({root.device}): {root.summary()}"]
    also = [f for f in ordered[1:] if not f.knock_on and not root.covers(f)]
    if also:
        sentences.append("Also raised: " + "; ".join(f"rank {f.rank}, {_short(f.summary())}"
                                                     for f in sorted(also, key=lambda f: f.rank)))
    left: dict[str, list[int]] = {}  # ranks left at the same place, for the same reason, said once
    for f in sorted((f for f in ordered[1:] if f.knock_on), key=lambda f: f.rank):
        left.setdefault(f.message, []).append(f.rank)
    for message, ranks in left.items():
        were = "was" if len(ranks) == 1 else "were"
        sentences.append(f"{ranks_text(ranks).capitalize()} {were} left in it: {message}")
    if interrupted:
        sentences.append(f"{ranks_text(sorted(interrupted)).capitalize()}, still in it, "
                         f"{'was' if len(interrupted) == 1 else 'were'} interrupted")
    if formed_again:
        sentences.append(note)
    else:
        sentences.append("The session goes on: its namespaces are kept")
        if note:
            sentences.append(note)
    return CellError(" ".join(_sentence(s) for s in sentences), ordered, values, interrupted)


def _sentence(text: str) -> str:
    text = text.rstrip()
    return text if text.endswith((".", "!", "?", ":")) else text + "."


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def push_hint(replies: dict[int, dict], namespace: dict[str, Any], bound: Collection[str] = ()) -> str:
    """For a NameError of a name the notebook holds: how to send it to the ranks, or, where the
    cell binds that name itself (``bound``) and so takes none from the notebook, that it used
    it first ("" otherwise)."""
    for reply in replies.values():
        name = (reply.get("error") or {}).get("name") if reply["op"] == "error" else None
        if isinstance(name, str) and name in namespace and name.isidentifier():
            if name in bound:
                return (f"The cell uses {name!r} before it defines it: a name the cell binds is the ranks' own, "
                        "never the notebook's")
            return f"{name!r} is the notebook's, not the ranks': session.push({name}={name}) sends it to every rank"
    return ""


def ended_text(run: Any, what: str, extra: str, devices: Sequence[str], on_engines: bool) -> str:
    """Why a session's run ended (``what``: what could not go on), and how to form it again: on
    the same devices, or, where an engine is gone, without it."""
    root = run.root_failure
    if root is not None:
        cause = root.headline()
    elif run.status == RunStatus.STOPPED:
        cause = f"its run {run.id} was stopped ({run.state.stop_reason})"
    elif run.done:
        cause = f"its run {run.id} ended ({run.status})"
    else:
        cause = f"its run {run.id} is ending"
    if on_engines and root is not None and root.kind in (FailureKind.ENGINE, FailureKind.NETWORK):
        how = f"session.restart(without_failed=True) forms it again on the other engines (rank {root.rank}'s is gone)"
    else:
        how = f"session.restart() forms it again on {', '.join(devices)}"
    return f"{what}: {cause}{extra}. {how} (the ranks' namespaces are lost)"
