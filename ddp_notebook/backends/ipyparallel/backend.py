"""The ipyparallel backend: rank r on the r-th engine of ``Engines``, with the r-th device.

Ranks meet through a file rendezvous in the run directory, which every engine must see; they
also meet in Python before and after the function (``worker.peers``), so that an engine, which
cannot be killed, is never left waiting in C++. Ranks on one host use loopback only; ranks on
several hosts let gloo/NCCL pick the host's interface unless ``env`` names one.
"""
from __future__ import annotations

import shutil
from collections.abc import Sequence
from typing import Any, Optional

from ...core.devices import Device, DeviceSpec, parse_devices
from ...core.errors import EngineUnavailableError
from ...core.probes import Probe
from ...core.rundir import RunDir
from ...core.validation import ValidationReport
from ..base import Backend, StartSpec, Transport, rank_configs
from .engines import Engines
from .transport import EngineTransport
from .validation import EngineProbe, validate_on_engines

__all__ = ["IpyparallelBackend"]


class IpyparallelBackend(Backend):
    """One rank per engine of ``engines``."""

    name = "ipyparallel"

    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    def validate(self, devices: Optional[DeviceSpec], *, backend: Optional[str], min_free_memory: Optional[int],
                 probe: Optional[Probe] = None) -> ValidationReport:
        return validate_on_engines(devices, self.engines, backend=backend, min_free_memory=min_free_memory)

    def check_placement(self, devices: Sequence[Device]) -> None:
        """Refuse the run, before anything is logged or started, when one of its engines is gone."""
        client = self.engines.client
        gone = [eid for eid in self.engines.ids[: len(devices)] if eid not in client.ids]
        if gone:
            raise EngineUnavailableError(
                f"engine{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} "
                f"{'are' if len(gone) > 1 else 'is'} not available any more; the engines now are {list(client.ids)}")

    def places(self, n: int) -> list[str]:
        return [f"engine {eid} on {host}" for eid, host in zip(self.engines.ids, self.engines.hosts())][:n]

    def held(self, devices: Sequence[Device]) -> list[str]:
        # An engine runs one task at a time; a GPU is its host's.
        hosts = self.engines.hosts()
        out = [f"engine {eid}" for eid in self.engines.ids[: len(devices)]]
        return out + [f"{d} on host {host}" for d, host in zip(devices, hosts) if d.kind == "cuda"]

    def label(self, rank: int, device: Device) -> str:
        return f"{device} on engine {self.engines.ids[rank]}"

    def start(self, spec: StartSpec) -> Transport:
        n = len(spec.devices)
        info = self.engines.describe()[:n]
        hosts = self.engines.hosts()[:n]
        env: dict[str, str] = {}
        if len(set(hosts)) == 1:
            env.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
        # Ranks on several hosts must reach each other over the network: gloo/nccl pick the host's
        # interface unless the user's env names one. An engine's torch is already set up, so
        # CUDA_VISIBLE_DEVICES would not apply there: it is not set.
        # Engines cannot be killed: ranks also meet in Python, where an interrupt is seen.
        configs = rank_configs(spec, hosts, [int(i.get("cpu_count", 1)) for i in info], env, meet_in_python=True)
        for config in configs:
            # Even the user's: it would take effect in an engine that has not used CUDA yet, for the
            # rest of the engine's life, and no longer match what validation saw there.
            config["env"].pop("CUDA_VISIBLE_DEVICES", None)
        return EngineTransport(self.engines.subset(range(n)), configs, spec.payload, spec.directory)

    def finished(self, directory: RunDir, world_size: int) -> None:
        # A rank still queued on a busy engine sees the mark when it finally starts, and leaves.
        directory.mark_ended()
        for folder in (directory.arrivals_dir, directory.returned_dir):
            shutil.rmtree(folder, ignore_errors=True)

    def retry_changes(self, devices: Sequence[Device], causing: set[int], retry: DeviceSpec) -> dict[str, Any]:
        """A retry runs on the engines of the ranks whose devices it keeps (a device the run did
        not use goes to the first engine not used yet; healthy ranks' engines first)."""
        wanted = parse_devices(retry, cuda_count=EngineProbe(self.engines.describe()).cuda_count)
        order = [r for r in range(len(devices)) if r not in causing] + sorted(causing)
        taken: list[int] = []
        for device in wanted:
            rank = next((r for r in order if r not in taken and devices[r] == device), None)
            if rank is None:
                rank = next((r for r in order if r not in taken), None)
            if rank is None:
                break  # more devices than engines: validation says so
            taken.append(rank)
        return {"engines": self.engines.subset(taken)}

    def device_choices(self) -> list[str]:
        """One CPU slot per engine, and the GPUs every engine has."""
        gpus = EngineProbe(self.engines.describe()).cuda_count()
        return [f"cpu:{i}" for i in range(len(self.engines))] + [f"cuda:{i}" for i in range(gpus)]
