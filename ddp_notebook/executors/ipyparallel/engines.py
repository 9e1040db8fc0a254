"""Which ipyparallel engines a run uses, and what they say about themselves.

When one machine is not enough, the same ``launch`` / ``fit`` runs on the engines of an
ipyparallel cluster: one rank per engine, in the order of the view's engine ids::

    import ipyparallel as ipp
    cluster = ipp.Cluster(n=4)             # or a cluster started elsewhere
    rc = cluster.start_and_connect_sync()
    result = ddp_notebook.fit(model, data, engines=rc)          # cpu on every engine
    result = ddp_notebook.fit(model, data, engines=rc[0:2], devices="cuda:0,cuda:1")

The device list pairs with the engines: rank r runs on the r-th engine with the r-th
device (default: ``cpu`` on every engine). Every engine needs ddp_notebook and torch
installed. The engines may be on several hosts, with no shared file system: the ranks meet
in a store rank 0's engine serves (``network``, ``worker.meeting``).
"""
from __future__ import annotations

import reprlib
import time
from collections.abc import Sequence
from typing import Any, Optional

from ...core.errors import EngineSelectionError
from ...worker.engine import describe_engine
from .network_plan import NetworkPlan, plan_network

__all__ = ["Engines", "engines_of", "DESCRIBE_TIMEOUT"]

DESCRIBE_TIMEOUT = 30.0  # seconds an engine may take to answer before validation reports it
BUSY_WAIT = 2.0  # ... and an engine busy with another task for this long is said to be busy
_LOOK = 0.1  # seconds between two looks at the answers (and at the controller's queues)


class Engines:
    """An ipyparallel client and the engine ids a run uses (rank r on ``ids[r]``).

    What each engine said about itself (host, GPUs, versions) is asked once, by validation,
    and kept here for the run's start."""

    def __init__(self, client: Any, ids: Sequence[int]) -> None:
        self.client = client
        self.ids = tuple(int(i) for i in ids)
        self._info: Optional[list[dict[str, Any]]] = None
        self._plans: dict[int, NetworkPlan] = {}

    def describe(self, timeout: float = DESCRIBE_TIMEOUT) -> list[dict[str, Any]]:
        """``describe_engine()`` of every engine, in rank order (``{"error": ...}`` for one
        that cannot answer).

        Every engine gets ``timeout`` seconds (its first answer imports torch: seconds on a busy
        machine), except one that stays busy with another task than this request for
        ``BUSY_WAIT`` seconds: it would answer only after that task, and is said to be busy. Its
        queue holds this request too, and the controller's status lags a task that just ended,
        so only a queue longer than our request, for that long, counts."""
        if self._info is None:
            pending: dict[int, Any] = {}
            for eid in self.ids:
                try:
                    pending[eid] = self.client[eid].apply_async(describe_engine)
                except Exception as e:  # noqa: BLE001 - ipyparallel refuses unknown ids at once
                    pending[eid] = e
            answers: dict[int, dict[str, Any]] = {}
            busy_since: dict[int, float] = {}
            start = time.monotonic()
            while True:
                for eid, ar in pending.items():
                    if eid not in answers:
                        answer = _answer(eid, ar, 0)
                        if answer is not None:
                            answers[eid] = answer
                waiting = [eid for eid in self.ids if eid not in answers]
                now = time.monotonic()
                if not waiting:
                    break
                if now - start >= timeout:
                    for eid in waiting:
                        answers[eid] = {"error": f"engine {eid} did not answer within {timeout:g} s"}
                    break
                # Most engines answer within milliseconds: the controller is asked about queues
                # only for those that did not.
                busy = self._busy(longer_than=1) if now - start >= _LOOK else set()
                for eid in waiting:
                    if eid not in busy:
                        busy_since.pop(eid, None)
                    elif now - busy_since.setdefault(eid, now) >= BUSY_WAIT:
                        answers[eid] = {"error": f"engine {eid} is busy with another task (for {BUSY_WAIT:g} s "
                                                 "while asked to describe itself): let it finish, or choose "
                                                 "other engines"}
                if all(eid in answers for eid in self.ids):
                    break
                _wait_any([pending[eid] for eid in self.ids if eid not in answers], _LOOK)
            self._info = [answers[eid] for eid in self.ids]
        return self._info

    def network(self, n: int) -> NetworkPlan:
        """How the first ``n`` engines reach each other (probed once, by validation)."""
        if n not in self._plans:
            self._plans[n] = plan_network(self, n)
        return self._plans[n]

    def _busy(self, longer_than: int = 0) -> set[int]:
        """The engines whose queue holds more than ``longer_than`` tasks now (asked of the
        controller)."""
        try:
            status = self.client.queue_status(targets=list(self.ids), verbose=False)
            return {int(eid) for eid, s in status.items() if isinstance(s, dict) and s.get("queue", 0) > longer_than}
        except Exception:  # noqa: BLE001 - no answer: every engine gets the full timeout
            return set()

    def subset(self, ranks: Sequence[int]) -> Engines:
        """The engines of the given ranks (for a retry), with what is known of them."""
        out = Engines(self.client, [self.ids[r] for r in ranks])
        if self._info is not None:
            out._info = [self._info[r] for r in ranks]
        return out

    def hosts(self) -> list[str]:
        return [i.get("host", "?") for i in self.describe()]

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"Engines({list(self.ids)})"


def _wait_any(results: list[Any], timeout: float) -> None:
    """Wait until one of ``results`` (ipyparallel AsyncResults) is ready, at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not any(getattr(ar, "ready", lambda: True)() for ar in results):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        results[0].wait(min(left, 0.01))


def _answer(eid: int, ar: Any, timeout: float) -> Optional[dict[str, Any]]:
    """What engine ``eid`` said (``{"error": ...}`` when it could not say), None: no answer yet."""
    if isinstance(ar, Exception):
        return {"error": f"engine {eid} is not available: {ar}"}
    try:
        return dict(ar.get(timeout=timeout))
    except Exception as e:  # noqa: BLE001 - RemoteError, TimeoutError, EngineError
        ename = getattr(e, "ename", type(e).__name__)
        if ename == "TimeoutError":
            return None
        evalue = getattr(e, "evalue", str(e))
        return {"error": f"engine {eid} could not describe itself ({ename}: {evalue}); is ddp_notebook "
                         "installed in the engine's environment?"}


def engines_of(obj: Any) -> Engines:
    """Engines from an ipyparallel ``Client`` (all its engines), a ``DirectView``
    (``rc[0:2]``, its targets), or an ``Engines``."""
    if isinstance(obj, Engines):
        return obj
    client = getattr(obj, "client", None)
    if client is not None and hasattr(obj, "targets"):  # a view
        targets = obj.targets
        if targets is None or targets == "all":
            ids = list(client.ids)
        elif isinstance(targets, int):
            ids = [targets]
        else:
            ids = list(targets)
        return Engines(client, ids)
    if hasattr(obj, "ids") and hasattr(obj, "load_balanced_view"):  # a Client
        return Engines(obj, list(obj.ids))
    raise EngineSelectionError(
        f"engines= takes an ipyparallel Client (every engine) or a DirectView such as rc[0:2], "
        f"not {type(obj).__name__} {reprlib.repr(obj)}")
