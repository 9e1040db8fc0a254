"""The contract between the supervision core and a backend, after torch elastic's ``PContext``.

A ``Executor`` answers for placement: it validates a device list where the ranks will run, says
where each rank runs, refuses a run that cannot be placed, and starts a ``Transport`` for a run.
A ``Transport`` is one run's ranks as the supervisor sees them: it reports what happened as
observations (``WorkerEvent``, ``Output``, ``Exited``) and takes a handful of requests (stop,
interrupt, kill, release, dump stacks). Everything else (what an event means, which failure is
the cause, deadlines, the stall watchdog) is the supervisor's, written once for every executor.
"""
from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..core.devices import Device, DeviceSpec
from ..core.events import RankConfig
from ..core.failures import FailureKind
from ..core.probes import Probe
from ..core.rundir import RunDir
from ..core.validation import ValidationReport
from ..transfer.loading import Received
from ..transfer.packing import DataTable

__all__ = ["Executor", "Transport", "StartSpec", "WorkerEvent", "Output", "Exited", "Observation", "rank_configs",
           "signal_name"]


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9: how an ``Exited`` names the signal that ended a rank."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class WorkerEvent:
    """An event a rank sent (started, ready, progress, checkpoint, returned, done, error)."""

    rank: int
    event: dict[str, Any]
    result: Optional[Received] = None  # rank 0's return value, on its ``done`` event


@dataclass(frozen=True)
class Output:
    """Text a rank printed."""

    rank: int
    stream: str  # "stdout" or "stderr"
    text: str


@dataclass(frozen=True)
class Exited:
    """A rank ended: its process exited, or its engine call ended (after its outcome, if any)."""

    rank: int
    code: Optional[int] = None  # exit status; negative: the signal that ended it
    signal: Optional[str] = None
    pid: Optional[int] = None
    lost: Optional[str] = None  # the place itself is gone ("engine 1 died"): the rank could not report
    lost_kind: FailureKind = FailureKind.ENGINE  # what ``lost`` is (an engine, or the fork server)


Observation = Union[WorkerEvent, Output, Exited]


@dataclass
class StartSpec:
    """What an executor needs to start a run's ranks: the run directory, the devices, the packed
    call, and the part of every rank's ``RankConfig`` that does not depend on where it runs."""

    directory: RunDir
    devices: list[Device]
    payload: bytes
    config: RankConfig
    threads_per_worker: Optional[int] = None  # None: the cores of the rank's host shared by its ranks
    env: dict[str, str] = field(default_factory=dict)  # the user's, wins over the executor's defaults
    data: Optional[DataTable] = None  # where the payload's shared tensors and arrays are (maps_memory only)


