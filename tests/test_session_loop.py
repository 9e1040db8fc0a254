"""A session's rank (``worker.session_loop``): how it takes the notebook's interrupts, with its
channel recording what it sends (no process: the rank's loop runs on this thread)."""
from __future__ import annotations

import signal
import sys

import pytest

from ddp_notebook.transfer import pickling
from ddp_notebook.worker.channel import Channel
from ddp_notebook.worker.session_loop import _Rank

pytestmark = pytest.mark.unit


class _Recorded(Channel):
    def __init__(self) -> None:
        super().__init__(0)
        self.sent: list[dict] = []

    def _carry(self, event, blob=None):
        self.sent.append(dict(event, blob=blob))


class _Context:
    rank, world_size = 0, 1

    def log(self, **values):
        pass


def _no_ipython(self):
    raise ImportError("IPython")


def _run(rank, cell, code):
    rank.run_cell({"op": "run", "id": cell, "cell": cell, "code": code, "names": pickling.dumps({})})
    reply = rank.channel.sent[-1]
    return pickling.joined(reply, reply["blob"], ("op", "id", "cell", "interrupted"))


def test_an_interrupt_that_comes_before_its_cell_begins_leaves_it_as_it_begins_and_an_old_one_is_ignored(
        monkeypatch):
    # The notebook interrupts the cell it sent; a rank whose main thread had not begun it yet (its
    # request still on its way there) ignored the interrupt and ran the whole cell.
    from ddp_notebook.worker.rank_display import RankDisplay

    monkeypatch.setattr(RankDisplay, "_make_shell", _no_ipython)  # its rank without IPython: text alone, quick
    original = signal.getsignal(signal.SIGINT)
    out, err = sys.stdout, sys.stderr
    rank = _Rank(_Context(), _Recorded(), None)
    signal.signal(signal.SIGINT, rank.on_sigint)
    try:
        rank.interrupt(1)
        reply = _run(rank, 1, "x = 1")
        assert reply["op"] == "error" and reply["interrupted"] and "x" not in rank.namespace, reply
        assert _run(rank, 2, "x = 2")["op"] == "done" and rank.namespace["x"] == 2
        rank.interrupt(2)  # a cell that has ended: nothing to interrupt, now or in the next cell
        assert _run(rank, 3, "y = 3")["op"] == "done" and rank.namespace["y"] == 3
    finally:
        signal.signal(signal.SIGINT, original)
        sys.stdout, sys.stderr = out, err
        rank.output.close()
        rank.display.close()
