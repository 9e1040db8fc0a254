"""A real Jupyter kernel with a session of two ranks formed (``%ddp_session cpu*2``), for the
session tests: run cells, read what they printed, check that no rank outlives the kernel."""
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
        printed = self.ok("print('PIDS', *_ddp_session.current_run.pids())")
        return [int(p) for p in re.search(r"PIDS (.*)", printed).group(1).split()]


def _start_kernel():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")  # inherits DDP_NOTEBOOK_RUNS from conftest
    return Kernel(km, kc)


def _all_ended(pids):
    def ended(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    return all(ended(p) for p in pids)


@pytest.fixture(name="kernel")
def kernel_fixture():
    k = _start_kernel()
    seen = []
    try:
        printed = k.ok(SETUP, timeout=180)
        assert "Session ready: 2 ranks on cpu:0, cpu:1" in printed, printed
        yield k, seen
        seen.extend(k.rank_pids())
    finally:
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=True)
    wait_until(lambda: _all_ended(seen), timeout=30)  # no rank outlives its kernel
