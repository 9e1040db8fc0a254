"""A session's cells under the stall watchdog (in this process, real ranks): the time between
cells never counts, and a collective that one rank skips ends the session with the ranks named,
within ``stall_timeout``, never after gloo's 30 minutes; one call forms it again."""
from __future__ import annotations

import time

import pytest

import ddp_notebook
from ddp_notebook.errors import SessionEndedError

from helpers import wait_for

pytestmark = pytest.mark.processes


def test_a_skipped_collective_ends_the_session_named_and_idle_time_does_not_count():
    s = ddp_notebook.session("cpu*2", stall_timeout=2)
    try:
        run = s.current_run
        s.run("x = 1")
        before = sum(1 for e in run.events if e.get("kind") == "progress" and e.get("rank") == 0)
        # Idle for longer than stall_timeout: the ranks say so (progress while every rank waits for
        # a cell), and the session lives on.
        wait_for(run, lambda state: sum(1 for e in run.events if e.get("kind") == "progress"
                                        and e.get("rank") == 0) >= before + 4, timeout=60)
        assert s.run("x + 1") == [2, 2] and s.alive
        started = time.monotonic()
        with pytest.raises(SessionEndedError) as caught:
            s.run("if rank == 0:\n    dist.all_reduce(torch.ones(1))")
        assert time.monotonic() - started < 60  # the watchdog's seconds, not gloo's 30 minutes
        message = str(caught.value)
        assert "stalled" in message and "rank 1 had finished cell 3, rank 0 had not" in message, message
        assert "session.restart()" in message and not s.alive
        s.restart()
        assert s.run("rank") == [0, 1] and s.run("'x' in globals()") == [False, False]
    finally:
        s.close()
    assert s.current_run.status == "succeeded"


def test_ranks_looping_on_collectives_of_a_subgroup_are_never_judged_left_waiting():
    # Rank 2 is out of the cell at once; rank 0 waits in each all_reduce for a slow rank 1 (idle,
    # at the same line, look after look). When rank 1 finishes, rank 0 is about to: the looks
    # taken before rank 1 left judge nothing.
    s = ddp_notebook.session("cpu*3")
    try:
        code = ("import time\nif 'g01' not in dir():\n    g01 = dist.new_group([0, 1])\nn = 0\nif rank in (0, 1):\n"
                "    t = torch.ones(10)\n    for i in range(60):\n        if rank == 1:\n            time.sleep(0.1)\n"
                "        dist.all_reduce(t, group=g01)\n        n += 1\nn")
        assert s.run(code) == [60, 60, 0]
        # Rank 0 waits in recv for rank 1, still in the cell for longer than a skipped collective
        # takes to be named, then works a little after rank 1 has left: no look from before
        # rank 1 left judges it.
        code = ("import time\nt = torch.zeros(1)\nif rank == 0:\n    dist.recv(t, src=1)\n    time.sleep(0.3)\n"
                "elif rank == 1:\n    time.sleep(6)\n    dist.send(torch.ones(1), dst=0)\nt.item()")
        assert s.run(code) == [1.0, 0.0, 0.0]
    finally:
        s.close()
