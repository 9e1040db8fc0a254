"""The supervision core against a scripted transport: the same bookkeeping for every backend,
with observations in the orders that real processes produce only now and then (a peer's
knock-on error read before the death that caused it, a batch that holds both)."""
import threading
import time

import pytest

from ddp_notebook.core.state import RunStatus
from ddp_notebook.core.stream import EventStream
from ddp_notebook.executors.base import Exited, Output, Transport, WorkerEvent
from ddp_notebook.lifecycle import supervisor
from ddp_notebook.lifecycle.supervisor import Supervisor, SupervisorOptions


class Scripted(Transport):
    """Ranks that do what the test says: ``script`` is a list of batches ``poll`` returns in turn;
    ``settled`` is what ``settle`` reveals. Interrupted ranks exit by SIGTERM unless told to
    ignore it; killed ranks exit by SIGKILL. Every request is recorded."""

    def __init__(self, script=(), settled=(), ignore_interrupt=(), returns_on_stop=()):
        self.script = [list(batch) for batch in script]
        self.settled = list(settled)
        self.ignore_interrupt = set(ignore_interrupt)
        self.returns_on_stop = set(returns_on_stop)
        self.calls = []
        self.later = []
        self.closed = False

    def poll(self, timeout):
        if self.script:
            return self.script.pop(0)
        out, self.later = self.later, []
        if not out:
            time.sleep(min(timeout, 0.01))
        return out

    def settle(self, silent):
        self.calls.append(("settle", tuple(silent)))
        out, self.settled = self.settled, []
        return out

    def request_stop(self, ranks):
        self.calls.append(("stop", tuple(ranks)))
        for r in ranks:
            if r in self.returns_on_stop:
                self.later += [WorkerEvent(r, {"kind": "done", "time": time.time()}, b"x" if r == 0 else None),
                               Exited(r, code=0)]

    def release(self, ranks):
        self.calls.append(("release", tuple(ranks)))
        self.later += [Exited(r, code=0) for r in ranks]

    def interrupt(self, ranks):
        self.calls.append(("interrupt", tuple(ranks)))
        self.later += [Exited(r, code=-15, signal="SIGTERM") for r in ranks if r not in self.ignore_interrupt]

    def kill(self, ranks):
        self.calls.append(("kill", tuple(ranks)))
        self.later += [Exited(r, code=-9, signal="SIGKILL") for r in ranks]

    def request_stacks(self, ranks):
        self.calls.append(("stacks", tuple(ranks)))

    def abandon(self):
        self.calls.append(("abandon",))

    def close(self):
        self.closed = True


def supervise(transport, n=2, **options):
    stream = EventStream()
    stream.emit({"kind": "run_started", "time": time.time(), "run_id": "r", "devices": [f"cpu:{r}" for r in range(n)]})
    sup = Supervisor(transport, [f"cpu:{r}" for r in range(n)], lambda r: f"/nonexistent/stacks-{r}",
                     SupervisorOptions(**options), stream.emit)
    return sup, stream


def started(rank):
    return [WorkerEvent(rank, {"kind": "started", "time": time.time(), "pid": 100 + rank, "main_thread": 1}),
            WorkerEvent(rank, {"kind": "ready", "time": time.time()})]


def error(rank, message, **extra):
    return WorkerEvent(rank, {"kind": "error", "time": time.time(), "phase": "run", "exc_type": "RuntimeError",
                              "message": message, "traceback": "", **extra})


def test_a_silent_death_seen_after_its_peers_knock_on_error_is_the_cause():
    # rank 0's "Connection reset" arrives first; rank 1's exit by SIGKILL only once things settle
    transport = Scripted(script=[started(0) + started(1), [error(0, "Connection reset by peer")], [Exited(0, code=1)]],
                         settled=[Exited(1, code=-9, signal="SIGKILL", pid=101)])
    sup, stream = supervise(transport)
    outcome = sup.supervise()
    assert outcome.status == RunStatus.FAILED and outcome.error is None
    root = stream.state.root_failure
    assert (root.rank, root.kind, root.signal, root.consequence) == (1, "signal", "SIGKILL", False)
    peer = [f for f in stream.state.failures if f.rank == 0]
    assert len(peer) == 1 and peer[0].consequence and peer[0].message == "Connection reset by peer"
    assert ("settle", (1,)) in transport.calls  # rank 0 had reported: only rank 1 was silent
    assert transport.closed


def test_a_batch_keeps_each_ranks_order_while_a_failure_settles():
    # One poll returns rank 1's death, then rank 0's error and exit: the error must be handled
    # before rank 0's exit, or rank 0 would look like a second silent death.
    transport = Scripted(script=[started(0) + started(1),
                                 [Exited(1, code=-11, signal="SIGSEGV"), error(0, "reset"), Exited(0, code=1)]])
    sup, stream = supervise(transport)
    sup.supervise()
    kinds = [(e["kind"], e.get("rank")) for e in stream.events if e.get("rank") == 0]
    assert kinds.index(("error", 0)) < kinds.index(("exited", 0))
    failures = {f.rank: f for f in stream.state.failures}
    assert failures[1].kind == "signal" and not failures[1].consequence
    assert failures[0].kind == "exception" and failures[0].consequence


def test_the_first_failure_interrupts_peers_and_kills_those_that_ignore_it():
    transport = Scripted(script=[started(0) + started(1), [error(1, "boom"), Exited(1, code=1)]], ignore_interrupt={0})
    sup, stream = supervise(transport, kill_grace=0.05)
    sup.supervise()
    assert ("interrupt", (0,)) in transport.calls and ("kill", (0,)) in transport.calls
    assert stream.state.workers[0].status == "stopped" and stream.state.workers[1].status == "failed"
    assert stream.state.root_failure.rank == 1 and len(stream.state.failures) == 1


