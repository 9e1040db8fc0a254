"""The ipyparallel backend: rank r on the r-th engine of ``Engines``, with the r-th device.

Ranks meet in a store rank 0's call serves (``worker.meeting``), on loopback when every rank is on
one host, else on the address of rank 0 its peers reached when validation probed the network
(``network``); each rank's gloo/NCCL interface is the one that reaches rank 0, unless ``env``
names one. They also meet in Python before and after the function, so that an engine, which
cannot be killed, is never left waiting in C++. Nothing needs a shared file system.

A session's ranks take the notebook's requests (its cells, a ping) from a store the notebook
hosts for the run, on its address the engines reach (``network_plan.notebook_address``), under
the run's secret too.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from typing import Any, Optional

from ...core.devices import Device, DeviceSpec, parse_devices
from ...core.errors import EngineUnavailableError
from ...core.probes import Probe
from ...core.rundir import RunDir, latest_checkpoint
from ...core.validation import ValidationReport
from ...worker.meeting import Meeting
from ..base import Executor, StartSpec, Transport, rank_configs
from .engine_checks import EngineProbe, validate_on_engines
from .engines import Engines
from .network_plan import machines_of, network_timeout, notebook_address
from .transport import EngineTransport

__all__ = ["IpyparallelExecutor"]


class IpyparallelExecutor(Executor):
    """One rank per engine of ``engines``."""

    name = "ipyparallel"

    def __init__(self, engines: Engines, env: Optional[dict[str, str]] = None) -> None:
        self.engines = engines
        self.env = dict(env or {})  # the user's env= (an interface named there is checked on each engine)

    def validate(self, devices: Optional[DeviceSpec], *, backend: Optional[str], min_free_memory: Optional[int],
                 probe: Optional[Probe] = None) -> ValidationReport:
        return validate_on_engines(devices, self.engines, backend=backend, min_free_memory=min_free_memory,
                                   env=self.env)

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

    def hosts(self, n: int) -> list[str]:
        return [str(h) for h in self.engines.hosts()[:n]]

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
        plan = self.engines.network(n)
        timeout = network_timeout() if plan.several_hosts else None
        secret = secrets.token_hex(16)  # the run's keys in rank 0's store are under it
        # An engine's torch is already set up, so CUDA_VISIBLE_DEVICES would not apply there: it is
        # not set. Engines cannot be killed: ranks also meet in Python, where an interrupt is seen.
        configs = rank_configs(spec, machines_of(info), [int(i.get("cpu_count", 1)) for i in info], {})
        # Checkpoints travel through ipyparallel: the engines may see none of this host's files.
        resume = _checkpoint_bytes(spec.config.get("resume_from"))
        for rank, config in enumerate(configs):
            config["checkpoints_to_notebook"] = True
            if resume is not None:
                config["resume_data"] = resume
            interface = plan.interfaces[rank]
            found = {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface} if interface else {}
            config["env"] = {**found, **config["env"]}  # the user's env= names another: it wins
            # Even the user's: it would take effect in an engine that has not used CUDA yet, for the
            # rest of the engine's life, and no longer match what validation saw there.
            config["env"].pop("CUDA_VISIBLE_DEVICES", None)
            config["meeting"] = {"address": plan.address, "port": None, "secret": secret,
                                 "local": plan.local[rank], "network_timeout": timeout}
        requests = self._request_store(n, secret, float(spec.config.get("timeout", 1800))) \
            if spec.config.get("mode") == "session" else None
        if requests is not None:
            for config in configs:
                config["requests"] = {"address": requests.address, "port": requests.port}
        return EngineTransport(self.engines.subset(range(n)), configs, spec.payload, spec.directory,
                               [str(i.get("host", "?")) for i in info], timeout, requests)

    def _request_store(self, n: int, secret: str, timeout: float) -> Meeting:
        """The store a session's ranks take the notebook's requests from, on this host's address
        that the engines reach.

        Raises
        ------
        EngineUnavailableError
            An engine reaches no address of this host.
        """
        address, problems = notebook_address(self.engines, n)
        if problems or not address:
            raise EngineUnavailableError(" ".join(problems) or "no engine reaches this notebook over TCP")
        return Meeting.host(address, secret, timeout)

    def finished(self, directory: RunDir, world_size: int) -> None:
        """Nothing to tidy: rank 0's store ended with its call."""

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


def _checkpoint_bytes(resume_from: Optional[str]) -> Optional[bytes]:
    """The checkpoint a run resumes from (a file, or a folder: its latest), read here."""
    if not resume_from:
        return None
    path = resume_from if os.path.isfile(resume_from) else latest_checkpoint(resume_from)
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()
