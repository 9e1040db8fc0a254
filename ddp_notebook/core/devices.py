"""Device lists as users write them, parsed into ``Device`` values.

Pure Python: parsing never imports torch and never touches a GPU. How many GPUs exist is
asked of a probe (see :mod:`ddp_notebook.core.probes`) only when a spec says ``cuda`` (all GPUs).

Accepted forms (case-insensitive, whitespace ignored)::

    "cpu:0,cpu:1"     explicit devices; rank = position in the list, rank 0 is the main worker
    "cuda:0-3"        an inclusive range: cuda:0, cuda:1, cuda:2, cuda:3
    "cpu*4"           four devices of a kind: cpu:0 .. cpu:3
    "cuda"            every visible GPU
    "cpu"             the next unused CPU worker slot
    ["cuda:0", torch.device("cuda", 1)]   a list of strings, torch.device or Device values

``cpu:N`` is a *worker slot*: a label that tells CPU workers apart. It does not pin the
worker to core N; every CPU worker computes on the CPU with ``cores // cpu_workers`` threads.
"""
from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from .errors import DeviceSpecError
from .probes import default_probe

__all__ = ["Device", "DeviceSpec", "parse_devices", "format_devices", "KINDS", "MAX_WORKERS"]

KINDS = ("cpu", "cuda")
ALIASES = {"gpu": "cuda"}
MAX_WORKERS = 1024  # a guard against "cpu*100000" typos, far above any single machine

DeviceSpec = Union[str, "Device", Any, Sequence[Any]]

# ASCII digits only: "cpu:\u0663" (an Arabic-Indic three) is not cpu:3.
_ITEM = re.compile(
    r"""^(?P<kind>[a-z_]+)
        (?: :(?P<index>[0-9]+)(?:-(?P<end>[0-9]+))?
          | \*(?P<count>[0-9]+) )?$""",
    re.VERBOSE | re.ASCII,
)


@dataclass(frozen=True, order=True)
class Device:
    """One device of a run: ``kind`` is ``"cpu"`` or ``"cuda"``, ``index`` its number.

    >>> str(Device("cuda", 1))
    'cuda:1'
    """

    kind: str
    """``"cpu"`` or ``"cuda"``."""
    index: int
    """The device's number: a GPU's index, or a CPU worker's slot (a label, not a core)."""

    def __post_init__(self) -> None:
        # "CUDA" and "gpu" mean cuda, as in a device string; anything else is refused here, so a
        # Device never names a kind or an index no worker can use.
        kind = self.kind.strip().lower() if isinstance(self.kind, str) else None
        kind = ALIASES.get(kind, kind) if kind is not None else None
        if kind not in KINDS:
            raise DeviceSpecError(f"Device kind must be one of {', '.join(KINDS)}, not {self.kind!r}.")
        try:
            index = None if isinstance(self.index, bool) else operator.index(self.index)
        except TypeError:  # not a whole number (1.0, '1', a class)
            index = None
        if index is None or not 0 <= index < MAX_WORKERS:
            raise DeviceSpecError(f"Device index must be a whole number from 0 to {MAX_WORKERS - 1}, "
                                  f"not {self.index!r}.")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "index", index)

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"

    def torch_device(self) -> Any:
        """The ``torch.device`` a worker computes on (CPU slots all compute on ``cpu``)."""
        import torch

        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.index)


def _bad(item: str, why: str) -> DeviceSpecError:
    return DeviceSpecError(
        f"cannot read device {item!r}: {why}. Write devices like 'cpu:0,cpu:1', 'cuda:0-3', "
        "'cpu*4' or 'cuda' (all GPUs)."
    )


def _number(digits: str) -> Optional[int]:
    """The number ``digits`` spell, or None above ``MAX_WORKERS`` (a number of thousands of digits
    is not even converted)."""
    n = int(digits) if len(digits.lstrip("0")) <= len(str(MAX_WORKERS)) else None
    return n if n is not None and n <= MAX_WORKERS else None


def _index(item: str, digits: str) -> int:
    n = _number(digits)
    if n is None or n >= MAX_WORKERS:
        raise _bad(item, f"index {digits} is too high: device indices go from 0 to {MAX_WORKERS - 1}")
    return n


