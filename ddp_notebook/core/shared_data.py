"""Tensors and arrays that travel by reference: a call (or a result) pickled with its large CPU
tensors and numpy arrays left out of the pickle, then placed once where every process can map
them.

``pack(obj)`` pickles ``obj`` with cloudpickle, except that each torch storage and numpy array of
at least ``MIN_SHARED`` bytes becomes a reference (a ``Piece``) to its memory. ``Packed.place()``
puts the pieces where other processes can map them: memory that is already a file's clean
mapping (a ``np.memmap``, ``np.load(mmap_mode=...)``, ``torch.load(mmap=True)``,
``torch.from_file``) stays that file, and travels as its path; anything else is copied once into
one anonymous shared-memory file (``memfd``) that only this process holds. ``load(data, table)``
in another process of this user maps each piece copy-on-write: the ranks share the pages until
one writes, and what a rank writes stays its own, as if it had been pickled by value.

A piece is reached through ``/proc/<pid>/fd/<fd>`` of the process that placed it, which the kernel
opens only for that user's processes, so nothing is ever put where another user could read or
replace it, and nothing outlives the processes: the memory is freed when the last process that
holds or maps it ends, however it ends.

>>> import numpy as np
>>> packed = pack({"x": np.arange(2**16, dtype=np.float64), "n": 3})
>>> [p.nbytes for p in packed.pieces]
[524288]
>>> placed = packed.place()
>>> out = load(packed.data, placed.table)
>>> float(out["x"][-1]), out["n"]
(65535.0, 3)
>>> placed.release()
"""
from __future__ import annotations

import ctypes
import io
import mmap
import os
import pickle
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from . import pickling

__all__ = ["MIN_SHARED", "Piece", "Packed", "Placement", "SharedDataError", "pack", "load", "supported",
           "open_table", "DataTable", "Received"]

MIN_SHARED = 64 * 1024
"""Smaller tensors and arrays are pickled by value: a reference costs more than it saves."""

_TAG = "ddp-notebook-data"
_PAGE = mmap.ALLOCATIONGRANULARITY

# What a process is told about the pieces of a call: where each segment is and, per piece, its
# segment, offset, size and whether it is mapped writable (copy-on-write) or read-only. JSON.
DataTable = dict[str, Any]


class SharedDataError(OSError):
    """A piece of a call or result could not be placed or mapped (says which, and why)."""


def supported() -> bool:
    """Whether pieces can be shared here (Linux: memfd and /proc/PID/fd)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


@dataclass(eq=False)
class Piece:
    """One tensor storage or array left out of a pickle: the object (kept alive, so its memory is),
    its address and size, and the clean file mapping it lies in, when it does."""

    obj: Any
    address: int
    nbytes: int
    writable: bool
    file: Optional[tuple[int, int]] = None  # (segment index in Packed.files, offset in that file)


@dataclass(eq=False)
class FileSegment:
    """A file pieces lie in, held open so the workers map that very file (not one since put there)."""

    fd: int
    path: str
    dev: int
    ino: int


@dataclass(eq=False)
class Packed:
    """A pickle with its large tensors and arrays by reference. ``data`` alone unpickles nowhere:
    ``place()`` makes the table that ``load`` needs."""

    data: bytes
    pieces: list[Piece] = field(default_factory=list)
    files: list[FileSegment] = field(default_factory=list)

    @property
    def shared_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def copied_bytes(self) -> int:
        """What ``place()`` copies: the pieces that are not in a file."""
        return sum(p.nbytes for p in self.pieces if p.file is None)

    def place(self, progress: Optional[Callable[[int, int], None]] = None) -> Placement:
        """Put the pieces where another process of this user can map them: the copied ones in one
        new memfd (``progress(copied, total)`` as it goes), the others in their files."""
        return Placement.of(self, progress)

    def inline(self) -> bytes:
        """The same object as a plain pickle, every piece by value (for a place that cannot map
        this process's memory, such as an ipyparallel engine)."""
        if not self.pieces:
            return self.data
        return pickling.dumps(_LiveUnpickler(io.BytesIO(self.data), self).load())


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---- packing ----------------------------------------------------------------------------------
class _Maps:
    """This process's file mappings (/proc/self/maps), read once per pack, and whether a private
    writable one holds pages that differ from its file (then it is not the file any more)."""

    def __init__(self) -> None:
        self._rows: Optional[list[tuple[int, int, str, int, int, int, str]]] = None

    def find(self, address: int, nbytes: int) -> Optional[tuple[str, int, int, int, bool]]:
        """(path, dev, ino, file offset, mapped writable) for memory wholly inside one clean mapping
        of a regular file, else None."""
        if self._rows is None:
            self._rows = _read_maps()
        for start, end, perms, offset, dev, ino, path in self._rows:
            if start <= address and address + nbytes <= end:
                if ino == 0 or not path.startswith("/") or path.endswith(" (deleted)") or path.startswith("/memfd:"):
                    return None
                if perms[1] == "w" and perms[3] == "p" and _dirty_private(start):
                    return None  # copy-on-write pages written since: the file no longer says what it holds
                return path, dev, ino, offset + address - start, perms[1] == "w"
        return None


def _read_maps() -> list[tuple[int, int, str, int, int, int, str]]:
    rows = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            lo, hi = parts[0].split("-")
            major, minor = parts[3].split(":")
            rows.append((int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), os.makedev(int(major, 16),
                         int(minor, 16)), int(parts[4]), parts[5].rstrip("\n")))
    return rows


