"""Sessions in a real Jupyter kernel: ranks that stay and run cells (``%ddp_session``, ``%%ddp``,
``ddp_notebook.session``), with what a launch guarantees: errors named by rank, interrupts, a
rank's death, the kernel's death. Each test forms a session of two ranks of its own, in a kernel the
module's tests share (one that kills or restarts it gets it anew), and checks that no rank outlives
the session."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest
from session_kernel import (  # noqa: F401 - fixtures
    SETUP,
    _all_ended,
    _start_kernel,
    kernel_fixture,
    shared_kernel_fixture,
    strip_ansi,
)

from helpers import wait_until

pytestmark = [pytest.mark.kernel, pytest.mark.processes]


def test_state_persists_across_cells_and_output_is_grouped_by_rank(kernel):
    k, _ = kernel
    k.ok("%%ddp\nx = rank * 10")
    printed = k.ok("%%ddp\nprint('x is', x)\ndouble(x) + 1")
    assert "[rank 0] x is 0\n" in printed and "[rank 1] x is 10\n" in printed, printed
    assert "[rank 0] Out: 1\n" in printed and "[rank 1] Out: 21\n" in printed, printed
    printed = k.ok("%%ddp --ranks 1\nx + 5")
    assert printed == "[rank 1] Out: 15\n", printed
    # %ddp_session alone shows the live session; its namespaces stay.
    assert k.ok("%ddp_session").startswith("Session live: 2 ranks on cpu:0, cpu:1 (run ")
    assert "[rank 1] Out: 10\n" in k.ok("%%ddp\nx")


def test_an_all_reduce_across_ranks_in_a_cell(kernel):
    k, _ = kernel
    printed = k.ok("print(_ddp_session.run('t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()'))")
    assert "[[3.0, 3.0], [3.0, 3.0]]" in printed, printed


def test_push_and_pull(kernel):
    k, _ = kernel
    printed = k.ok("_ddp_session.push(w=torch.arange(3.0), lr=0.5)\n"
                   "print(_ddp_session.run('(w * lr + rank).tolist()'), _ddp_session.pull('lr'))")
    assert "[[0.0, 0.5, 1.0], [1.0, 1.5, 2.0]] [0.5, 0.5]" in printed, printed
    # A large tensor is mapped by each rank from shared memory, copy-on-write: a rank's write is its own.
    printed = k.ok("big = torch.arange(4_000_000.0)\n_ddp_session.push(big=big)\n"
                   "print(_ddp_session.run('big[0] = rank + 7; (float(big[0]), float(big[-1]))'), float(big[0]))")
    assert "[(7.0, 3999999.0), (8.0, 3999999.0)] 0.0" in printed, printed


def test_an_interrupt_while_a_session_forms_says_so_in_a_line_and_ends_its_ranks(kernel):
    k, _ = kernel
    # The interrupt lands once the new session's run has started (its ranks forming, saying hello).
    content, _ = k.execute(
        "import signal, threading, time\nbefore = ddp_notebook.last_run()\n"
        "def hit():\n    deadline = time.monotonic() + 120\n"
        "    while ddp_notebook.last_run() is before and time.monotonic() < deadline:\n        time.sleep(0.001)\n"
        "    if ddp_notebook.last_run() is not before:\n"
        "        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)\n"
        "threading.Thread(target=hit, daemon=True).start()\nformed = ddp_notebook.session('cpu*2')")
    assert content["status"] == "error" and content["ename"] == "SessionInterrupted", content
    assert content["traceback"] == ["Forming the session was interrupted: its ranks were ended, no session was "
                                    "formed"], content["traceback"]  # one line, none of the package's frames
    assert "formed" not in k.ok("print(sorted(globals()))")
    k.ok("r = ddp_notebook.last_run()\nfor _ in range(600):\n    if r.done:\n        break\n    time.sleep(0.1)\n"
         "assert r.done and r.status == 'stopped', r.status")  # its ranks ended
    assert "[rank 1] Out: 1\n" in k.ok("%%ddp\nrank")  # the kernel's session goes on
    # A rank chosen by text (as %%ddp takes it) is said to be one.
    content, _ = k.execute("_ddp_session.run('rank', ranks='0')")
    assert content["ename"] == "ArgumentsError" and "a list of ranks (0 to 1), or None for every rank, not '0'" \
        in content["evalue"], content


@pytest.mark.parametrize("line", ["--stop", "--restart"])
def test_an_interrupt_while_a_session_closes_ends_its_ranks_at_once_and_says_so_in_a_line(kernel, line):
    k, seen = kernel
    seen.extend(k.rank_pids())
    # The press lands while the session closes (its ranks told to leave, slowly here): it was raised
    # through this package's frames (or said the run "succeeded: interrupted"), and left the
    # session open one time in two. It ends the ranks at once; --restart then forms no new ones.
    content, printed = k.execute(
        "import signal, threading, time\n_s, _run = _ddp_session, _ddp_session.current_run\n_tell = _s._tell\n"
        "def slow(ranks, message, *rest):\n    if message.get('op') == 'close':\n        time.sleep(2)\n"
        "    return _tell(ranks, message, *rest)\n_s._tell = slow\n"
        "def hit():\n    deadline = time.monotonic() + 60\n"
        "    while not _s._closed and time.monotonic() < deadline:\n        time.sleep(0.001)\n"
        "    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)\n"
        f"threading.Thread(target=hit, daemon=True).start()\n%ddp_session {line}")
    if line == "--stop":
        assert content["status"] == "ok" and printed.startswith("Session closed (run "), (content, printed)
        k.ok("assert '_ddp_session' not in globals()")
    else:
        assert content["status"] == "error" and content["traceback"] == [
            "Forming the session again was interrupted: its ranks were ended, no new ones were formed "
            "(session.restart(), or %ddp_session --restart, forms them)"], content
    k.ok("assert _run.done and not _s.alive and _s.current_run is _run, _run.status")
    if line == "--restart":  # formed when asked again
        k.ok("del _s._tell\n%ddp_session --restart", timeout=180)
        assert "[rank 1] Out: 1\n" in k.ok("%%ddp\nrank")


def test_an_interrupt_while_a_session_forms_again_leaves_it_closed_and_says_so(kernel):
    k, _ = kernel
    # The press lands as the new ranks start (their run begun or not): the session said "no
    # session was formed", yet showed itself forming, with no run, or alive until the ranks ended.
    hits = 0
    for delay in (0.0, 0.05, 0.15):
        content, _ = k.execute(
            "import signal, threading, time\n_s = _ddp_session\n"
            f"def hit():\n    deadline = time.monotonic() + 60\n"
            "    while _s._run is not None and time.monotonic() < deadline:\n        time.sleep(0.0005)\n"
            f"    time.sleep({delay})\n"
            "    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)\n"
            "_t = threading.Thread(target=hit, daemon=True)\n_t.start()\ntry:\n    %ddp_session --restart\n"
            "finally:\n    try:  # (a press after it was formed lands here, never in a later cell)\n"
            "        _t.join()\n        time.sleep(0.05)\n    except KeyboardInterrupt:\n        pass", timeout=180)
        said = content["traceback"] if content["status"] == "error" else []
        if said != ["Forming the session was interrupted: its ranks were ended, no session was formed"]:
            assert said in ([], ["Showing the session was interrupted; it is ready on cpu:0, cpu:1 (%ddp_session "
                                 "shows it)"]), content  # (formed before the press)
        else:
            hits += 1
            k.ok("assert not _s.alive and _s.current_run is not None and _s.current_run.done, repr(_s)\n"
                 "assert _s.state.session_status in ('closed', 'ended') and ' - ' not in repr(_s), repr(_s)")
            content, _ = k.execute("%%ddp\nrank")
            assert content["ename"] == "UsageError" and "the session is closed" in content["evalue"], content
        k.ok("%ddp_session --restart", timeout=180)
        assert "[rank 1] Out: 1\n" in k.ok("%%ddp\nrank")
    assert hits, "no press landed while the ranks formed"


def test_an_interrupt_while_a_formed_session_is_shown_is_one_line_and_the_session_is_current(kernel):
    k, _ = kernel
    # The press lands once the session is formed again, while it is shown (slowly here): it was
    # raised through this package's frames.
    content, _ = k.execute(
        "import signal, threading, time\nimport ddp_notebook.ui.session_magics as _m\n_show, _at = _m.show_session, []\n"
        "def slow(*args):\n    _at.append(1)\n    time.sleep(2)\n    return _show(*args)\n_m.show_session = slow\n"
        "def hit():\n    deadline = time.monotonic() + 120\n"
        "    while not _at and time.monotonic() < deadline:\n        time.sleep(0.001)\n"
        "    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)\n"
        "threading.Thread(target=hit, daemon=True).start()\ntry:\n    %ddp_session --restart\n"
        "finally:\n    _m.show_session = _show", timeout=180)
    assert content["status"] == "error" and content["traceback"] == [
        "Showing the session was interrupted; it is ready on cpu:0, cpu:1 (%ddp_session shows it)"], content
    assert "[rank 1] Out: 1\n" in k.ok("%%ddp\nrank")  # the kernel's session, formed again


def test_an_exception_on_rank_1_names_it_and_the_session_goes_on(kernel):
    k, _ = kernel
    k.ok("%%ddp\nx = rank * 10")
    content, _ = k.execute("%%ddp\nt = torch.zeros(rank + 2, 3)\nif rank == 1:\n"
                           "    raise ValueError(f'bad shape {tuple(t.shape)}')\n7")
    assert content["status"] == "error" and content["ename"] == "CellError", content
    assert content["evalue"].startswith("cell ") and "failed on rank 1 (cpu:1): ValueError: bad shape (3, 3)" \
        in content["evalue"], content["evalue"]
    tb = strip_ansi("\n".join(content["traceback"]))
    assert "raise ValueError(f'bad shape {tuple(t.shape)}')" in tb, tb  # the cell's own line
    assert "on rank 1:" in tb and re.search(r"t\s+= Tensor\[3, 3\] float32 cpu", tb), tb  # the failed rank's locals
    printed = k.ok("%%ddp\nx")  # namespaces kept
    assert "[rank 0] Out: 0\n" in printed and "[rank 1] Out: 10\n" in printed, printed
    debug = k.ok("%ddp_debug")  # the failed cell's locals again, on demand
    assert re.search(r"^Session: cell \d+ \(t = torch.zeros\(rank \+ 2, 3\)\) failed on rank 1 \(cpu:1\): ValueError: bad shape \(3, 3\)", debug, re.M), debug
    assert "on rank 1" in debug and re.search(r"t\s+= Tensor\[3, 3\] float32 cpu", debug), debug
    assert not re.search(r"^\s+(torch|dist|ctx)\s+=", debug, re.M), debug  # modules and the ctx's noise left out


def test_an_interrupt_mid_cell_reaches_every_rank_and_the_session_goes_on(kernel, tmp_path):
    k, _ = kernel
    k.ok("%%ddp\nx = rank * 10")
    msg_id = k.start_in_cell("import time\nfor i in range(6000):\n    time.sleep(0.01)\n'not interrupted'", tmp_path)
    started = time.monotonic()
    k.km.interrupt_kernel()
    content = k.reply_to(msg_id)
    assert content["status"] == "error" and content["ename"] == "SessionInterrupted", content
    assert "interrupted on ranks 0, 1; the session goes on" in content["evalue"], content
    assert time.monotonic() - started < 30  # not the 60 s the cell would have taken
    printed = k.ok("%%ddp\nx + i")  # usable, namespaces kept (i: where each rank was interrupted)
    assert "[rank 0] Out: " in printed and "[rank 1] Out: " in printed, printed


def test_a_rank_killed_ends_the_session_named_and_one_call_forms_it_again(kernel):
    k, seen = kernel
    seen.extend(k.rank_pids())
    killed_run = k.ok("print(_ddp_session.current_run.id)").strip()
    content, _ = k.execute("%%ddp\nimport os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                           "time.sleep(60)")
    assert content["status"] == "error" and content["ename"] == "SessionEndedError", content
    assert "worker 1 (cpu:1) failed: killed by signal SIGKILL" in content["evalue"], content["evalue"]
    assert "session.restart()" in content["evalue"] and "namespaces are lost" in content["evalue"]
    wait_until(lambda: _all_ended(seen), timeout=30)  # the other rank was ended with it
    printed = k.ok("%ddp_session")  # shown, with why and how to form it again: never formed anew unasked
    assert f"Session {killed_run} ended: %ddp_session --restart forms it again on cpu:0, cpu:1" in printed, printed
    # The cell the session ended in is in its run's log, read back from disk.
    printed = k.ok(f"import ddp_notebook\nc = ddp_notebook.Run.load({killed_run!r}).state.cell_records[-1]\n"
                   "print(c.status, c.failures[0].rank, c.first_line())")
    assert printed.strip() == "ended 1 import os, signal, time", printed
    printed = k.ok("%ddp_session --restart")
    assert "namespaces were lost" in printed and "Session ready: 2 ranks" in printed, printed
    printed = k.ok("%%ddp\n'x' in globals(), rank")
    assert "[rank 0] Out: (False, 0)\n" in printed and "[rank 1] Out: (False, 1)\n" in printed, printed
    # A bad device list for the new ranks is refused, and the session is left as it was.
    content, _ = k.execute("%ddp_session --restart cpu:0,cpu:0")
    assert content["status"] == "error" and "cpu:0 is listed 2 times" in content["evalue"], content
    assert "[rank 1] Out: 1\n" in k.ok("%%ddp\nrank")
    # Killed again: formed on the devices that remain.
    seen.extend(k.rank_pids())
    content, _ = k.execute("%%ddp\nimport os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                           "time.sleep(60)")
    assert content["ename"] == "SessionEndedError", content
    printed = k.ok("%ddp_session --restart --without-failed")
    assert "Session ready: 1 rank on cpu:0" in printed, printed
    assert "[rank 0] Out: 1\n" in k.ok("%%ddp\nworld_size")
    seen.extend(k.rank_pids())
    # Killed once more: a retry of its run (Re-form in the view, %ddp_retry) forms the session
    # again, as a run that follows the one that ended; the old run cannot form it twice.
    old = k.ok("print(_ddp_session.current_run.id)").strip()
    content, _ = k.execute("%%ddp\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert content["ename"] == "SessionEndedError", content
    printed = k.ok("old = _ddp_session.current_run\nnew = old.retry(devices=['cpu:0', 'cpu:1'])\n"
                   "print(new is _ddp_session.current_run, new.state.parent == old.id, _ddp_session.alive)")
    assert "True True True\n" in printed and "the ranks' namespaces were lost" in printed, printed
    assert "[rank 1] Out: 2\n" in k.ok("%%ddp\nworld_size")
    printed = k.ok("try:\n    old.retry()\nexcept Exception as e:\n    print(type(e).__name__, e)")
    assert f"DDPNotebookError run {old} was a session's that has been formed again or closed since" in printed, printed
    seen.extend(k.rank_pids())


def test_a_killed_kernel_leaves_no_rank_behind():
    k = _start_kernel()
    try:
        k.ok(SETUP, timeout=180)
        pids = k.rank_pids()
        assert len(pids) == 2 and not _all_ended(pids)
        kernel_pid = int(re.search(r"KERNEL (\d+)", k.ok("import os; print('KERNEL', os.getpid())")).group(1))
        os.kill(kernel_pid, signal.SIGKILL)
        wait_until(lambda: _all_ended(pids), timeout=10)
    finally:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=True)


def test_a_cell_run_without_blocking_frees_the_kernel_prints_into_its_own_cell_and_stops(kernel):
    k, _ = kernel
    msg_id = k.kc.execute("%%ddp --noblock\nimport time\nfor i in range(3):\n    print('tick', i)\n    time.sleep(0.5)\n"
                          "rank + 100")
    content = k.reply_to(msg_id)
    assert content["status"] == "ok", content  # the cell returned while the ranks run it
    # Another cell meanwhile: the notebook is free, and a second request is refused by name.
    busy, _ = k.execute("%%ddp\n1")
    assert busy["status"] == "error" and "the session is still running cell" in busy["evalue"], busy
    # What the ranks print, and their values, come to the cell that ran it, as they arrive (the
    # kernel client reads every message: what came before the last cell was read by it).
    seen = []
    deadline = time.monotonic() + 60
    while "[rank 1] Out: 101\n" not in "".join(seen) and time.monotonic() < deadline:
        try:
            msg = k.kc.get_iopub_msg(timeout=5)
        except Exception:  # noqa: BLE001 - queue.Empty: look again until the deadline
            continue
        if msg["msg_type"] == "stream" and msg["parent_header"].get("msg_id") == msg_id:
            seen.append(msg["content"]["text"])
    text = "".join(seen)
    assert "[rank 0] tick 2\n" in text and "[rank 1] Out: 101\n" in text, text
    assert "[100, 101]" in k.ok("print(_ddp_cell.result(30))")
    # Stopped from code (the view's Stop calls the same): interrupted on every rank, namespaces kept.
    k.ok("%%ddp --noblock\nimport time\nfor i in range(6000):\n    time.sleep(0.01)")
    printed = k.ok("import time\nwhile _ddp_session.state.request is None or not _ddp_session.state.request.background:\n"
                   "    time.sleep(0.05)\nprint(_ddp_session.interrupt())\ntry:\n    _ddp_cell.result(30)\n"
                   "except KeyboardInterrupt as e:\n    print(type(e).__name__, e)")
    assert "True\nSessionInterrupted Cell" in printed and "interrupted on ranks 0, 1" in printed, printed
    assert "[rank 0] Out: True\n" in k.ok("%%ddp\ni > 0")