def test_a_stop_is_cooperative_then_forced_and_an_interrupted_error_is_a_stop():
    transport = Scripted(script=[started(0) + started(1)], returns_on_stop={0})
    sup, stream = supervise(transport, stop_grace=0.05)
    # rank 1 raises because it was interrupted, and says so
    transport.interrupt = lambda ranks: (transport.calls.append(("interrupt", tuple(ranks))),
                                         transport.later.extend([error(1, "KeyboardInterrupt", interrupted=True),
                                                                 Exited(1, code=1)]))
    threading.Timer(0.05, sup.request_stop, args=(0.05, "stopped by the user")).start()
    outcome = sup.supervise()
    assert outcome.status == RunStatus.STOPPED and outcome.result == b"x"
    assert ("stop", (0, 1)) in transport.calls and ("interrupt", (1,)) in transport.calls
    assert not stream.state.failures
    assert [w.status for w in stream.state.workers.values()] == ["stopped", "stopped"]
    assert stream.state.stop_reason == "stopped by the user"


def test_every_rank_done_releases_them_all():
    done = [WorkerEvent(r, {"kind": "done", "time": time.time()}, b"r" if r == 0 else None) for r in (0, 1)]
    transport = Scripted(script=[started(0) + started(1), [Output(1, "stdout", "hi\n")] + done])
    sup, stream = supervise(transport)
    outcome = sup.supervise()
    assert outcome.status == RunStatus.SUCCEEDED and outcome.result == b"r"
    assert ("release", (0, 1)) in transport.calls
    assert [e["text"] for e in stream.events if e["kind"] == "output"] == ["hi\n"]


def test_a_supervisor_crash_ends_every_rank_and_is_recorded():
    class Broken(Scripted):
        def poll(self, timeout):
            if not self.script:
                raise RuntimeError("bug in a transport")
            return super().poll(timeout)

    transport = Broken(script=[started(0) + started(1)])
    sup, stream = supervise(transport)
    outcome = sup.supervise()
    assert outcome.status == RunStatus.FAILED and outcome.error == "RuntimeError: bug in a transport"
    assert ("abandon",) in transport.calls and transport.closed
    assert stream.state.supervisor_error == "RuntimeError: bug in a transport"
    assert [w.status for w in stream.state.workers.values()] == ["stopped", "stopped"]  # never left "running"


@pytest.mark.parametrize("lost", [None, "engine 1 died"])
def test_an_exit_without_a_report_is_a_signal_an_exit_or_a_lost_engine(lost):
    transport = Scripted(script=[started(0) + started(1), [Exited(1, code=None if lost else 3, lost=lost)]])
    sup, stream = supervise(transport)
    sup.supervise()
    root = stream.state.root_failure
    assert root.rank == 1 and root.kind == ("engine" if lost else "exit")
    assert root.summary().startswith("engine 1 died" if lost else "exited with code 3")


def test_ranks_ended_because_the_notebook_leaves_are_stopped_not_failed():
    transport = Scripted(script=[started(0) + started(1)])
    sup, stream = supervise(transport)
    transport.abandon = lambda: transport.later.extend([Exited(0, code=-9, signal="SIGKILL"),
                                                        Exited(1, code=-9, signal="SIGKILL")])
    threading.Timer(0.05, sup.abandon).start()
    sup.supervise()
    assert not stream.state.failures
    assert [w.status for w in stream.state.workers.values()] == ["stopped", "stopped"]


def test_a_rank_whose_report_waits_later_in_the_batch_is_not_awaited_as_silent():
    transport = Scripted(script=[started(0) + started(1) + started(2),
                                 [Exited(1, code=-9, signal="SIGKILL"), error(0, "reset"), Exited(0, code=1)]])
    sup, stream = supervise(transport, n=3)
    sup.supervise()
    assert ("settle", (2,)) in transport.calls  # rank 0 has reported; only rank 2 is silent


@pytest.mark.parametrize("death", [dict(code=-11, signal="SIGSEGV"), dict(code=3), dict(code=-6, signal="SIGABRT")])
def test_a_crash_seen_only_after_the_peers_report_keeps_its_own_death_and_is_the_cause(death, monkeypatch):
    # rank 1 crashed, but its exit status comes only after rank 0's knock-on error was taken as
    # the cause and rank 1 was interrupted: its own death is no interrupt of ours.
    monkeypatch.setattr(supervisor, "SAME_ERROR_WINDOW", 0.0)  # rank 1's exit comes after the choice
    transport = Scripted(script=[started(0) + started(1), [error(0, "Connection reset by peer"), Exited(0, code=1)],
                                 [Exited(1, pid=101, **death)]], ignore_interrupt={1})
    sup, stream = supervise(transport, kill_grace=30.0)
    sup.supervise()
    root = stream.state.root_failure
    assert root.rank == 1 and root.kind in ("signal", "exit") and not root.consequence
    assert (root.signal, root.exit_code) == (death.get("signal"), death["code"])
    peer = [f for f in stream.state.failures if f.rank == 0]
    assert len(peer) == 1 and peer[0].consequence and len(stream.state.failures) == 2
    assert ("interrupt", (1,)) in transport.calls  # it was interrupted before its death was seen


def test_an_interrupted_rank_that_dies_of_our_signal_is_stopped_not_failed():
    transport = Scripted(script=[started(0) + started(1), [error(0, "boom"), Exited(0, code=1)]])
    sup, stream = supervise(transport)
    sup.supervise()
    assert stream.state.root_failure.rank == 0 and [f.rank for f in stream.state.failures] == [0]
    assert stream.state.workers[1].status == "stopped"