def _dirty_private(start: int) -> bool:
    """Whether the mapping at ``start`` has private (copied-on-write) pages (smaps' Anonymous)."""
    head = f"{start:x}-"
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith(head):
                inside = True
            elif inside and line.startswith("Anonymous:"):
                return int(line.split()[1]) != 0
    return True


def _torch() -> Any:
    return sys.modules.get("torch")  # no tensor exists in a process that never imported torch


def _numpy() -> Any:
    return sys.modules.get("numpy")


class _SharingPickler(pickling.Pickler):
    """cloudpickle, with large CPU storages and plain contiguous arrays as ``Piece`` references."""

    def __init__(self, file: io.BytesIO, packed: Packed) -> None:
        super().__init__(file, protocol=pickling.PROTOCOL)
        self.packed = packed
        self._index: dict[tuple[int, int, str], int] = {}
        self._maps = _Maps()
        self._files: dict[tuple[int, int], int] = {}

    def persistent_id(self, obj: Any) -> Any:
        torch, np = _torch(), _numpy()
        if torch is not None and isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            if storage.device.type != "cpu" or storage.nbytes() < MIN_SHARED:
                return None
            index = self._piece(obj, storage.data_ptr(), storage.nbytes(), True, "storage")
            return (_TAG, index, "storage", obj.dtype)
        if (np is not None and type(obj) in (np.ndarray, np.memmap) and obj.nbytes >= MIN_SHARED
                and not obj.dtype.hasobject and (obj.flags.c_contiguous or obj.flags.f_contiguous)):
            order = "C" if obj.flags.c_contiguous else "F"
            index = self._piece(obj, obj.ctypes.data, obj.nbytes, bool(obj.flags.writeable), "array")
            return (_TAG, index, "array", (obj.dtype, obj.shape, order, bool(obj.flags.writeable)))
        return None

    def _piece(self, obj: Any, address: int, nbytes: int, writable: bool, kind: str) -> int:
        key = (address, nbytes, kind)
        if key in self._index:
            return self._index[key]
        piece = Piece(obj, address, nbytes, writable)
        found = self._maps.find(address, nbytes) if supported() else None
        if found is not None:
            path, dev, ino, offset, mapped_writable = found
            segment = self._file_segment(path, dev, ino)
            if segment is not None:
                piece.file = (segment, offset)
                piece.writable = writable and mapped_writable
        self._index[key] = len(self.packed.pieces)
        self.packed.pieces.append(piece)
        return self._index[key]

    def _file_segment(self, path: str, dev: int, ino: int) -> Optional[int]:
        if (dev, ino) in self._files:
            return self._files[(dev, ino)]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (dev, ino):  # replaced since it was mapped: copy what is in memory
            os.close(fd)
            return None
        self.packed.files.append(FileSegment(fd, path, dev, ino))
        self._files[(dev, ino)] = len(self.packed.files) - 1
        return self._files[(dev, ino)]


