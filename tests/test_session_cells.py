"""What a session's cells show and keep, in a real Jupyter kernel with a session of two ranks:
the session line that shows the live session and never drops it unasked, ``--ranks`` ranges and
slices, values shown as the rank formats them (never sent only to be printed; one that cannot
travel shows its text, and the next cell is not disturbed), a rank's own definitions kept,
output without its line end shown while the cell runs, and rich output (``display()``, HTML,
figures) from the ranks, named by rank."""
from __future__ import annotations

import os
import re
import time

import pytest
from session_kernel import kernel_fixture, shared_kernel_fixture, strip_ansi  # noqa: F401 - fixtures

from helpers import wait_until

pytestmark = [pytest.mark.kernel, pytest.mark.processes]


def _printed_until(k, msg_id, done):
    """What the cell ``msg_id`` printed, read as it comes until ``done(text)`` (60 s at most)."""
    seen = []

    def arrived():
        try:
            msg = k.kc.get_iopub_msg(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty: look again
            return False
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            seen.append(msg["content"]["text"])
        return done("".join(seen))

    wait_until(arrived, timeout=60)
    return "".join(seen)


def _text(shown):
    return strip_ansi("".join(part for kind, part in shown if kind == "stream"))


def test_the_session_line_shows_the_live_session_and_ranks_take_ranges_and_slices(kernel):
    k, _ = kernel
    k.ok("%%ddp\nx = rank * 10")
    for line in ("%ddp_session", "%ddp_session cpu*2", "%ddp_session cpu:0,cpu:1"):
        assert "Session live: 2 ranks on cpu:0, cpu:1" in k.ok(line)
    content, _ = k.execute("%ddp_session cpu*3")  # new ranks would lose the namespaces: refused, named
    assert content["status"] == "error" and content["ename"] == "UsageError", content
    assert "a session lives on cpu:0, cpu:1" in content["evalue"], content
    assert "%ddp_session --restart cpu*3" in content["evalue"] and "--stop" in content["evalue"], content
    assert "[rank 0] Out: 0\n[rank 1] Out: 10\n" in k.ok("%%ddp\nx")  # kept
    assert _text(k.shown("%%ddp --ranks 0-1\nrank")) == "[rank 0] Out: 0\n[rank 1] Out: 1\n"
    assert _text(k.shown("%%ddp --ranks 1:\nrank")) == "[rank 1] Out: 1\n"
    assert _text(k.shown("%%ddp --ranks ::2\nrank")) == "[rank 0] Out: 0\n"
    assert _text(k.shown("%%ddp --ranks -1:\nrank")) == "[rank 1] Out: 1\n"  # from the end: a value, not an option
    for bad, said in (("1-0", "ends before it starts"), ("0-x", "is not a choice of ranks"),
                      ("5:", "--ranks 5: chooses no rank of this session"),
                      ("0-4", "--ranks 0-4: 2 to 4 are not ranks of this session (its ranks are 0 to 1)"),
                      ("3", "--ranks 3: 3 is not a rank of this session"),
                      ("9" * 20, f"--ranks {'9' * 20}: {'9' * 20} is not a rank of this session"),
                      ("0,3,1-99999999999", "3, 2 to 99999999999 are not ranks of this session")):
        content, _ = k.execute(f"%%ddp --ranks {bad}\nrank")
        assert content["status"] == "error" and content["ename"] == "UsageError", (bad, content)
        assert said in content["evalue"], (bad, content)
    # A cell run without blocking: its notice is a line of its own, before anything the ranks print.
    text = _text(k.shown("%%ddp --noblock\nprint('first')"))
    assert text.startswith("Cell ") and "_ddp_cell.result() waits for it.\n" in text, text
    k.ok("_ddp_cell.result(60)")


def test_a_session_shown_again_and_again_keeps_two_live_views_not_one_per_time(kernel):
    # Each %ddp_session --restart shows the session: the run it is formed on follows in that view
    # and the one before, not in every view shown since the first (a thread each, and each event
    # drawn by all of them: --restart took 0.2 s at first and 1 s after 15).
    k, seen = kernel
    for _ in range(6):
        k.ok("%ddp_session --restart", timeout=180)
    seen.extend(k.rank_pids())
    count = ("import threading, time\nfor _ in range(600):\n"
             "    names = [t.name for t in threading.enumerate()]\n"
             "    views, displays = names.count('ddp-panel'), names.count('ddp-display')\n"
             "    if views <= 2 and displays <= 2:\n        break\n    time.sleep(0.1)\n"
             "print('live views', views, 'displays', displays)")
    printed = k.ok(count, timeout=120)
    assert re.search(r"live views [0-2] displays [0-2]\n", printed), printed


def test_values_are_shown_as_the_ranks_format_them_and_the_ranks_own_definitions_are_kept(kernel):
    k, _ = kernel
    # Shown as the rank formats it, never pickled to be printed.
    k.ok("%%ddp\nclass Loud:\n    def __reduce__(self):\n        raise RuntimeError('pickled')\n"
         "    def __repr__(self):\n        return f'Loud({rank})'")
    assert _text(k.shown("%%ddp\nLoud()")) == "[rank 0] Out: Loud(0)\n[rank 1] Out: Loud(1)\n"
    text = _text(k.shown("%%ddp\n(i for i in range(3))"))  # cannot be pickled: its repr, as IPython shows it
    assert text.count("Out: <generator object <genexpr> at 0x") == 2, text
    # A DDP-wrapped model cannot be loaded outside its process group: its text, and the next cell is fine.
    text = _text(k.shown("%%ddp\nimport torch.nn as nn\nm = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))\nm"))
    assert "[rank 1] Out: DistributedDataParallel(\n[rank 1]   (module): Linear(in_features=2" in text, text
    printed = k.ok("print(_ddp_session.run('m'))")
    assert printed.startswith("[DistributedDataParallel(\n  (module): Linear"), printed
    content, printed = k.execute("_ddp_session.pull('m')")
    assert content["status"] == "error" and content["ename"] == "CellError", content
    assert "ValueNotSent: 'm' cannot be loaded in the notebook" in content["evalue"], content
    assert "it stays in the ranks' namespaces" in content["evalue"], content
    assert _text(k.shown("%%ddp\nrank + 100")) == "[rank 0] Out: 100\n[rank 1] Out: 101\n"
    printed = k.ok("v = _ddp_session.run('(i for i in range(3))')\nprint(type(v[1]).__name__, v[1].reason)")
    assert printed.startswith("ValueNotSent it cannot be pickled on rank 1: TypeError"), printed
    # A function a cell defined on the ranks is theirs: the notebook's of the same name never replaces it.
    k.ok("def f():\n    return 'notebook'")
    assert "[rank 0] Out: 'rank'" in k.ok("%%ddp\ndef f():\n    return 'rank'\nf()")
    assert "[rank 0] Out: 'rank'\n[rank 1] Out: 'rank'\n" in k.ok("%%ddp\nf()")
    assert "[rank 0] Out: 'notebook-g'" in k.ok("def g():\n    return 'notebook-g'\n") + k.ok("%%ddp\ng()")
    k.ok("def g():\n    return 'notebook-g2'")  # the notebook's own, changed: the ranks take the new one
    assert "[rank 0] Out: 'notebook-g2'" in k.ok("%%ddp\ng()")


def test_output_without_its_line_end_shows_while_the_cell_runs_and_rich_output_comes_named_by_rank(kernel, tmp_path):
    k, _ = kernel
    go = tmp_path / "go"
    msg_id = k.kc.execute(f"%%ddp --ranks 0\nimport os, sys, time\nprint('epoch 1 ', end='', flush=True)\n"
                          f"sys.stderr.write('\\r 50%')\nsys.stderr.flush()\n"
                          f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\nprint('done')")
    # While the cell still runs: nothing held back for a line end.
    _printed_until(k, msg_id, lambda text: "[rank 0] epoch 1 " in text and "[rank 0]  50%" in text)
    assert not os.path.exists(go)
    go.touch()
    assert k.reply_to(msg_id)["status"] == "ok"
    # The run keeps what the rank printed, once (it travelled once, with the cell's answers).
    kept = k.ok("print(repr(_ddp_session.current_run.output(0, 'stdout')))")
    assert kept.count("epoch 1 done\\n") == 1, kept
    shown = k.shown("%%ddp\nfrom IPython.display import HTML\nprint('before')\ndisplay(HTML(f'<b>rank {rank}</b>'))")
    for rank in (0, 1):  # each rank's display after its own text, under a line that names it
        at = next(i for i, (kind, part) in enumerate(shown) if kind == "display_data"
                  and part.get("text/html") == f"<b>rank {rank}</b>")
        assert f"[rank {rank}]\n" in _text(shown[:at]) and f"[rank {rank}] before" in _text(shown[:at]), shown
    shown = k.shown("%%ddp --ranks 1\nimport matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\n"
                    "fig = plt.figure()\nplt.plot([3, 1])\nfig", timeout=180)
    images = [part for kind, part in shown if kind == "display_data" and "image/png" in part]
    assert len(images) >= 2, shown  # plt.show(), and the figure as the cell's value
    assert "[rank 1] Out:\n" in _text(shown), shown
    time.sleep(0)  # (the session goes on)
    assert "[rank 0] Out: 1\n" in k.ok("%%ddp\n1")
    # What goes below Python's streams (a subprocess, a C library) shows in the cell too, in order.
    for trial in range(3):
        shown = _text(k.shown("%%ddp\nimport os, subprocess\nsubprocess.run(['echo', f'child {rank}'])\n"
                              "os.write(1, b'fd ' + str(rank).encode() + b'\\n')\nprint('py', rank)"))
        for rank in (0, 1):
            assert f"[rank {rank}] child {rank}\n" in shown and f"[rank {rank}] fd {rank}\n" in shown, (trial, shown)
            assert f"[rank {rank}] py {rank}\n" in shown, (trial, shown)


def test_what_a_cells_thread_prints_after_the_cell_ended_shows_under_it(kernel):
    k, _ = kernel
    msg_id = k.kc.execute("%%ddp\nimport threading, time\ndef bg():\n    for i in range(6):\n"
                          "        print('bg', i, flush=True)\n        time.sleep(0.25)\n"
                          "threading.Thread(target=bg).start()")
    assert k.reply_to(msg_id)["status"] == "ok"
    # Under the cell that started the thread, each line named.
    text = _printed_until(k, msg_id, lambda text: all(f"[rank {r}] bg 5\n" in text for r in (0, 1)))
    assert all(f"[rank {r}] bg {i}\n" in text for r in (0, 1) for i in range(6)), text
    assert "[rank 1] Out: 1\n" in k.ok("%%ddp\nrank")  # the next cell as ever
    # Rank 1's thread prints while a cell runs on rank 0 alone, which prints without line ends:
    # the cell shows both, each line whole under its rank's name.
    k.ok("%%ddp --ranks 1\nimport threading, time\ndef bg():\n    for i in range(20):\n"
         "        print('bg', i, flush=True)\n        time.sleep(0.1)\nthreading.Thread(target=bg).start()")
    shown = _text(k.shown("%%ddp --ranks 0\nimport time\nfor i in range(15):\n"
                          "    print(i, end=' ', flush=True)\n    time.sleep(0.1)\nprint()"))
    assert "[rank 1] bg " in shown and "[rank 0] 0 " in shown, shown
    assert all(line.startswith(("[rank 0] ", "[rank 1] bg ")) for line in shown.splitlines()), shown
    assert "".join(re.findall(r"\[rank 0\] ([0-9 ]*)", shown)).split() == [str(i) for i in range(15)], shown


def test_a_failed_cell_and_the_cell_a_kernel_restart_cut_are_read_back_after_it(tmp_path):
    from session_kernel import SETUP, _start_kernel

    k = _start_kernel()
    try:
        k.ok(SETUP, timeout=180)
        run_id = k.ok("print(_ddp_session.current_run.id)").strip()
        k.ok("%%ddp\nx = rank + 1")
        content, _ = k.execute("%%ddp\nweights = [rank] * 3\nif rank == 1:\n    raise ValueError(f'bad shape {weights}')")
        assert content["status"] == "error" and content["ename"] == "CellError", content
        k.start_in_cell("import time\ntime.sleep(300)", tmp_path)
        k.km.restart_kernel(now=True)  # the ranks end with the kernel; what the cells did is in the run's log
        k.kc.wait_for_ready(timeout=120)
        k.ok("%load_ext ddp_notebook")
        listed = k.ok("%ddp_runs --all")
        assert any(line.split()[:1] == [run_id] and "session, 3 cells" in line and line.endswith(
            "the notebook process ended (kernel restart or crash) in cell 3") for line in listed.splitlines()), listed
        status = k.ok(f"%ddp_status {run_id}")
        assert status.startswith(f"Session {run_id} ended") and ", 3 cells run" in status.splitlines()[0], status
        assert "Last: cell 3 (open(" in status and "on ranks 0, 1: ended\n" in status, status
        assert "Last failure: cell 2 (weights = [rank] * 3) failed on rank 1 (cpu:1): ValueError: bad shape " \
            "[1, 1, 1]" in status, status
        debug = k.ok(f"%ddp_debug {run_id}")
        assert debug.startswith(f"Run {run_id}, session cell 2 (weights = [rank] * 3):\nDistributed data parallel "
                                "worker 1 (cpu:1) failed: ValueError: bad shape [1, 1, 1]\nLocals in <module> "
                                "(<ddp cell 2>:3) on rank 1:"), debug
        assert re.search(r"\n  weights +\= list of 3\n", debug) and re.search(r"\n  x +\= 2\n", debug), debug
        loaded = k.ok(f"import ddp_notebook\nc = ddp_notebook.Run.load({run_id!r}).state.failed_cell\n"
                      "print(c.cell, c.ranks, c.status, c.failures[0].rank, repr(c.code.splitlines()[0]))")
        assert loaded.strip() == "2 [0, 1] failed 1 'weights = [rank] * 3'", loaded
        cut = k.ok(f"r = ddp_notebook.Run.load({run_id!r}).state.cell_records[-1]\n"
                   "print(r.cell, r.status, r.message, repr(r.code.splitlines()[-1]))")
        assert cut.strip() == ("3 ended the notebook process ended (kernel restart or crash) in cell 3 "
                               "'time.sleep(300)'"), cut
    finally:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=True)


def test_hostile_values_reprs_and_displays_never_hang_nor_end_the_session(kernel):
    k, _ = kernel
    k.ok("%%ddp\nimport time\nclass Slow:\n    def __repr__(self):\n        time.sleep(1000)\n"
         "class Exits:\n    def __repr__(self):\n        raise SystemExit(1)\n"
         "class Raises:\n    def __repr__(self):\n        raise ValueError('no repr')\n"
         "class Stops:\n    def __reduce__(self):\n        raise KeyboardInterrupt\n"
         "class Shows:\n    def _ipython_display_(self):\n        display('shown by itself')\n"
         "class Prints:\n    def _ipython_display_(self):\n        print('printed by itself')\n"
         "slow, exits, stops = Slow(), Exits(), Stops()")
    started = time.monotonic()
    content, _ = k.execute("%%ddp\n1 / 0")  # its report summarizes the namespace: never held up, nor ended
    assert content["ename"] == "CellError" and "ZeroDivisionError" in content["evalue"], content
    assert time.monotonic() - started < 60
    assert _text(k.shown("%%ddp --ranks 0\nRaises()")) == "[rank 0] Out: <Raises object: its repr raised an error>\n"
    assert "Out:" not in _text(k.shown("%%ddp --ranks 0\nShows()"))  # it displayed itself: no Out, as in IPython
    assert _text(k.shown("%%ddp --ranks 0\nPrints()")) == "[rank 0] printed by itself\n"  # what it prints, shown
    printed = k.ok("v = _ddp_session.run('stops')\nprint(type(v[0]).__name__, v[0].reason)")
    assert printed.startswith("ValueNotSent it cannot be pickled on rank 0: KeyboardInterrupt"), printed
    content, _ = k.execute("_ddp_session.pull('stops')")
    assert content["ename"] == "CellError" and content["evalue"].startswith(
        "pull 'stops' failed on every rank (cpu:0, cpu:1) the same way: ValueNotSent: 'stops' cannot be pickled: "
        "KeyboardInterrupt"), content
    content, _ = k.execute("_ddp_session.push(**{'__builtins__': {}})")
    assert content["ename"] == "ArgumentsError" and "'__builtins__'" in content["evalue"], content
    # A parameter of a cell's function named like a notebook module leaves the module the cell's.
    assert "[rank 0] Out: (2,)" in k.ok("import numpy as np") + k.ok(
        "%%ddp\ndef loss(np=None):\n    return 0\nnp.zeros(2).shape")
    shown = k.shown("%%ddp --ranks 1\nfrom IPython.display import JSON\ndisplay(JSON({'a': [1]}))\n"
                    "h = display('first', display_id=True)\nh.update('second')")
    assert any(kind == "display_data" and part.get("application/json") == {"a": [1]} for kind, part in shown), shown
    assert any(kind == "update_display_data" and part.get("text/plain") == "'second'" for kind, part in shown), shown
    assert "[rank 1] Out: 2" in k.ok("%%ddp\nrank + 1")


def test_lone_surrogates_from_the_ranks_are_shown_escaped_and_leave_the_session_whole(kernel):
    # No Jupyter message can carry a lone surrogate: a view holding one failed to send, and went on
    # failing for every later cell.
    k, _ = kernel
    content, _ = k.execute("%%ddp\nraise ValueError('x\\ud800')")
    assert content["ename"] == "CellError" and "ValueError: x\\ud800" in content["evalue"], content
    k.ok("%%ddp --ranks 0\nctx.log(step=1, note='n\\ud800')")
    content, _ = k.execute("%%ddp\nglobals()['v\\ud800'] = 1\n1 / 0")
    assert content["ename"] == "CellError" and "ZeroDivisionError" in content["evalue"], content
    shown = k.shown("%%ddp --ranks 0\nfrom IPython.display import HTML\ndisplay(HTML('a\\ud800b'))")
    assert any(part.get("text/html") == "a\\ud800b" for kind, part in shown if kind == "display_data"), shown
    shown = k.shown("%ddp_session")
    assert any("Last failure: cell 3" in part.get("text/plain", "") for kind, part in shown if kind != "stream"), shown
    printed = k.ok("%%ddp\nrank")
    assert printed == "[rank 0] Out: 0\n[rank 1] Out: 1\n", printed
