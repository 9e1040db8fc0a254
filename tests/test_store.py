"""The loopback TCPStore a run serves for code that sets up its own process group
(``lifecycle.store``): its port is known and listening before it serves, and a rank that meets
there before the store serves waits in the socket's backlog, then meets."""
import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddp_notebook.core.events import SPAWN_STORE_ENV
from ddp_notebook.lifecycle.store import LoopbackStore

pytestmark = pytest.mark.processes


def test_a_client_that_comes_before_the_store_serves_meets_it_once_it_does():
    store = LoopbackStore(2)
    try:
        port = int(store.env["MASTER_PORT"])
        assert store.env["MASTER_ADDR"] == "127.0.0.1" and store.env[SPAWN_STORE_ENV] == f"127.0.0.1:{port}"
        got: list[bytes] = []

        def client() -> None:
            c = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
            c.set("seen", "yes")
            got.append(c.get("seen"))

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive() and not got  # waiting in the backlog: nothing serves yet
        store.serve()
        thread.join(60)
        assert got == [b"yes"]
    finally:
        store.close()


def test_a_store_closed_before_it_served_frees_its_port():
    store = LoopbackStore(2)
    port = int(store.env["MASTER_PORT"])
    store.close()
    store.serve()  # (after close: nothing to serve)
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", port))