def pack(obj: Any) -> Packed:
    """``obj`` pickled with its large tensors and arrays by reference (see the module's doc)."""
    packed = Packed(b"")
    buf = io.BytesIO()
    try:
        _SharingPickler(buf, packed).dump(obj)
    finally:
        weakref.finalize(packed, _close_all, [f.fd for f in packed.files])  # the files it holds open
    packed.data = buf.getvalue()
    return packed


# ---- placing ----------------------------------------------------------------------------------
_COPY_CHUNK = 64 * 2**20


def _view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class Placement:
    """The pieces of one ``Packed`` placed for other processes: ``table`` says where. ``release()``
    closes this process's hold (a process that mapped a piece keeps it until it ends)."""

    def __init__(self, table: DataTable, fds: list[int], keep: Any = None) -> None:
        self.table = table
        self._fds = fds
        self._keep = keep  # what must stay alive while the table is in use (the Packed)
        self._closer = weakref.finalize(self, _close_all, fds)
        self.seconds = 0.0

    @classmethod
    def of(cls, packed: Packed, progress: Optional[Callable[[int, int], None]] = None) -> Placement:
        t0 = time.monotonic()
        segments: list[dict[str, Any]] = [_describe(f.fd, f.path) for f in packed.files]
        fds: list[int] = []
        arena = None
        total = packed.copied_bytes
        if total:
            arena = os.memfd_create("ddp-notebook-data", os.MFD_CLOEXEC)
            fds.append(arena)
        try:
            if arena is not None:
                os.ftruncate(arena, _aligned(total + _PAGE * len(packed.pieces)))
                segments.append(_describe(arena, None))
            rows = _copy_pieces(packed, arena, len(segments) - 1, progress)
        except BaseException:  # interrupted: nothing half-made stays held
            _close_all(fds)
            raise
        placement = cls({"segments": segments, "pieces": rows}, fds, keep=packed)
        placement.seconds = time.monotonic() - t0
        return placement

    def release(self) -> None:
        self._closer()


def _copy_pieces(packed: Packed, arena: Optional[int], segment: int,
                 progress: Optional[Callable[[int, int], None]]) -> list[list[Any]]:
    """Copy the pieces that are not in a file into ``arena`` (segment ``segment``), one after the
    other at page boundaries; the table's rows for every piece."""
    rows: list[list[Any]] = []
    total = packed.copied_bytes
    copied = offset = 0
    for piece in packed.pieces:
            if piece.file is not None:
                rows.append([piece.file[0], piece.file[1], piece.nbytes, piece.writable])
                continue
            assert arena is not None
            view = _view(piece.address, piece.nbytes)
            done = 0
            while done < piece.nbytes:  # pwrite takes at most ~2 GB at a time
                done += os.pwrite(arena, view[done:done + _COPY_CHUNK], offset + done)
                if progress is not None:
                    progress(copied + done, total)
            rows.append([segment, offset, piece.nbytes, True])
            copied += piece.nbytes
            offset = _aligned(offset + piece.nbytes)
    return rows


