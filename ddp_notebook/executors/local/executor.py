"""The local executor: one new worker process per rank on this machine, for each run.

A worker is forked by the fork server (``forkserver``: torch imported once for the notebook) or,
where there is none (off Linux, ``DDP_NOTEBOOK_FORKSERVER=0``, a server that failed or cannot
answer), started as a fresh interpreter: one way to start a rank, with one fallback. Either way
the run's own thread gets the processes (``RankStarter``), so ``launch`` returns at once.

Ranks meet through a file rendezvous in the run directory; gloo and NCCL are bound to the
loopback interface, so a local run opens no socket on a routable address. CPU runs see no GPU
at all, and each CPU worker computes with ``cores // workers`` threads.
"""
from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from typing import Optional

from ...core import probes
from ...core.devices import Device, DeviceSpec, parse_devices
from ...core.events import RankConfig
from ...core.probes import Probe, cpu_count, default_probe
from ...core.validation import ValidationReport, validate_devices
from ..base import Executor, StartSpec, Transport, rank_configs
from . import forkserver
from .forkserver import ForkRequest, Unavailable
from .gpu_probe import SubprocessProbe
from .processes import Prestarted, WorkerProcess, assignment, start_worker
from .transport import LocalTransport

__all__ = ["LocalExecutor", "RankStarter", "default_devices", "set_default_devices", "standing_processes"]

_default_spec: Optional[DeviceSpec] = None
# This machine's devices are what validation asks about when it is given no probe.
probes.use_default_probe(SubprocessProbe)


def set_default_devices(spec: Optional[DeviceSpec]) -> None:
    """The device list runs use when none is given (``%ddp_devices SPEC``); None to reset. A list
    that cannot be read is refused now (``DeviceSpecError``); whether its devices exist is checked
    by each run, where it runs."""
    global _default_spec
    if spec is not None:
        parse_devices(spec, cuda_count=lambda: 1)  # "cuda" (every GPU) is judged at launch
    _default_spec = spec


def default_devices(probe: Optional[Probe] = None) -> DeviceSpec:
    """The list set with ``set_default_devices``; else every visible GPU, or two CPU workers."""
    if _default_spec is not None:
        return _default_spec
    probe = probe or default_probe()
    return "cuda" if probe.cuda_count() > 0 else "cpu*2"


def standing_processes() -> set[int]:
    """The pids of the processes kept between runs: the fork server (whose forked workers belong
    to runs) and its reaper. A leak check leaves them alone."""
    status = forkserver.status()
    return {pid for pid in (status["pid"], status["reaper"]) if isinstance(pid, int)}


def _start_ranks(spec: StartSpec, frames: list[bytes],
                 processes: list[Optional[Prestarted]]) -> list[WorkerProcess]:
    """Assign each rank to its process (a fresh interpreter where it is None); nothing is left
    if one fails."""
    workers: list[WorkerProcess] = []
    try:
        for rank, device in enumerate(spec.devices):
            workers.append(start_worker(rank, device, frames[rank], processes[rank]))
        return workers
    except BaseException:
        for w in workers:
            w.discard()
        for process in processes[len(workers):]:  # those not assigned yet
            if process is not None:
                process.discard()
        raise


class RankStarter:
    """Gets a run's worker processes for its transport, on the run's own thread, never blocking it
    for more than a poll: forked by the fork server when it can, else fresh interpreters. The
    fork server is asked at once (a request never waits for its answer), each worker's assignment
    with it: a forked worker starts its rank as soon as it exists, whatever the notebook's threads
    are doing then (the launch's last steps, a panel drawn)."""

    def __init__(self, spec: StartSpec, configs: list[RankConfig]) -> None:
        self.spec = spec
        # Made first: a config that cannot be sent leaves nothing started.
        self.frames = [assignment(config, spec.payload) for config in configs]
        self._request: Optional[ForkRequest] = forkserver.request_workers(self.frames)

    def importing(self) -> bool:
        """Whether the ranks wait for the fork server to import torch."""
        return self._request is not None and self._request.importing()

    def poll(self, timeout: float) -> Optional[list[WorkerProcess]]:
        """The ranks' processes, started, once they can be (None meanwhile)."""
        n = len(self.spec.devices)
        processes: Optional[list[Prestarted]] = None
        if self._request is not None:
            try:
                processes = self._request.poll(timeout)
            except Unavailable:  # it failed, died or cannot answer: fresh interpreters then
                self._request = None
            else:
                if processes is None:
                    return None
                self._request = None
        return _start_ranks(self.spec, self.frames, list(processes) if processes else [None] * n)

    def cancel(self) -> None:
        """Let go of the workers asked for (the run ended before they came)."""
        if self._request is not None:
            self._request.cancel()
            self._request = None


class LocalExecutor(Executor):
    """Worker processes on this machine: forked by the fork server, or fresh interpreters."""

    name = "local"
    maps_memory = True  # a call's tensors reach the ranks through shared memory (transfer.packing)

    def validate(self, devices: Optional[DeviceSpec], *, backend: Optional[str], min_free_memory: Optional[int],
                 probe: Optional[Probe] = None) -> ValidationReport:
        spec = default_devices(probe) if devices is None else devices
        return validate_devices(spec, backend=backend, min_free_memory=min_free_memory, probe=probe)

    def start(self, spec: StartSpec) -> Transport:
        n = len(spec.devices)
        # Gloo and NCCL listen on the loopback interface only; CPU runs see no GPU at all.
        env = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        if all(d.kind == "cpu" for d in spec.devices):
            env["CUDA_VISIBLE_DEVICES"] = ""
        configs = rank_configs(spec, ["localhost"] * n, [cpu_count()] * n, env)
        for config in configs:  # as the notebook's is now, whenever the worker was started
            config["environ"] = dict(os.environ)
            config["data"] = spec.data  # where the call's tensors and arrays are
            config["share_result"] = True  # and where the main worker's result is put, the same way
            config["authkey"] = bytes(multiprocessing.current_process().authkey).hex()
        return LocalTransport(RankStarter(spec, configs), n)

    def waiting_note(self) -> Optional[str]:
        """While the fork server imports torch (the first launch of a notebook without ``%load_ext``):
        the ranks start once it is ready, which the panel says."""
        return "importing torch once for this notebook" if forkserver.importing() else None

    def held(self, devices: Sequence[Device]) -> list[str]:
        return [str(d) for d in devices if d.kind == "cuda"]

    def device_choices(self) -> list[str]:
        """One CPU slot per core, and every visible GPU (probed CUDA-safely)."""
        probe = default_probe()
        return [f"cuda:{i}" for i in range(probe.cuda_count())] + [f"cpu:{i}" for i in range(probe.cpu_count())]
