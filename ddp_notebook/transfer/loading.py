"""Loading what ``transfer.packing`` packed, in the process that uses it: each segment of the
table opened through ``/proc/<pid>/fd/<fd>`` of the process that placed it (checked to be the file
it was), mapped once, copy-on-write, and every piece rebuilt over that mapping: a torch storage, a
numpy array. ``Received`` is a result that arrived from a worker, opened at once, loaded later.
"""
from __future__ import annotations

import errno
import io
import mmap
import os
import pickle
import warnings
import weakref
from typing import Any, Optional

from ..core.errors import NotPicklableError
from . import pickling
from .packing import PAGE, TAG, DataTable, SharedDataError, close_all, pack, supported
from .queues import QueueEnd

__all__ = ["load", "open_table", "changed_files", "Received", "share"]


def _torch() -> Any:
    import torch  # a table with storages is loaded where torch is (a worker, a notebook using it)

    return torch


def _numpy() -> Any:
    import numpy

    return numpy


def open_table(table: DataTable) -> list[int]:
    """Open every segment of ``table`` here (read-only), checking each is the file it was; the
    caller closes them. Raises ``SharedDataError`` naming the segment that cannot be opened."""
    fds: list[int] = []
    try:
        for seg in table.get("segments", []):
            try:
                fd = os.open(seg["path"], os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                err = SharedDataError(f"cannot open the data in {seg['name']} ({seg['path']}): {e.strerror or e}")
                err.errno = e.errno  # ENOENT: the process that held it is gone
                raise err from None
            fds.append(fd)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (seg["dev"], seg["ino"]):
                raise SharedDataError(f"{seg['name']} ({seg['path']}) is not the file it was when the data was "
                                      "placed (it was replaced)")
            if "size" in seg and (st.st_size, st.st_mtime_ns) != (seg["size"], seg["mtime_ns"]):
                raise SharedDataError(f"{seg['name']} was rewritten since the run was launched with data mapped "
                                      "from it; a file given to a run must not change while the run uses it")
    except BaseException:
        close_all(fds)
        raise
    return fds


def changed_files(table: Optional[DataTable]) -> list[str]:
    """What changed, since they were placed, in the files ``table`` maps data from (a file cut
    short kills a process that reads past its end with SIGBUS): one line per changed file."""
    out = []
    for seg in (table or {}).get("segments", []):
        if "size" not in seg:  # shared memory, not a file
            continue
        try:
            st = os.stat(seg["name"])
        except OSError:
            out.append(f"{seg['name']} was deleted or moved")
            continue
        if (st.st_dev, st.st_ino) != (seg["dev"], seg["ino"]):
            out.append(f"{seg['name']} was replaced by another file")
        elif st.st_size < seg["size"]:
            out.append(f"{seg['name']} was cut short, from {seg['size']} to {st.st_size} bytes")
        elif (st.st_size, st.st_mtime_ns) != (seg["size"], seg["mtime_ns"]):
            out.append(f"{seg['name']} was rewritten")
    return out


class _Mapper:
    """Maps each segment once, over the span its pieces cover (one descriptor per segment: Python's
    mmap keeps a duplicate of it, and a model may have thousands of pieces). A segment is mapped
    copy-on-write unless every piece in it is read-only (a huge read-only file then costs no
    commit charge)."""

    def __init__(self, table: DataTable, fds: list[int]) -> None:
        self.names = [seg["name"] for seg in table.get("segments", [])]
        self.rows = table.get("pieces", [])
        self.fds = fds
        self.memo: dict[Any, Any] = {}  # by piece (raw memory), and by piece and how it is read
        self._maps: dict[int, tuple[mmap.mmap, int]] = {}

    def window(self, index: int) -> tuple[mmap.mmap, int, int, bool]:
        """(the segment's mapping, the piece's offset in it, its size, whether it is writable)."""
        segment, offset, nbytes, writable = self.rows[index]
        if segment not in self._maps:
            rows = [r for r in self.rows if r[0] == segment]
            start = min(r[1] for r in rows)
            start -= start % PAGE
            end = max(r[1] + r[2] for r in rows)
            access = mmap.ACCESS_COPY if any(r[3] for r in rows) else mmap.ACCESS_READ
            try:
                if os.fstat(self.fds[segment]).st_size < end:
                    raise ValueError("the file is shorter than the data")
                self._maps[segment] = (mmap.mmap(self.fds[segment], end - start, access=access, offset=start), start)
            except (OSError, ValueError) as e:
                raise SharedDataError(f"cannot map the data in {self.names[segment]}: {e}") from None
        mm, start = self._maps[segment]
        return mm, offset - start, nbytes, writable


def _rebuild(mapper: _Mapper, index: int, kind: str, meta: Any) -> Any:
    key = (index, meta) if kind == "storage" else (index, kind) if kind == "untyped" else index
    if key in mapper.memo:
        return mapper.memo[key]
    mm, delta, nbytes, _writable = mapper.window(index)
    if kind in ("storage", "untyped"):
        torch = _torch()
        raw = mapper.memo.get(index)  # views of one storage stay views of one storage, whatever their dtype
        if raw is None:
            with warnings.catch_warnings():  # a read-only file's tensors are read-only in the notebook too
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=delta).untyped_storage()
            mapper.memo[index] = raw
        # torch pickles some dtypes (uint16, float8...) as bytes: they come back as a byte storage
        out = torch.storage.TypedStorage(wrap_storage=raw, dtype=torch.uint8 if kind == "untyped" else meta,
                                         _internal=True)
    else:
        np = _numpy()
        dtype, shape, order, was_writable = meta
        out = np.ndarray(shape, dtype=dtype, buffer=mm, offset=delta, order=order)
        if not was_writable and out.flags.writeable:  # read-only where it came from, read-only here
            out.flags.writeable = False
    mapper.memo[key] = out
    return out


