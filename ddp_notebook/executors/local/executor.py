"""The local backend: one new worker process per rank on this machine.

Ranks meet through a file rendezvous in the run directory; gloo and NCCL are bound to the
loopback interface, so a local run opens no socket on a routable address. CPU runs see no GPU
at all, and each CPU worker computes with ``cores // workers`` threads.
"""
from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from typing import Optional

from ...core.devices import Device, DeviceSpec, parse_devices
from ...core.events import RankConfig
from ...core.probes import Probe, cpu_count, default_probe
from ...core.rundir import RunDir
from ...core.validation import ValidationReport, validate_devices
from ..base import Executor, StartSpec, Transport, rank_configs
from . import forkserver
from .deferred import DeferredTransport
from .pool import get_pool
from .processes import Prestarted, WorkerProcess, start_worker
from .transport import LocalTransport

__all__ = ["LocalExecutor", "default_devices", "set_default_devices", "standing_processes"]

_default_spec: Optional[DeviceSpec] = None


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
    """The pids of the processes kept between runs: the pool's idle workers and their watchers,
    and the fork server (whose forked workers belong to runs). A leak check leaves these alone."""
    pids = set(get_pool().idle_pids())
    for pid in list(pids):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                pids.update(int(child) for child in f.read().split())
        except OSError:
            pass
    server = forkserver.status()["pid"]
    if isinstance(server, int):
        pids.add(server)
    return pids


def _forked_or_cold(n: int) -> list[Optional[Prestarted]]:
    """``n`` workers forked by the fork server; None for each one to start cold (the server is
    disabled or cannot fork)."""
    forked = forkserver.fork_workers(n)
    return list(forked) if forked is not None else [None] * n


def _start_ranks(spec: StartSpec, configs: list[RankConfig], processes: list[Optional[Prestarted]]) -> LocalTransport:
    """Assign each rank to its process (a new one where it is None); nothing is left if one fails."""
    workers: list[WorkerProcess] = []
    try:
        for rank, device in enumerate(spec.devices):
            workers.append(start_worker(rank, device, configs[rank], spec.payload, processes[rank]))
        return LocalTransport(workers)  # an interrupt before it watches them must not lose them
    except BaseException:
        for w in workers:
            w.discard()
        for process in processes[len(workers):]:  # those not assigned yet
            if process is not None:
                process.discard()
        raise


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
        pool = get_pool()
        if pool.enabled:
            return _start_ranks(spec, configs, pool.take(n))
        if forkserver.warming():
            # The server imports torch: the run starts now, its ranks once the server can fork.
            return DeferredTransport(lambda: _start_ranks(spec, configs, _forked_or_cold(n)), n, forkserver.warming,
                                     forkserver.START_TIMEOUT)
        return _start_ranks(spec, configs, _forked_or_cold(n))

    def held(self, devices: Sequence[Device]) -> list[str]:
        return [str(d) for d in devices if d.kind == "cuda"]

    def finished(self, directory: RunDir, world_size: int) -> None:
        # Warm the next run's workers now that this run no longer needs the cores.
        get_pool().refill(world_size)

    def device_choices(self) -> list[str]:
        """One CPU slot per core, and every visible GPU (probed CUDA-safely)."""
        probe = default_probe()
        return [f"cuda:{i}" for i in range(probe.cuda_count())] + [f"cpu:{i}" for i in range(probe.cpu_count())]
