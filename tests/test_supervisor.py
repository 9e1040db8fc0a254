"""The supervision core against a scripted transport and a fake clock: the same bookkeeping for
every executor, with observations in the orders that real processes produce only now and then
(a peer's knock-on error read before the death that caused it, a batch that holds both, every
rank raising the same error over several polls, the fork server's death, a hang), each ordering
played deterministically: no test here sleeps, and time passes only when the script says so."""
import os

import pytest

from ddp_notebook.core.state import RunStatus
from ddp_notebook.core.stream import EventStream
from ddp_notebook.executors.base import Exited, Output, Transport, WorkerEvent
from ddp_notebook.lifecycle import supervisor
from ddp_notebook.lifecycle.stall import torch_dir
from ddp_notebook.lifecycle.supervisor import Supervisor, SupervisorOptions


class FakeClock:
    """Time that passes only when something waits (a poll with nothing to return, a sleep)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_800_000_000.0 + self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


class Scripted(Transport):
    """Ranks that do what the test says: ``script`` is a list of batches ``poll`` returns in turn
    (a number instead of a batch: that many seconds pass with nothing to see); ``settled`` is what
    ``settle`` reveals. Interrupted ranks exit by SIGTERM unless told to ignore it; killed ranks
    exit by SIGKILL. ``stacks`` (rank -> faulthandler text, or a callable of the time giving it) is
    what a rank writes into its stack file when asked for its stacks; ``cpu`` (rank -> share of a
    core) how fast its CPU time grows. Every request is recorded, with the time it came."""

    def __init__(self, clock, script=(), settled=(), ignore_interrupt=(), returns_on_stop=(), stacks=None,
                 stack_dir=None, cpu=None):
        self.clock = clock
        self.cpu = cpu  # rank -> share of a core it uses (its CPU seconds grow with the clock); None: unknown
        self.script = [batch if isinstance(batch, (int, float)) else list(batch) for batch in script]
        self.settled = list(settled)
        self.ignore_interrupt = set(ignore_interrupt)
        self.returns_on_stop = set(returns_on_stop)
        self.stacks = stacks or {}
        self.stack_dir = stack_dir
        self.calls = []
        self.later = []
        self.closed = False

    def poll(self, timeout):
        if self.script and not self.later:
            if isinstance(self.script[0], list):
                return self.script.pop(0)
            quiet = min(self.script[0], timeout)  # a poll returns at its timeout, whatever comes later
            self.clock.sleep(quiet)
            self.script[0] -= quiet
            if self.script[0] <= 1e-9:
                self.script.pop(0)
            return []
        out, self.later = self.later, []
        if not out:
            self.clock.sleep(timeout)
        return out

    def _call(self, *call):
        self.calls.append((*call, self.clock.monotonic()))

    def called(self, name):
        return [c[:-1] for c in self.calls if c[0] == name]

    def settle(self, silent):
        self._call("settle", tuple(silent))
        out, self.settled = self.settled, []
        return out

    def request_stop(self, ranks):
        self._call("stop", tuple(ranks))
        for r in ranks:
            if r in self.returns_on_stop:
                self.later += [WorkerEvent(r, {"kind": "done", "time": self.clock.time()}, b"x" if r == 0 else None),
                               Exited(r, code=0)]

    def release(self, ranks):
        self._call("release", tuple(ranks))
        self.later += [Exited(r, code=0) for r in ranks]

    def interrupt(self, ranks):
        self._call("interrupt", tuple(ranks))
        self.later += [Exited(r, code=-15, signal="SIGTERM") for r in ranks if r not in self.ignore_interrupt]

    def kill(self, ranks):
        self._call("kill", tuple(ranks))
        self.later += [Exited(r, code=-9, signal="SIGKILL") for r in ranks]

    def request_flush(self, ranks):
        self._call("flush", tuple(ranks))

    def cpu_seconds(self, ranks):
        self._call("cpu", tuple(ranks))
        return {r: None if self.cpu is None else self.cpu[r] * self.clock.monotonic() for r in ranks}

    def request_stacks(self, ranks):
        self._call("stacks", tuple(ranks))
        for r in ranks:  # as faulthandler would: appended to the rank's stack file at once
            text = self.stacks.get(r, "")
            with open(os.path.join(self.stack_dir, f"stacks-{r}"), "a") as f:
                f.write(text(self.clock.monotonic()) if callable(text) else text)

    def abandon(self):
        self._call("abandon")

    def close(self):
        self.closed = True


def supervise(transport, n=2, stack_dir="/nonexistent", **options):
    stream = EventStream()
    stream.emit({"kind": "run_started", "time": transport.clock.time(), "run_id": "r",
                 "devices": [f"cpu:{r}" for r in range(n)]})
    sup = Supervisor(transport, [f"cpu:{r}" for r in range(n)], lambda r: os.path.join(stack_dir, f"stacks-{r}"),
                     SupervisorOptions(**options), stream.emit, clock=transport.clock)
    return sup, stream


def started(rank, t=0.0):
    return [WorkerEvent(rank, {"kind": "started", "time": t, "pid": 100 + rank, "main_thread": 1}),
            WorkerEvent(rank, {"kind": "ready", "time": t})]


def error(rank, message, t=0.0, **extra):
    return WorkerEvent(rank, {"kind": "error", "time": 1_800_001_000.0 + t, "phase": "run",
                              "exc_type": "RuntimeError", "message": message, "traceback": "", **extra})


def failure_events(stream, rank):
    return [e["failure"] for e in stream.events if e["kind"] == "failure" and e["rank"] == rank]


# ---- a death and its knock-on -------------------------------------------------------------------
def test_a_silent_death_seen_after_its_peers_knock_on_error_is_the_cause():
    # rank 0's "Connection reset" arrives first; rank 1's exit by SIGKILL only once things settle
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), [error(0, "Connection reset by peer")],
                                        [Exited(0, code=1)]],
                         settled=[Exited(1, code=-9, signal="SIGKILL", pid=101)])
    sup, stream = supervise(transport)
    outcome = sup.supervise()
    assert outcome.status == RunStatus.FAILED and outcome.error is None
    root = stream.state.root_failure
    assert (root.rank, root.kind, root.signal, root.consequence) == (1, "signal", "SIGKILL", False)
    peer = [f for f in stream.state.failures if f.rank == 0]
    assert len(peer) == 1 and peer[0].consequence and peer[0].message == "Connection reset by peer"
    assert ("settle", (1,)) in transport.called("settle")  # rank 0 had reported: only rank 1 was silent
    assert len(failure_events(stream, 0)) == 1  # judged once, after the settle: never recorded as the cause
    assert transport.closed


@pytest.mark.parametrize("death", [dict(code=-11, signal="SIGSEGV"), dict(code=3), dict(code=-6, signal="SIGABRT")])
def test_a_death_seen_only_after_the_cause_was_named_becomes_the_cause_and_the_peer_is_recorded_again(death):
    # rank 1 crashed, but its exit status comes 1.5 s later, after the window: rank 0's knock-on
    # error was named the cause and rank 1 interrupted. Its own death is no interrupt of ours.
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), [error(0, "Connection reset by peer"),
                                                                   Exited(0, code=1)],
                                        1.5, [Exited(1, pid=101, **death)]], ignore_interrupt={1})
    sup, stream = supervise(transport, kill_grace=30.0)
    sup.supervise()
    root = stream.state.root_failure
    assert root.rank == 1 and root.kind in ("signal", "exit") and not root.consequence
    assert (root.signal, root.exit_code) == (death.get("signal"), death["code"])
    assert [f.rank for f in stream.state.failures] == [0, 1] and stream.state.failures[0].consequence
    first, again = failure_events(stream, 0)  # the cause at first, then a consequence: one failure, one id
    assert first["id"] == again["id"] and (first["consequence"], again["consequence"]) == (False, True)
    assert transport.called("interrupt") == [("interrupt", (1,))]  # interrupted before its death was seen


def test_a_batch_keeps_each_ranks_order_while_a_failure_settles():
    # One poll returns rank 1's death, then rank 0's error and exit: the error must be handled
    # before rank 0's exit, or rank 0 would look like a second silent death.
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1),
                                        [Exited(1, code=-11, signal="SIGSEGV"), error(0, "reset"), Exited(0, code=1)]])
    sup, stream = supervise(transport)
    sup.supervise()
    kinds = [(e["kind"], e.get("rank")) for e in stream.events if e.get("rank") == 0]
    assert kinds.index(("error", 0)) < kinds.index(("exited", 0))
    failures = {f.rank: f for f in stream.state.failures}
    assert failures[1].kind == "signal" and not failures[1].consequence
    assert failures[0].kind == "exception" and failures[0].consequence


def test_a_rank_whose_report_comes_later_in_the_batch_is_not_awaited_as_silent():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1) + started(2),
                                        [Exited(1, code=-9, signal="SIGKILL"), error(0, "reset"), Exited(0, code=1)]])
    sup, stream = supervise(transport, n=3)
    sup.supervise()
    assert transport.called("settle")[0] == ("settle", (2,))  # rank 0 has reported; only rank 2 is silent


# ---- the same error everywhere ------------------------------------------------------------------
def test_every_rank_raising_the_same_error_within_the_window_is_the_runs_error():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1) + started(2), [error(2, "KeyError: 'x'", t=0.0)],
                                        0.3, [error(0, "KeyError: 'x'", t=0.3)], 0.3,
                                        [error(1, "KeyError: 'x'", t=0.6)]])
    sup, stream = supervise(transport, n=3)
    sup.supervise()
    root = stream.state.root_failure
    assert root.rank == 2 and root.same_on == ["cpu:0", "cpu:1", "cpu:2"]
    assert root.headline().startswith("Every distributed data parallel worker (cpu:0, cpu:1, cpu:2) failed the same")
    assert not any(f.consequence for f in stream.state.failures) and len(stream.state.failures) == 3
    assert transport.called("interrupt") == []  # nobody was left to interrupt


def test_a_different_error_ends_the_window_and_a_rank_past_it_is_not_the_same():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1) + started(2), [error(0, "KeyError: 'x'")],
                                        0.2, [error(1, "ValueError: other", t=0.2)], [Exited(0, code=1)],
                                        [Exited(1, code=1)]])
    sup, stream = supervise(transport, n=3)
    sup.supervise()
    root = stream.state.root_failure
    assert root.rank == 0 and not root.same_on
    assert [f.consequence for f in stream.state.failures] == [False, True]
    interrupted_at = [c for c in transport.calls if c[0] == "interrupt"][0][-1]
    assert interrupted_at - 1000.0 < supervisor.SAME_ERROR_WINDOW  # decided at the different error, not after


def test_a_lone_error_waits_the_window_for_its_peers_then_names_its_rank():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), [error(1, "boom"), Exited(1, code=1)]])
    sup, stream = supervise(transport)
    sup.supervise()
    root = stream.state.root_failure
    assert root.rank == 1 and not root.same_on and stream.state.workers[0].status == "stopped"
    interrupted_at = [c for c in transport.calls if c[0] == "interrupt"][0][-1]
    assert interrupted_at - 1000.0 == pytest.approx(supervisor.SAME_ERROR_WINDOW, abs=0.1)


# ---- the fork server's death --------------------------------------------------------------------
def test_the_fork_servers_death_is_every_ranks_and_said_once():
    from ddp_notebook.core.failures import FailureKind

    clock = FakeClock()
    lost = "the fork server (pid 7) that started it ended (SIGKILL)"
    transport = Scripted(clock, script=[started(0) + started(1),
                                        [Exited(1, code=-9, signal="SIGKILL", lost=lost, lost_kind=FailureKind.SERVER)],
                                        0.01,
                                        [Exited(0, code=-9, signal="SIGKILL", lost=lost, lost_kind=FailureKind.SERVER)]])
    sup, stream = supervise(transport)
    sup.supervise()
    root = stream.state.root_failure
    assert root.kind == "server" and root.same_on == ["cpu:0", "cpu:1"]
    assert root.headline() == ("Every distributed data parallel worker (cpu:0, cpu:1) failed the same way: "
                               f"{lost}, and Linux ended the workers it had forked with it")


def test_another_death_is_not_awaited():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), [Exited(1, code=-9, signal="SIGKILL")]])
    sup, stream = supervise(transport)
    sup.supervise()
    assert stream.state.root_failure.rank == 1
    assert [c for c in transport.calls if c[0] == "interrupt"][0][-1] == 1000.0  # at once: a death is no window


# ---- a hang ---------------------------------------------------------------------------------------
def stack(*frames):
    return "Thread 0x0000000000000001 (most recent call first):\n" + "".join(
        f'  File "{file}", line {line} in {name}\n' for file, line, name in frames) + "\n"


def test_a_stall_names_the_rank_its_peer_waits_for_and_the_ends_it_forces_are_no_failures(tmp_path):
    clock = FakeClock()
    in_collective = stack((os.path.join(torch_dir(), "distributed", "distributed_c10d.py"), 2800, "all_reduce"),
                          ("/work/train.py", 12, "train"))
    in_user_code = stack(("/work/train.py", 30, "slow_step"), ("/work/train.py", 12, "train"))
    progress = [WorkerEvent(r, {"kind": "progress", "time": 0.0, "step": 3}) for r in (0, 1)]
    transport = Scripted(clock, script=[started(0) + started(1) + progress, 30.0],
                         stacks={0: in_collective, 1: in_user_code}, stack_dir=str(tmp_path))
    sup, stream = supervise(transport, stack_dir=str(tmp_path), stall_timeout=5.0)
    sup.supervise()
    root = stream.state.root_failure
    assert (root.rank, root.kind, root.last_step, root.peers_waited) == (1, "stall", 3, True)
    assert [f.rank for f in stream.state.failures] == [1]  # the peer it kept waiting is stopped, not failed
    assert stream.state.workers[0].status == "stopped"
    flushed_at = [c for c in transport.calls if c[0] == "flush"][0][-1]
    assert flushed_at - 1000.0 == pytest.approx(5.0, abs=0.1)  # the strict timeout, on the fake clock
    stalled = [e for e in stream.events if e["kind"] == "stalled"]
    assert len(stalled) == 1 and "slow_step" in stalled[0]["stacks"]["1"]


# ---- stopping, releasing, leaving ---------------------------------------------------------------
def test_the_first_failure_interrupts_peers_and_kills_those_that_ignore_it():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), [error(1, "boom"), Exited(1, code=1)]],
                         ignore_interrupt={0})
    sup, stream = supervise(transport, kill_grace=3.0)
    sup.supervise()
    (_, _, interrupted_at), = [c for c in transport.calls if c[0] == "interrupt"]
    (_, _, killed_at), = [c for c in transport.calls if c[0] == "kill"]
    assert killed_at - interrupted_at == pytest.approx(3.0, abs=0.1)
    assert stream.state.workers[0].status == "stopped" and stream.state.workers[1].status == "failed"
    assert stream.state.root_failure.rank == 1 and len(stream.state.failures) == 1


def test_a_stop_is_cooperative_then_forced_and_an_interrupted_error_is_a_stop():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1)], returns_on_stop={0})
    sup, stream = supervise(transport, stop_grace=10.0)
    # rank 1 raises because it was interrupted, and says so
    transport.interrupt = lambda ranks: (transport._call("interrupt", tuple(ranks)),
                                         transport.later.extend([error(1, "KeyboardInterrupt", interrupted=True),
                                                                 Exited(1, code=1)]))
    sup.request_stop(10.0, "stopped by the user")
    outcome = sup.supervise()
    assert outcome.status == RunStatus.STOPPED and outcome.result == b"x"
    assert transport.called("stop") == [("stop", (0, 1))] and transport.called("interrupt") == [("interrupt", (1,))]
    assert [c for c in transport.calls if c[0] == "interrupt"][0][-1] - 1000.0 == pytest.approx(10.0, abs=0.1)
    assert not stream.state.failures
    assert [w.status for w in stream.state.workers.values()] == ["stopped", "stopped"]
    assert stream.state.stop_reason == "stopped by the user"


def test_every_rank_done_releases_them_all():
    clock = FakeClock()
    done = [WorkerEvent(r, {"kind": "done", "time": 0.0}, b"r" if r == 0 else None) for r in (0, 1)]
    transport = Scripted(clock, script=[started(0) + started(1), [Output(1, "stdout", "hi\n")] + done])
    sup, stream = supervise(transport)
    outcome = sup.supervise()
    assert outcome.status == RunStatus.SUCCEEDED and outcome.result == b"r"
    assert transport.called("release") == [("release", (0, 1))]
    assert [e["text"] for e in stream.events if e["kind"] == "output"] == ["hi\n"]


def test_a_rank_that_returned_and_dies_of_a_signal_while_its_peer_works_fails_the_run_now():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1),
                                        [WorkerEvent(0, {"kind": "done", "time": 0.0}, b"r")], 5.0,
                                        [Exited(0, code=-9, signal="SIGKILL")]])
    sup, stream = supervise(transport)
    began = clock.monotonic()
    outcome = sup.supervise()
    assert outcome.status == RunStatus.FAILED and stream.state.root_failure.rank == 0
    assert stream.state.root_failure.summary().startswith("killed by signal SIGKILL")
    assert transport.called("interrupt") == [("interrupt", (1,))]  # the peer still working is ended
    assert clock.monotonic() - began < 10  # named at once, not when the peer would have returned


def test_a_supervisor_crash_ends_every_rank_and_is_recorded():
    class Broken(Scripted):
        def poll(self, timeout):
            if not self.script:
                raise RuntimeError("bug in a transport")
            return super().poll(timeout)

    clock = FakeClock()
    transport = Broken(clock, script=[started(0) + started(1)])
    sup, stream = supervise(transport)
    outcome = sup.supervise()
    assert outcome.status == RunStatus.FAILED and outcome.error == "RuntimeError: bug in a transport"
    assert transport.called("abandon") and transport.closed
    assert stream.state.supervisor_error == "RuntimeError: bug in a transport"
    assert [w.status for w in stream.state.workers.values()] == ["stopped", "stopped"]  # never left "running"


@pytest.mark.parametrize("lost", [None, "engine 1 died"])
def test_an_exit_without_a_report_is_a_signal_an_exit_or_a_lost_engine(lost):
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), [Exited(1, code=None if lost else 3, lost=lost)]])
    sup, stream = supervise(transport)
    sup.supervise()
    root = stream.state.root_failure
    assert root.rank == 1 and root.kind == ("engine" if lost else "exit")
    assert root.summary().startswith("engine 1 died" if lost else "exited with code 3")


def test_ranks_ended_because_the_notebook_leaves_are_stopped_not_failed():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1)])
    sup, stream = supervise(transport)
    transport.abandon = lambda: transport.later.extend([Exited(0, code=-9, signal="SIGKILL"),
                                                        Exited(1, code=-9, signal="SIGKILL")])
    sup.abandon()
    sup.supervise()
    assert not stream.state.failures
    assert [w.status for w in stream.state.workers.values()] == ["stopped", "stopped"]


def test_an_interrupted_rank_that_dies_of_our_signal_is_stopped_not_failed():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), [error(0, "boom"), Exited(0, code=1)]])
    sup, stream = supervise(transport)
    sup.supervise()
    assert stream.state.root_failure.rank == 0 and [f.rank for f in stream.state.failures] == [0]
    assert stream.state.workers[1].status == "stopped"


def test_a_rank_killed_by_sigbus_names_the_file_of_the_call_that_changed():
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), [Exited(1, code=-7, signal="SIGBUS")]])
    stream = EventStream()
    stream.emit({"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0", "cpu:1"]})
    sup = Supervisor(transport, ["cpu:0", "cpu:1"], lambda r: "/nonexistent", SupervisorOptions(), stream.emit,
                     changed_files=lambda: ["/data/x.npy was cut short, from 4194432 to 0 bytes"], clock=clock)
    sup.supervise()
    assert stream.state.root_failure.summary() == (
        "killed by signal SIGBUS: it read data of the call from a file that changed while the run used it "
        "(/data/x.npy was cut short, from 4194432 to 0 bytes)")


# ---- a quiet run described ------------------------------------------------------------------------
def quiet_events(stream):
    return [(e["time"] - 1_800_000_000.0, e["notes"]) for e in stream.events if e["kind"] == "quiet"]


def progress(rank, step):
    return WorkerEvent(rank, {"kind": "progress", "time": 0.0, "step": step})


def done(rank):
    return WorkerEvent(rank, {"kind": "done", "time": 0.0}, b"r" if rank == 0 else None)


IN_ALL_REDUCE = stack((os.path.join(torch_dir(), "distributed", "distributed_c10d.py"), 2800, "all_reduce"),
                      (os.path.join(torch_dir(), "distributed", "c10d_logger.py"), 83, "wrapper"),
                      ("/work/train.py", 9, "train"))
SPINNING = stack(("/work/train.py", 12, "train"))


@pytest.mark.parametrize("stall_timeout", [None, "auto"])
def test_a_quiet_run_says_who_holds_the_others_up_refreshes_it_and_clears_it_when_progress_resumes(
        tmp_path, stall_timeout):
    from ddp_notebook.lifecycle import watchdog

    clock = FakeClock()
    # Quiet from t=0 for 35 s (rank 1 spins, rank 0 waits in all_reduce), then progress, then the end.
    transport = Scripted(clock, script=[started(0) + started(1) + [progress(0, 2), progress(1, 2)], 35.0,
                                        [progress(0, 3), progress(1, 3)], 3.0, [done(0), done(1)]],
                         stacks={0: IN_ALL_REDUCE, 1: SPINNING}, stack_dir=str(tmp_path), cpu={0: 0.0, 1: 1.0})
    sup, stream = supervise(transport, stack_dir=str(tmp_path), stall_timeout=stall_timeout, stall_floor=300.0)
    notes_seen = []
    stream.subscribe(lambda e: notes_seen.append(stream.state.quiet_note) if e["kind"] == "quiet" else None)
    outcome = sup.supervise()
    assert outcome.status == RunStatus.SUCCEEDED and not stream.state.failures  # described, never judged
    events = quiet_events(stream)
    expected = {"0": "waits in all_reduce (train.py:9) for rank 1", "1": "runs at train.py:12, 100 % CPU"}
    first_at, first = events[0]
    assert first == expected
    # Not before NOTE_AFTER of quiet; the CPU use measured over NOTE_CPU_WINDOW, then the stacks read.
    assert first_at - 1000.0 == pytest.approx(watchdog.NOTE_AFTER + watchdog.NOTE_CPU_WINDOW, abs=0.5)
    assert notes_seen[0] == ("rank 0 waits in all_reduce (train.py:9) for rank 1; "
                             "rank 1 runs at train.py:12, 100 % CPU")
    # Refreshed while the quiet lasts (an unchanged note is not emitted again), then cleared by the
    # progress at 35 s, at once.
    looks = [c[-1] - 1000.0 for c in transport.calls if c[0] == "stacks"]
    assert len(looks) >= 3 and all(b - a == pytest.approx(watchdog.NOTE_REFRESH, abs=0.5)
                                   for a, b in zip(looks, looks[1:]))
    assert events[-1] == (pytest.approx(1035.0, abs=0.1), {})
    assert stream.state.quiet_note is None and all(w.note is None for w in stream.state.workers.values())
    assert [c for c in transport.calls if c[0] == "stacks" and c[-1] > 1035.0] == []  # progress again: no look


def test_a_quiet_note_changes_with_the_ranks_and_names_an_idle_rank_and_one_that_returned(tmp_path):
    clock = FakeClock()
    # rank 1 sleeps (no CPU) at train.py:20 until t=15, then at train.py:12. Rank 2 returned from the
    # function at once: rank 0 waits for it too.
    transport = Scripted(clock, script=[started(0) + started(1) + started(2)
                                        + [WorkerEvent(2, {"kind": "returned", "time": 0.0})], 30.0,
                                        [done(2), done(0), done(1)]],
                         stacks={0: IN_ALL_REDUCE, 1: lambda t: SPINNING if t >= 1015.0 else stack(
                             ("/work/train.py", 20, "train"))},
                         stack_dir=str(tmp_path), cpu={0: 0.0, 1: 0.0, 2: 0.0})
    sup, stream = supervise(transport, n=3, stack_dir=str(tmp_path))
    sup.supervise()
    notes = [n for _, n in quiet_events(stream)]
    assert notes[0] == {"0": "waits in all_reduce (train.py:9) for ranks 1, 2",
                        "1": "is idle at train.py:20, 0 % CPU"}
    assert notes[1]["1"] == "is idle at train.py:12, 0 % CPU"  # the next look: where it is now


def test_a_sessions_ranks_between_requests_are_not_described_as_quiet(tmp_path):
    clock = FakeClock()
    # A session's ranks say hello, then wait for the next cell (for 30 s) in the session's loop.
    waiting = stack(("/usr/lib/python3.11/threading.py", 327, "wait"), ("/work/session_loop.py", 200, "serve"))
    hello = [WorkerEvent(r, {"kind": "session", "op": "hello", "time": 0.0}) for r in (0, 1)]
    transport = Scripted(clock, script=[started(0) + started(1) + hello, 30.0, [done(0), done(1)]],
                         stacks={0: waiting, 1: waiting}, stack_dir=str(tmp_path), cpu={0: 0.0, 1: 0.0})
    sup, stream = supervise(transport, stack_dir=str(tmp_path))
    assert sup.supervise().status == RunStatus.SUCCEEDED
    assert not [notes for _, notes in quiet_events(stream) if notes] and not transport.called("stacks")


def test_a_description_that_fails_is_logged_and_the_run_goes_on(tmp_path, caplog):
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), 25.0, [done(0), done(1)]],
                         stacks={0: IN_ALL_REDUCE, 1: SPINNING}, stack_dir=str(tmp_path))

    def broken(ranks):
        transport._call("cpu", tuple(ranks))
        raise RuntimeError("psutil broke")

    transport.cpu_seconds = broken
    sup, stream = supervise(transport, stack_dir=str(tmp_path))
    outcome = sup.supervise()
    assert outcome.status == RunStatus.SUCCEEDED and outcome.error is None
    assert "the quiet ranks of a run could not be described" in caplog.text
    tries = [c[-1] - 1000.0 for c in transport.calls if c[0] == "cpu"]
    assert len(tries) == 2 and tries[1] - tries[0] >= 10.0  # not retried in a busy loop


def test_engines_without_cpu_times_get_notes_without_cpu_and_a_stop_clears_them(tmp_path):
    clock = FakeClock()
    transport = Scripted(clock, script=[started(0) + started(1), 12.0], stacks={0: IN_ALL_REDUCE, 1: SPINNING},
                         stack_dir=str(tmp_path), returns_on_stop={0, 1})
    sup, stream = supervise(transport, stack_dir=str(tmp_path))
    original = transport.poll

    def poll(timeout):  # once the note is out, the user stops the run
        if stream.state.quiet_note and not sup.stop_reason:
            sup.request_stop(5.0, "stopped by the user")
        return original(timeout)

    transport.poll = poll
    sup.supervise()
    notes = [n for _, n in quiet_events(stream)]
    assert notes == [{"0": "waits in all_reduce (train.py:9) for rank 1", "1": "runs at train.py:12"}, {}]


# ---- a session's request: a phase of the run --------------------------------------------------------
def _session_supervisor(transport, clock, delivered=None, stack_dir="/nonexistent", events=None):
    """A session's supervisor: what it delivers to the session goes to ``delivered`` as (rank, op
    or kind, attachment), and whole to ``events`` as (rank, event)."""
    stream = EventStream()
    stream.emit({"kind": "run_started", "time": clock.time(), "run_id": "r", "devices": ["cpu:0", "cpu:1"]})

    def deliver(rank, event, attached):
        (delivered if delivered is not None else []).append((rank, event.get("op", event["kind"]), attached))
        (events if events is not None else []).append((rank, event))

    sup = Supervisor(transport, ["cpu:0", "cpu:1"], lambda r: os.path.join(stack_dir, f"stacks-{r}"),
                     SupervisorOptions(), stream.emit, deliver=deliver, clock=clock)
    return sup, stream


def _answer(rank, op, request_id=3, **routed):
    return WorkerEvent(rank, {"kind": "session", "op": op, "id": request_id, "time": 0.0, **routed}, b"body")


class SessionRanks(Scripted):
    """Scripted ranks of a session: a ping is answered by the ranks in ``answers`` after
    ``delay`` seconds; ``dies`` (rank -> seconds) ends a rank by SIGKILL that long after the ping;
    an interrupt makes the ranks in ``leave`` answer as interrupted."""

    def __init__(self, clock, answers=(), delay=0.0, dies=None, leave=(), leave_after=0.0, **kw):
        super().__init__(clock, **kw)
        self.answers, self.delay, self.dies, self.leave = set(answers), delay, dies or {}, set(leave)
        self.leave_after = leave_after

    def send(self, ranks, request, body=None, give_up=None):
        self._call("send", tuple(ranks), request["op"])
        later = []
        if request["op"] == "ping":
            later += [self.delay, [WorkerEvent(r, {"kind": "pong", "time": 0.0})
                                   for r in ranks if r in self.answers]]
            for rank, after in self.dies.items():
                later += [after, [Exited(rank, code=-9, signal="SIGKILL")]]
        elif request["op"] == "interrupt":
            later += [self.leave_after, [_answer(r, "error", interrupted=True) for r in ranks if r in self.leave]]
        self.script[:0] = [b if isinstance(b, (int, float)) else list(b) for b in later if b != 0.0]
        return []


def _ends():
    return [[done(0), done(1)]]


def test_a_cells_error_is_believed_once_the_ranks_outside_it_show_they_live_and_its_answers_go_to_the_session():
    clock = FakeClock()
    transport = SessionRanks(clock, answers={1}, delay=0.3, script=[started(0) + started(1) + [_answer(0, "error")]]
                             + _ends())
    delivered = []
    sup, stream = _session_supervisor(transport, clock, delivered)
    phase = sup.begin_cell(3, 1, [0])  # cell 1, on rank 0 only
    outcome = sup.supervise()
    assert phase.outcome.ended.is_set() and not phase.outcome.gone and not phase.outcome.cut
    assert transport.called("send") == [("send", (1,), "ping")]
    # The pong was the supervisor's; the session's thread is woken once the request is judged.
    assert delivered == [(0, "error", b"body"), (-1, "judged", None)]
    assert not [e for e in stream.events if e["kind"] == "session"] and sup.root is None
    assert outcome.status == RunStatus.SUCCEEDED


def test_what_a_sessions_rank_writes_is_the_runs_output_and_goes_to_the_session_named_by_its_cell():
    clock = FakeClock()
    in_cell = WorkerEvent(1, {"kind": "output", "stream": "stdout", "text": "50%", "cell": 1, "time": 0.0})
    between = WorkerEvent(1, {"kind": "output", "stream": "stderr", "text": "late\n", "cell": None, "time": 0.0})
    # What a rank writes below Python's streams (a subprocess) comes on its stdout: the cell it is in
    # is the request's in flight (rank 0's, not rank 1's, which the request is not sent to).
    below = [Output(0, "stdout", "child\n"), Output(1, "stdout", "idle\n")]
    transport = Scripted(clock, script=[started(0) + started(1) + [_answer(0, "hello"), _answer(1, "hello"), in_cell,
                                                                   between] + below] + _ends())
    delivered = []
    sup, stream = _session_supervisor(transport, clock, events=delivered)
    sup.begin_cell(3, 2, [0])
    sup.supervise()
    assert [(e["rank"], e["stream"], e["text"]) for e in stream.events if e["kind"] == "output"] == [
        (1, "stdout", "50%"), (1, "stderr", "late\n"), (0, "stdout", "child\n"), (1, "stdout", "idle\n")]  # all kept
    outputs = [(rank, event["cell"], event["text"]) for rank, event in delivered if event["kind"] == "output"]
    assert outputs == [(1, 1, "50%"), (1, None, "late\n"), (0, 2, "child\n"), (1, None, "idle\n")]  # each to the session


def test_a_rank_outside_the_cell_that_never_answers_and_then_dies_is_the_cause_not_the_peers_error():
    clock = FakeClock()
    transport = SessionRanks(clock, dies={1: 1.5}, script=[started(0) + started(1) + [_answer(0, "error")]])
    sup, _ = _session_supervisor(transport, clock)
    phase = sup.begin_cell(3, 1, [0])
    outcome = sup.supervise()
    assert phase.outcome.ended.is_set() and outcome.status == RunStatus.FAILED
    assert sup.root.rank == 1 and sup.root.signal == "SIGKILL"
    assert sup.begin_cell(4, 2, [0]).outcome.gone  # the run has ended: nothing to judge


def test_the_ranks_still_in_a_cell_a_rank_raised_in_are_interrupted_after_the_knock_on_wait():
    clock = FakeClock()
    transport = SessionRanks(clock, leave={1}, script=[started(0) + started(1) + [_answer(0, "error")], 3.0]
                             + _ends())
    sup, _ = _session_supervisor(transport, clock)
    phase = sup.begin_cell(3, 1, [0, 1])
    sup.supervise()
    sent = [c for c in transport.calls if c[0] == "send"]
    assert [(c[1], c[2]) for c in sent] == [((1,), "interrupt")]
    assert sent[0][-1] - 1000.0 == pytest.approx(0.5, abs=0.06)  # KNOCK_ON_WAIT, on the fake clock
    assert phase.outcome.ended.is_set() and not phase.outcome.cut and not phase.outcome.interrupted


def test_a_cell_interrupted_after_a_rank_raised_still_failed_on_that_rank():
    from ddp_notebook.lifecycle.session_failures import failures_of

    clock = FakeClock()
    transport = SessionRanks(clock, leave={1}, script=[started(0) + started(1) + [_answer(0, "error")], 3.0]
                             + _ends())
    sup, _ = _session_supervisor(transport, clock)
    phase = sup.begin_cell(3, 1, [0, 1])
    phase.interrupt()  # Kernel → Interrupt before the knock-on wait is over
    sup.supervise()
    sent = [c for c in transport.calls if c[0] == "send"]
    assert [(c[1], c[2]) for c in sent] == [((1,), "interrupt")] and phase.outcome.interrupted
    phase.outcome.replies = {0: {"op": "error", "error": {"exc_type": "ValueError", "message": "r0", "time": 1.0}},
                             1: {"op": "error", "interrupted": True, "error": {"exc_type": "KeyboardInterrupt"}}}
    failures, _, interrupted = failures_of(1, phase.outcome, ["cpu:0", "cpu:1"], {})
    assert [(f.rank, f.exc_type) for f in failures] == [(0, "ValueError")] and interrupted == [1]


def test_a_rank_left_waiting_in_a_collective_its_peer_skipped_is_judged_after_the_looks_say_so(tmp_path):
    clock = FakeClock()
    in_cell = stack((os.path.join(torch_dir(), "distributed", "distributed_c10d.py"), 2800, "all_reduce"),
                    ("<ddp cell 1>", 2, "<module>"))
    transport = SessionRanks(clock, script=[started(0) + started(1) + [_answer(1, "done")], 20.0] + _ends(),
                             stacks={0: in_cell}, stack_dir=str(tmp_path), cpu={0: 0.0, 1: 0.0})
    sup, _ = _session_supervisor(transport, clock, stack_dir=str(tmp_path))
    phase = sup.begin_cell(3, 1, [0, 1])
    sup.supervise()
    outcome = phase.outcome
    assert outcome.left_waiting == {0: "all_reduce (<ddp cell 1>:2) while rank 1 had finished the cell"}
    assert outcome.cut and outcome.waited[0] >= 4.0
    assert transport.called("stacks") and not transport.called("send")  # looked at, never interrupted


def test_a_rank_that_does_not_leave_an_interrupted_cell_is_stuck_after_the_grace(tmp_path):
    clock = FakeClock()
    spinning = stack(("<ddp cell 1>", 3, "<module>"))  # a loop in native code: the interrupt never lands
    transport = SessionRanks(clock, leave={1}, script=[started(0) + started(1), 15.0] + _ends(),
                             stacks={0: spinning}, stack_dir=str(tmp_path), cpu={0: 1.0, 1: 0.0})
    sup, _ = _session_supervisor(transport, clock, stack_dir=str(tmp_path))
    phase = sup.begin_cell(3, 1, [0, 1])
    phase.interrupt()  # Kernel → Interrupt in the notebook
    sup.supervise()
    outcome = phase.outcome
    assert outcome.interrupted and outcome.stuck == [0] and outcome.cut and not outcome.left_waiting
    interrupted = [c for c in transport.calls if c[0] == "send"]
    assert [(c[1], c[2]) for c in interrupted] == [((0, 1), "interrupt")]
    assert phase.outcome.ended.is_set() and sup.root is None


def test_a_quick_second_interrupt_does_not_give_up_on_ranks_that_are_leaving_the_cell(tmp_path):
    clock = FakeClock()
    transport = SessionRanks(clock, leave={0, 1}, leave_after=0.3, script=[started(0) + started(1), 3.0] + _ends(),
                             stack_dir=str(tmp_path), cpu={0: 1.0, 1: 1.0})
    sup, _ = _session_supervisor(transport, clock, stack_dir=str(tmp_path))
    phase = sup.begin_cell(3, 1, [0, 1])
    phase.interrupt()
    phase.abandon()  # Kernel → Interrupt twice, 10 ms apart
    sup.supervise()
    assert phase.outcome.ended.is_set() and not phase.outcome.stuck and not phase.outcome.cut
    assert phase.replied == {0: "interrupted", 1: "interrupted"}


def test_ranks_given_up_on_after_a_second_interrupt_are_said_so_not_guessed_in_native_code(tmp_path):
    from ddp_notebook.lifecycle.session_failures import failures_of

    clock = FakeClock()
    transport = SessionRanks(clock, script=[started(0) + started(1), 3.0] + _ends(), stack_dir=str(tmp_path),
                             cpu={0: 1.0, 1: 1.0})
    sup, _ = _session_supervisor(transport, clock, stack_dir=str(tmp_path))
    phase = sup.begin_cell(3, 1, [0, 1])
    phase.interrupt()
    phase.abandon()  # Kernel → Interrupt twice; the ranks never leave
    sup.supervise()
    outcome = phase.outcome
    assert outcome.stuck == [0, 1] and outcome.given_up and outcome.cut
    failures, _, _ = failures_of(1, outcome, ["cpu:0", "cpu:1"], {})
    assert [f.message for f in failures] == ["did not leave cell 1 when interrupted, given up on when interrupted "
                                             "again"] * 2, failures


def test_ranks_that_all_wait_in_a_collective_when_interrupted_are_named_where_within_seconds(tmp_path):
    clock = FakeClock()
    in_recv = stack((os.path.join(torch_dir(), "distributed", "distributed_c10d.py"), 2500, "recv"),
                    ("<ddp cell 1>", 1, "<module>"))
    transport = SessionRanks(clock, script=[started(0) + started(1), 20.0] + _ends(), stacks={0: in_recv, 1: in_recv},
                             stack_dir=str(tmp_path), cpu={0: 0.0, 1: 0.0})
    sup, _ = _session_supervisor(transport, clock, stack_dir=str(tmp_path))
    phase = sup.begin_cell(3, 1, [0, 1])
    phase.interrupt()  # a deadlock: each waits in recv for the other
    sup.supervise()
    outcome = phase.outcome
    assert outcome.left_waiting == {0: "recv (<ddp cell 1>:1)", 1: "recv (<ddp cell 1>:1)"} and not outcome.stuck
    assert outcome.cut and outcome.interrupted


# ---- the first error at once, when the peers sit idle -------------------------------------------
def test_a_lone_error_beside_idle_peers_that_live_is_judged_at_once_not_after_the_window():
    clock = FakeClock()
    transport = SessionRanks(clock, answers={0}, delay=0.005, cpu={0: 0.0, 1: 0.0},
                             script=[started(0) + started(1), [error(1, "boom"), Exited(1, code=1)]])
    sup, stream = supervise(transport)
    sup.supervise()
    assert stream.state.root_failure.rank == 1
    assert transport.called("send") == [("send", (0,), "ping")]  # it showed it lives before the error was judged
    interrupted_at = [c for c in transport.calls if c[0] == "interrupt"][0][-1]
    assert interrupted_at - 1000.0 <= supervisor.IDLE_LOOK + 0.02


def test_a_busy_peer_keeps_the_window_open_and_its_same_error_makes_it_the_runs():
    clock = FakeClock()
    transport = SessionRanks(clock, answers={0, 1}, cpu={0: 1.0, 1: 1.0},
                             script=[started(0) + started(1), [error(1, "KeyError: 'x'")], 0.4,
                                     [error(0, "KeyError: 'x'", t=0.4)]])
    sup, stream = supervise(transport)
    sup.supervise()
    assert stream.state.root_failure.same_on == ["cpu:0", "cpu:1"]
    assert transport.called("send") == []  # computing: about to raise it too, so awaited


def test_an_idle_peer_that_cannot_show_it_lives_is_awaited_and_its_death_is_the_cause():
    # A rank killed closes its sockets before its end shows: the peer's knock-on error comes first.
    clock = FakeClock()
    transport = SessionRanks(clock, answers=(), dies={1: 0.3}, cpu={0: 0.0, 1: 0.0},
                             script=[started(0) + started(1), [error(0, "Connection closed by peer")]])
    sup, stream = supervise(transport)
    sup.supervise()
    root = stream.state.root_failure
    assert root.rank == 1 and root.signal == "SIGKILL", root
    assert [f.consequence for f in stream.state.failures if f.rank == 0] == [True]