class Received:
    """A pickle another process sent, with its pieces still in that process: ``adopt`` opens them
    here at once (while the sender lives), so ``load`` can map them after it has gone.

    >>> Received(pickling.dumps([1, 2])).load()
    [1, 2]
    """

    def __init__(self, data: bytes, table: Optional[DataTable] = None, fds: Optional[list[int]] = None,
                 error: Optional[str] = None, sender_gone: bool = False) -> None:
        self.data = data
        self.table = table
        self.error = error  # why the pieces could not be opened (load raises it)
        self.sender_gone = sender_gone  # they could not be opened because the sender had died
        self._fds = fds or []
        self._closer = weakref.finalize(self, close_all, self._fds)

    @classmethod
    def adopt(cls, data: bytes, table: Optional[DataTable]) -> Received:
        if not table or not table.get("pieces"):
            return cls(data)
        try:
            return cls(data, table, open_table(table))
        except SharedDataError as e:
            return cls(data, table, error=str(e), sender_gone=e.errno in (errno.ENOENT, errno.ESRCH))

    @property
    def shared_bytes(self) -> int:
        return sum(row[2] for row in (self.table or {}).get("pieces", []))

    def load(self) -> Any:
        """The object, its pieces mapped copy-on-write (each call maps them anew)."""
        if self.error is not None:
            raise SharedDataError(self.error)
        if not self.table or not self.table.get("pieces"):
            return pickling.loads(self.data)
        return _MappingUnpickler(io.BytesIO(self.data), _Mapper(self.table, self._fds)).load()

    def release(self) -> None:
        """Close what is held here; what ``load`` returned keeps its memory."""
        self._closer()


class _MappingUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, mapper: Optional[_Mapper]) -> None:
        super().__init__(file)
        self.mapper = mapper

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 4 and pid[0] == TAG):
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        if pid[2] == "queue":  # the worker's end of a queue the notebook holds
            return QueueEnd(pid[1])
        if self.mapper is None:
            raise pickle.UnpicklingError(f"a reference to shared data {pid!r}, and no table of it")
        return _rebuild(self.mapper, pid[1], pid[2], pid[3])


def load(data: bytes, table: Optional[DataTable]) -> Any:
    """Unpickle ``data``, mapping its pieces as ``table`` (from ``Placement.table``) says."""
    if not table or not table.get("pieces"):
        return _MappingUnpickler(io.BytesIO(data), None).load()
    fds = open_table(table)
    try:
        return _MappingUnpickler(io.BytesIO(data), _Mapper(table, fds)).load()
    finally:
        close_all(fds)  # the mappings hold the memory from here


def share(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors and numpy arrays of 64 kB or more live in shared memory.

    They are copied there once: a run given the copy (or anything made from it without a write,
    such as a ``TensorDataset``) sends its data with no copy at all, then and at every later
    launch, and the data is held once while runs live. Writes in the notebook stay the
    notebook's (copy-on-write), and what was written is copied again by the next launch. Drop
    the original to free its memory.

    Parameters
    ----------
    obj : object
        Tensors, arrays, or any picklable structure holding them (a tuple, a dict, a dataset).

    Returns
    -------
    object
        The copy; outside Linux, and for an object with nothing to share, ``obj`` itself.

    Raises
    ------
    NotPicklableError
        ``obj`` cannot be pickled, so it could not be sent to a run either.

    Examples
    --------
    ::

        x, y = ddp_notebook.share((x, y))
        ddp_notebook.launch(train, devices="cpu*4", args=(x, y))   # "data: ... already in shared memory"
    """
    if not supported():
        return obj
    try:
        packed = pack(obj)
    except Exception as e:  # noqa: BLE001 - pickling raises many types
        kind = type(obj)
        raise NotPicklableError("share()'s argument", kind.__qualname__ if kind.__module__ == "builtins"
                                else f"{kind.__module__}.{kind.__qualname__}", str(e) or type(e).__name__) from None
    if not packed.pieces:
        return obj
    placed = packed.place()
    try:
        return load(packed.data, placed.table)
    finally:
        placed.release()  # the mappings keep the memory