def rank_configs(spec: StartSpec, hosts: Sequence[str], cores: Sequence[int], env: dict[str, str]) -> list[RankConfig]:
    """Every rank's assignment: ``spec.config`` and where the rank runs. Rank r runs on host
    ``hosts[r]``, which has ``cores[r]`` cores: ``local_rank`` is its index among the ranks on that
    host, and those ranks share its cores (``threads``, unless ``spec.threads_per_worker``).
    ``env`` is the executor's environment for the ranks; the user's (``spec.env``) wins over it.

    >>> spec = StartSpec(RunDir("/tmp/r"), [Device("cpu", i) for i in range(3)], b"", {"world_size": 3})
    >>> configs = rank_configs(spec, ["a", "b", "a"], [8, 8, 8], {})
    >>> [(c["local_rank"], c["local_world_size"], c["threads"]) for c in configs]
    [(0, 2, 4), (0, 1, 8), (1, 2, 4)]
    """
    configs: list[RankConfig] = []
    for rank, device in enumerate(spec.devices):
        local = hosts.count(hosts[rank])
        threads = spec.threads_per_worker or max(1, cores[rank] // local)
        rank_env = dict(env, OMP_NUM_THREADS=str(threads))
        rank_env.update(spec.env)
        configs.append({**spec.config, "rank": rank, "device": str(device),
                        "local_rank": hosts[:rank].count(hosts[rank]), "local_world_size": local, "threads": threads,
                        "env": rank_env})
    return configs


class Transport(ABC):
    """One run's ranks, started; driven from the supervisor's thread (``wake`` from any thread)."""

    # The signals ``interrupt`` and ``kill`` end a rank with: an exit by any other signal (or
    # with a code) is the rank's own, even after it was interrupted.
    forced_signals: frozenset[str] = frozenset({"SIGTERM", "SIGKILL"})

    @abstractmethod
    def poll(self, timeout: float) -> list[Observation]:
        """Wait up to ``timeout`` seconds for something to happen; return what did, in order
        (a rank's exit after everything it wrote before dying)."""

    @abstractmethod
    def settle(self, silent: Sequence[int]) -> list[Observation]:
        """Make visible, within a couple of seconds, what has already happened but may not have
        been seen: a rank dying closes its pipes (its peers notice) before its exit is visible.
        ``silent`` are the ranks that have not reported an outcome yet."""

    def wake(self) -> None:
        """Make a ``poll`` in progress return soon (another thread has a request)."""

    def started(self) -> bool:
        """Whether the ranks' processes or calls exist yet (a stop before then needs no grace)."""
        return True

    @abstractmethod
    def request_stop(self, ranks: Sequence[int]) -> None:
        """Ask ``ranks`` to stop cooperatively (``ctx.should_stop`` becomes True)."""

    def release(self, ranks: Sequence[int]) -> None:
        """``ranks`` returned and every rank is done: they may leave."""

    def send(self, ranks: Sequence[int], request: dict[str, Any], body: Optional[bytes] = None,
             give_up: Optional[Callable[[], bool]] = None) -> list[int]:
        """Send a session's ``request`` (``op`` and what routes it; ``body``: the rest, pickled)
        to ``ranks``, from any thread; the ranks it could not reach (gone, or ``give_up()`` said
        so while it was on its way).

        Raises
        ------
        NotImplementedError
            This executor's ranks cannot be sent requests.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot send requests to its ranks")

    @abstractmethod
    def interrupt(self, ranks: Sequence[int]) -> None:
        """End the function of ``ranks`` now (SIGTERM to a process, SIGINT to an engine)."""

    @abstractmethod
    def kill(self, ranks: Sequence[int]) -> None:
        """``ranks`` outlived their interrupt by the grace period: end them for good, or give
        up on them (an engine is not ours to kill); either way an ``Exited`` follows."""

    @abstractmethod
    def request_stacks(self, ranks: Sequence[int]) -> None:
        """Ask ``ranks`` to dump their stacks into their stack files (``worker.boot.STACK_SIGNAL``)."""

    def request_flush(self, ranks: Sequence[int]) -> None:
        """Ask ``ranks`` to send the progress report their throttle holds back, if any (marked
        ``held``): the stall watchdog's report then names a hung rank's true last step."""

    def cpu_seconds(self, ranks: Sequence[int]) -> dict[int, Optional[float]]:
        """The CPU time each rank's process has used so far, where the executor can tell (the
        stall watchdog tells a busy rank from a hung one); None where it cannot."""
        return {r: None for r in ranks}

    @abstractmethod
    def abandon(self) -> None:
        """The notebook process is leaving, or supervision broke: end every rank now."""

    @abstractmethod
    def close(self) -> None:
        """Free what the transport holds; no rank may be left running by it."""


class Executor(ABC):
    """Where a run's ranks execute: validated there, placed there, started there."""

    name: str
    # Whether the ranks can map this process's shared memory (``transfer.packing``): then a call's
    # large tensors and arrays reach them by reference (``StartSpec.data``), else by value.
    maps_memory: bool = False

    @abstractmethod
    def validate(self, devices: Optional[DeviceSpec], *, backend: Optional[str], min_free_memory: Optional[int],
                 probe: Optional[Probe] = None) -> ValidationReport:
        """Validate ``devices`` (None: this executor's default) where the ranks would run."""

    def check_placement(self, devices: Sequence[Device]) -> None:
        """Raise, before anything is created, when the run cannot be placed now."""

    def places(self, n: int) -> Optional[list[str]]:
        """Where each of ``n`` ranks runs, when that is not a local process (``engine 1 on host``)."""
        return None

    def hosts(self, n: int) -> Optional[list[str]]:
        """The host each of ``n`` ranks runs on, when they may be on several (None: this one)."""
        return None

    def waiting_note(self) -> Optional[str]:
        """What a new run's ranks wait for before they can start, when they wait (shown while no
        rank has started); None when they start at once."""
        return None

    def held(self, devices: Sequence[Device]) -> list[str]:
        """What the ranks of a run on ``devices`` hold alone while it runs (a GPU, an engine):
        another run of this process may not use it at the same time. CPU slots share the cores."""
        return []

    def label(self, rank: int, device: Device) -> str:
        """How failures name a rank's device: ``cpu:1``, or ``cpu:1 on engine 3``."""
        return str(device)

    @abstractmethod
    def start(self, spec: StartSpec) -> Transport:
        """Start one rank per device; the transport that watches them."""

    def finished(self, directory: RunDir, world_size: int) -> None:
        """A run of this executor has ended (tidy up what it left)."""

    def retry_changes(self, devices: Sequence[Device], causing: set[int], retry: DeviceSpec) -> dict[str, Any]:
        """Launch-option changes a retry of a run on ``devices`` (whose ranks ``causing`` caused
        its failure) needs to run on the device list ``retry`` (where it runs; none by default)."""
        return {}

    @abstractmethod
    def device_choices(self) -> list[str]:
        """The devices a panel offers for a launch with this executor."""