def _expand_item(item: str, cuda_count: Callable[[], int], next_cpu: Callable[[], int]) -> list[Device]:
    text = item.strip().lower()
    if not text:
        raise _bad(item, "an empty entry (two commas in a row, or a trailing comma?)")
    m = _ITEM.match(text)
    if m is None:
        raise _bad(item, "expected KIND, KIND:N, KIND:A-B or KIND*N with a whole number N")
    kind = ALIASES.get(m.group("kind"), m.group("kind"))
    if kind not in KINDS:
        raise _bad(item, f"unknown device kind {kind!r}; valid kinds are {', '.join(KINDS)}")
    index, end, count = m.group("index"), m.group("end"), m.group("count")
    if index is not None:
        first = _index(item, index)
        last = _index(item, end) if end is not None else first
        if last < first:
            raise _bad(item, f"the range ends ({last}) before it starts ({first})")
        return [Device(kind, i) for i in range(first, last + 1)]
    if count is not None:
        n = _number(count)
        if n is None:
            raise _bad(item, f"more than {MAX_WORKERS} devices")
        if n == 0:
            raise _bad(item, "a count of 0 devices")
        return [Device(kind, i) for i in range(n)]
    if kind == "cpu":
        return [Device("cpu", next_cpu())]
    n = cuda_count()
    if n == 0:
        raise DeviceSpecError(
            "'cuda' means every visible GPU, and no CUDA device is visible here "
            "(no GPU, a CPU-only torch, or CUDA_VISIBLE_DEVICES is empty). Use 'cpu*2' to run on the CPU."
        )
    return [Device("cuda", i) for i in range(n)]


def _from_object(obj: Any, next_cpu: Callable[[], int]) -> Device:
    if isinstance(obj, Device):
        return obj
    # torch.device without importing torch: it has .type and .index
    kind, index = getattr(obj, "type", None), getattr(obj, "index", None)
    if isinstance(kind, str) and (index is None or isinstance(index, int)):
        if kind not in KINDS:
            raise _bad(str(obj), f"unknown device kind {kind!r}; valid kinds are {', '.join(KINDS)}")
        if index is None:
            # torch.device("cuda") is the current GPU (cuda:0 in a fresh worker); a bare
            # torch.device("cpu") takes the next free worker slot so [cpu, cpu] means two workers.
            index = next_cpu() if kind == "cpu" else 0
        return Device(kind, index)
    raise DeviceSpecError(
        f"cannot read device {obj!r} (a {type(obj).__name__}): give a string such as 'cuda:0', "
        "a torch.device, or a list of them."
    )


def parse_devices(spec: DeviceSpec, cuda_count: Optional[Callable[[], int]] = None) -> list[Device]:
    """Turn a device spec into a list of devices; rank = position in the list.

    ``cuda_count`` is called only for a bare ``cuda`` (all GPUs); by default it asks the
    CUDA-safe probe. Duplicates are kept here: validation reports them with their ranks.

    >>> [str(d) for d in parse_devices("cpu*2")]
    ['cpu:0', 'cpu:1']
    >>> [str(d) for d in parse_devices("cuda:0-2", cuda_count=lambda: 4)]
    ['cuda:0', 'cuda:1', 'cuda:2']
    """
    if cuda_count is None:
        cuda_count = lambda: default_probe().cuda_count()  # noqa: E731

    out: list[Device] = []

    def next_cpu() -> int:
        used = {d.index for d in out if d.kind == "cpu"}
        i = 0
        while i in used:
            i += 1
        if i >= MAX_WORKERS:  # every slot taken: the list itself is too long, whichever entry says so
            raise DeviceSpecError(f"the device list has more than {MAX_WORKERS} devices")
        return i

    items: Iterable[Any]
    if isinstance(spec, str):
        if not spec.strip():
            return []
        items = spec.split(",")
    elif isinstance(spec, (list, tuple)):
        items = spec
    else:
        items = [spec]
    for item in items:
        if isinstance(item, str):
            if isinstance(spec, (list, tuple)) and "," in item:
                raise _bad(item, "a list entry holds one device; split it or pass the whole string")
            out.extend(_expand_item(item, cuda_count, next_cpu))
        else:
            out.append(_from_object(item, next_cpu))
        if len(out) > MAX_WORKERS:
            raise DeviceSpecError(f"the device list has more than {MAX_WORKERS} devices")
    return out


def format_devices(devices: Sequence[Device]) -> str:
    """The canonical text of a device list: ``cpu:0,cpu:1``."""
    return ",".join(str(d) for d in devices)
