"""A real Jupyter kernel with a session of two ranks formed (``%ddp_session cpu*2``), for the
session tests: run cells, read what they printed, check that no rank outlives its session. The
kernel is shared by a module's tests (starting one and importing torch there took 4-5 s of each
test's 6); each test forms its own session in an emptied namespace."""
from __future__ import annotations

import os
import re

import psutil
import pytest

from helpers import wait_until

SETUP = '''
%load_ext ddp_notebook
import ddp_notebook, torch
def double(v):                       # a notebook function that cells on the ranks use
    return 2 * v
%ddp_session cpu*2
'''


def strip_ansi(text):
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


class Kernel:
    def __init__(self, km, kc):
        self.km, self.kc = km, kc

    def execute(self, code, timeout=120):
        """Run a cell; return (reply content, the text it printed, stream by stream)."""
        printed = []

        def hook(msg):
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook, stop_on_error=False)
        self.stream_messages = len(printed)
        return reply["content"], "".join(printed)

    def shown(self, code, timeout=120):
        """Run a cell that must succeed; return what it showed, in order: ("stream", text) and
        (message type, its MIME bundle) for each display."""
        shown = []

        def hook(msg):
            if msg["msg_type"] == "stream":
                shown.append(("stream", msg["content"]["text"]))
            elif msg["msg_type"] in ("display_data", "execute_result", "update_display_data"):
                shown.append((msg["msg_type"], msg["content"]["data"]))

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook, stop_on_error=False)
        assert reply["content"]["status"] == "ok", (reply["content"], shown)
        return shown

    def ok(self, code, timeout=120):
        content, printed = self.execute(code, timeout)
        assert content["status"] == "ok", (content, printed)
        return printed

    def start_in_cell(self, body, folder):
        """Send a ``%%ddp`` cell running ``body`` and return its msg_id once every rank is in it
        (each rank touches a file in ``folder`` first)."""
        marker = os.path.join(str(folder), "in-cell")
        # stop_on_error=False as execute() sends: with ipykernel's default, the error this cell
        # ends with (an interrupt) makes the kernel abort a request that arrives within the same
        # turn of its loop, which the next cell of a test does on a busy machine 1 time in ~50
        msg_id = self.kc.execute(f"%%ddp\nopen({marker!r} + str(rank), 'w').close()\n{body}",
                                 stop_on_error=False)
        wait_until(lambda: os.path.exists(marker + "0") and os.path.exists(marker + "1"), timeout=60)
        return msg_id

    def reply_to(self, msg_id, timeout=60):
        """The shell reply to the request ``msg_id`` (sent with ``kc.execute``)."""
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=timeout)
        return reply["content"]

    def rank_pids(self):
        """The ranks of the kernel's current session (none when it has none)."""
        printed = self.ok("_s = globals().get('_ddp_session')\n"
                          "print('PIDS', *(_s.current_run.pids() if _s is not None and _s.current_run else ()))")
        return [int(p) for p in re.search(r"PIDS(.*)", printed).group(1).split()]


def _start_kernel():
    from helpers import started_kernel

    km, kc = started_kernel()  # inherits DDP_NOTEBOOK_RUNS from conftest
    return Kernel(km, kc)


def _all_ended(pids):
    def ended(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    return all(ended(p) for p in pids)


# Forms a session anew in a kernel shared by a module's tests: the namespace emptied first, the
# notebook's function defined again.
FORM = SETUP.replace("%load_ext ddp_notebook\n", "%reset -f\n")
# What the kernel keeps between tests: itself, its fork server and multiprocessing's resource tracker.
KEPT = ("import os, psutil\nfrom ddp_notebook.executors.local.executor import standing_processes\n"
        "print('KEPT', os.getpid(), *standing_processes(), *(c.pid for c in psutil.Process().children() "
        "if 'resource_tracker' in ' '.join(c.cmdline())))")


@pytest.fixture(name="shared_kernel", scope="module")
def shared_kernel_fixture(kept_between_tests):
    """A kernel for a module's session tests (``kernel``): started by the first, started again
    after a test that left it unusable; shut down at the module's end, leaving no process."""
    box: dict = {}
    yield box
    _retire(box, kept_between_tests)


def _retire(box, kept):
    k = box.pop("kernel", None)
    pids = box.pop("kept", set())
    box.pop("pid", None)
    if k is None:
        return
    try:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=True)
        wait_until(lambda: _all_ended(pids), timeout=30)
    finally:
        kept.difference_update(pids)


def _keep(k, box, kept):
    """Note what the kernel keeps between tests now (its fork server may have been started anew);
    the kernel's pid."""
    pids = [int(p) for p in re.search(r"KEPT (.*)", k.ok(KEPT)).group(1).split()]
    box.setdefault("pid", pids[0])
    box["kept"] = box.get("kept", set()) | set(pids)
    kept.update(pids)
    return pids[0]


@pytest.fixture(name="kernel")
def kernel_fixture(shared_kernel, kept_between_tests):
    """A kernel with a fresh session of two ranks (``SETUP``), shared with the module's other
    tests: each test forms its own session in an emptied namespace, and its ranks must have
    ended once the session is closed after it (a test that kills, restarts or leaves the kernel
    busy gets it started anew for the next, as does a session that could not be formed or closed)."""
    k = shared_kernel.get("kernel")
    try:
        if k is None or not k.km.is_alive():
            _retire(shared_kernel, kept_between_tests)
            k = shared_kernel["kernel"] = _start_kernel()
            k.ok("%load_ext ddp_notebook", timeout=180)
        printed = k.ok(FORM, timeout=180)
        assert "Session ready: 2 ranks on cpu:0, cpu:1" in printed, printed
        _keep(k, shared_kernel, kept_between_tests)
    except BaseException:
        _retire(shared_kernel, kept_between_tests)
        raise
    seen = []
    usable = False
    try:
        yield k, seen
        k.ok("pass", timeout=30)  # idle: a test that failed mid-cell leaves its cell running
        seen.extend(k.rank_pids())
        content, _ = k.execute("%ddp_session --stop", timeout=60)
        closed = content["status"] == "ok" or "there is no session" in content.get("evalue", "")
        usable = closed and _keep(k, shared_kernel, kept_between_tests) == shared_kernel["pid"]  # not restarted
    finally:
        try:
            if not usable:
                _retire(shared_kernel, kept_between_tests)
        finally:
            wait_until(lambda: _all_ended(seen), timeout=30)  # no rank outlives its session