def _aligned(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def _describe(fd: int, path: Optional[str]) -> dict[str, Any]:
    st = os.fstat(fd)
    return {"path": f"/proc/{os.getpid()}/fd/{fd}", "dev": st.st_dev, "ino": st.st_ino,
            "name": path or "shared memory"}


# ---- loading ----------------------------------------------------------------------------------
def open_table(table: DataTable) -> list[int]:
    """Open every segment of ``table`` here (read-only), checking each is the file it was; the
    caller closes them. Raises ``SharedDataError`` naming the segment that cannot be opened."""
    fds: list[int] = []
    try:
        for seg in table.get("segments", []):
            try:
                fd = os.open(seg["path"], os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise SharedDataError(f"cannot open the data in {seg['name']} ({seg['path']}): "
                                      f"{e.strerror or e}") from None
            fds.append(fd)
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (seg["dev"], seg["ino"]):
                raise SharedDataError(f"{seg['name']} ({seg['path']}) is not the file it was when the data was "
                                      "placed (it was replaced)")
    except BaseException:
        _close_all(fds)
        raise
    return fds


class _Mapper:
    """Maps each segment once, over the span its pieces cover (one descriptor per segment: Python's
    mmap keeps a duplicate of it, and a model may have thousands of pieces). A segment is mapped
    copy-on-write unless every piece in it is read-only (a huge read-only file then costs no
    commit charge)."""

    def __init__(self, table: DataTable, fds: list[int]) -> None:
        self.rows = table.get("pieces", [])
        self.fds = fds
        self.memo: dict[int, Any] = {}
        self._maps: dict[int, tuple[mmap.mmap, int]] = {}

    def window(self, index: int) -> tuple[mmap.mmap, int, int, bool]:
        """(the segment's mapping, the piece's offset in it, its size, whether it is writable)."""
        segment, offset, nbytes, writable = self.rows[index]
        if segment not in self._maps:
            rows = [r for r in self.rows if r[0] == segment]
            start = min(r[1] for r in rows)
            start -= start % _PAGE
            end = max(r[1] + r[2] for r in rows)
            access = mmap.ACCESS_COPY if any(r[3] for r in rows) else mmap.ACCESS_READ
            self._maps[segment] = (mmap.mmap(self.fds[segment], end - start, access=access, offset=start), start)
        mm, start = self._maps[segment]
        return mm, offset - start, nbytes, writable


def _rebuild(mapper: _Mapper, index: int, kind: str, meta: Any) -> Any:
    if index in mapper.memo:  # views of one storage stay views of one storage (tied weights)
        return mapper.memo[index]
    mm, delta, nbytes, _writable = mapper.window(index)
    if kind == "storage":
        torch = _torch() or __import__("torch")
        with warnings.catch_warnings():  # a read-only file's tensors are read-only in the notebook too
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=delta).untyped_storage()
        out = torch.storage.TypedStorage(wrap_storage=raw, dtype=meta, _internal=True)
    else:
        np = _numpy() or __import__("numpy")
        dtype, shape, order, was_writable = meta
        out = np.ndarray(shape, dtype=dtype, buffer=mm, offset=delta, order=order)
        if not was_writable and out.flags.writeable:  # read-only where it came from, read-only here
            out.flags.writeable = False
    mapper.memo[index] = out
    return out


class Received:
    """A pickle another process sent, with its pieces still in that process: ``adopt`` opens them
    here at once (while the sender lives), so ``load`` can map them after it has gone.

    >>> Received(pickling.dumps([1, 2])).load()
    [1, 2]
    """

    def __init__(self, data: bytes, table: Optional[DataTable] = None, fds: Optional[list[int]] = None,
                 error: Optional[str] = None) -> None:
        self.data = data
        self.table = table
        self.error = error  # why the pieces could not be opened (load raises it)
        self._fds = fds or []
        self._closer = weakref.finalize(self, _close_all, self._fds)

    @classmethod
    def adopt(cls, data: bytes, table: Optional[DataTable]) -> Received:
        if not table or not table.get("pieces"):
            return cls(data)
        try:
            return cls(data, table, open_table(table))
        except SharedDataError as e:
            return cls(data, table, error=str(e))

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
    def __init__(self, file: io.BytesIO, mapper: _Mapper) -> None:
        super().__init__(file)
        self.mapper = mapper

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 4 and pid[0] == _TAG):
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        return _rebuild(self.mapper, pid[1], pid[2], pid[3])


class _LiveUnpickler(pickle.Unpickler):
    """Unpickles a ``Packed`` in the process that packed it, each piece its own live object."""

    def __init__(self, file: io.BytesIO, packed: Packed) -> None:
        super().__init__(file)
        self.packed = packed

    def persistent_load(self, pid: Any) -> Any:
        return self.packed.pieces[pid[1]].obj


def load(data: bytes, table: Optional[DataTable]) -> Any:
    """Unpickle ``data``, mapping its pieces as ``table`` (from ``Placement.table``) says."""
    if not table or not table.get("pieces"):
        return pickling.loads(data)
    fds = open_table(table)
    try:
        return _MappingUnpickler(io.BytesIO(data), _Mapper(table, fds)).load()
    finally:
        _close_all(fds)  # the mappings hold the memory from here

