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
>>> from ddp_notebook.transfer.loading import load  # in the process that maps them
>>> out = load(packed.data, placed.table)
>>> float(out["x"][-1]), out["n"]
(65535.0, 3)
>>> placed.release()
"""
from __future__ import annotations

import ctypes
import functools
import io
import mmap
import os
import pickle
import stat
import sys
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from ..core.errors import SharedDataError
from . import pickling
from .file_mappings import OURS, FileMapping, FileMappings
from .queues import is_queue

__all__ = ["MIN_SHARED", "Piece", "Packed", "Placement", "SharedDataError", "pack", "supported", "DataTable",
           "close_all", "TAG", "PAGE"]

MIN_SHARED = 64 * 1024
"""Smaller tensors and arrays are pickled by value: a reference costs more than it saves."""

TAG = "ddp-notebook-data"
PAGE = mmap.ALLOCATIONGRANULARITY

# What a process is told about the pieces of a call: where each segment is and, per piece, its
# segment, offset, size and whether it is mapped writable (copy-on-write) or read-only. JSON.
DataTable = dict[str, Any]


def supported() -> bool:
    """Whether pieces can be shared here: Linux (memfd and /proc/PID/fd), in a process that other
    processes of its user may look into (not made undumpable: then /proc/PID/fd is closed to them)."""
    if not (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(3, 0, 0, 0, 0) == 1  # PR_GET_DUMPABLE
    except (OSError, AttributeError):
        return False


def _untyped(storage: Any) -> Any:
    """The bytes of a ``TypedStorage``. torch pickles every tensor through a TypedStorage, whose
    public methods warn once that TypedStorage is deprecated: a warning about torch's own use of
    it, not the user's, so it is not let through."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return storage.untyped()


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
    path: Optional[str]  # None: shared memory placed earlier (by ddp_notebook.share, or a result)
    dev: int
    ino: int


@dataclass(eq=False)
class Packed:
    """A pickle with its large tensors and arrays by reference. ``data`` alone unpickles nowhere:
    ``place()`` makes the table that ``shared_load.load`` needs."""

    data: bytes
    pieces: list[Piece] = field(default_factory=list)
    files: list[FileSegment] = field(default_factory=list)
    queues: list[Any] = field(default_factory=list)  # multiprocessing queues, by reference (transfer.queues)
    _closer: Optional[Callable[[], Any]] = field(default=None, repr=False)  # closes the files it holds

    @property
    def shared_bytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def in_place_bytes(self) -> int:
        """Bytes of pieces already in shared memory: sent with no copy."""
        ours = {i for i, f in enumerate(self.files) if f.path is None}
        return sum(p.nbytes for p in self.pieces if p.file is not None and p.file[0] in ours)

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
        if self.queues:
            raise SharedDataError("a multiprocessing queue in the call carries items from local workers only, not "
                                  "from another machine's (an ipyparallel engine): return the items instead")
        if not self.pieces:
            return self.data
        return pickling.dumps(_LiveUnpickler(io.BytesIO(self.data), self).load())


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# ---- packing ----------------------------------------------------------------------------------
def _torch() -> Any:
    return sys.modules.get("torch")  # no tensor exists in a process that never imported torch


def _numpy() -> Any:
    return sys.modules.get("numpy")


class _SharingPickler(pickling.Pickler):
    """cloudpickle, with large CPU storages and plain contiguous arrays as ``Piece`` references."""

    def __init__(self, file: io.BytesIO, packed: Packed) -> None:
        super().__init__(file, protocol=pickling.PROTOCOL)
        self.packed = packed
        self._index: dict[tuple[int, int, tuple[Any, ...]], int] = {}
        self._maps = FileMappings()
        self._files: dict[tuple[int, int], int] = {}
        self._by_path = supported()

    def persistent_id(self, obj: Any) -> Any:
        if is_queue(obj):  # the worker gets a QueueEnd that sends to this very queue
            queues = self.packed.queues
            index = next((i for i, q in enumerate(queues) if q is obj), None)
            if index is None:
                index = len(queues)
                queues.append(obj)
            return (TAG, index, "queue", None)
        torch, np = _torch(), _numpy()
        if torch is not None and isinstance(obj, torch.UntypedStorage):  # how torch pickles uint16, float8...
            if obj.device.type != "cpu" or obj.nbytes() < MIN_SHARED:
                return None
            index = self._piece(obj, obj.data_ptr(), obj.nbytes(), True, ("storage",))
            return (TAG, index, "untyped", None)
        if torch is not None and isinstance(obj, torch.storage.TypedStorage):
            storage = _untyped(obj)
            if storage.device.type != "cpu" or storage.nbytes() < MIN_SHARED:
                return None
            # One piece per storage, whatever dtype each reference views it as (a dtype view of
            # the same memory is another TypedStorage over the same bytes).
            index = self._piece(obj, storage.data_ptr(), storage.nbytes(), True, ("storage",))
            return (TAG, index, "storage", obj.dtype)
        if (np is not None and type(obj) in (np.ndarray, np.memmap) and obj.nbytes >= MIN_SHARED
                and not obj.dtype.hasobject and (obj.flags.c_contiguous or obj.flags.f_contiguous)):
            order = "C" if obj.flags.c_contiguous else "F"
            meta = (obj.dtype, obj.shape, order, bool(obj.flags.writeable))
            # An array is its memory and how it reads it: views of the same bytes with another
            # dtype, shape or order are pieces of their own.
            index = self._piece(obj, obj.ctypes.data, obj.nbytes, bool(obj.flags.writeable), ("array", meta))
            return (TAG, index, "array", meta)
        return None

    def _piece(self, obj: Any, address: int, nbytes: int, writable: bool, what: tuple[Any, ...]) -> int:
        key = (address, nbytes, what)
        if key in self._index:
            return self._index[key]
        piece = Piece(obj, address, nbytes, writable)
        mapping = self._maps.find(address, nbytes) if self._by_path else None
        if mapping is not None:
            # Memory mapped from a file reads the file: a file cut short since it was mapped would
            # kill this process (SIGBUS) at the first page past its end, whether the piece is copied
            # here or sent by reference (a rank reading it would die instead).
            segment = self._file_segment(mapping, nbytes)
            if mapping.clean:
                piece.file = (segment, mapping.offset)
                piece.writable = writable and mapping.writable
        self._index[key] = len(self.packed.pieces)
        self.packed.pieces.append(piece)
        return self._index[key]

    def _file_segment(self, mapping: FileMapping, nbytes: int) -> int:
        """The segment of the file that ``mapping`` maps (kept only when it is ``clean``: the ranks
        then map it), once checked to be the very file mapped and to hold all ``nbytes`` of the
        piece: ``SharedDataError`` naming it otherwise. -1 for a file only checked."""
        key = (mapping.dev, mapping.ino)
        if key in self._files:
            fd = self.packed.files[self._files[key]].fd
        else:
            opened = _open_same(mapping.path, mapping.dev, mapping.ino)
            if opened is None:
                raise SharedDataError(
                    f"data in the call is mapped from {mapping.path}, which was deleted or replaced since it was "
                    "mapped: ddp_notebook does not read a mapped file it cannot check (reading one that was cut "
                    "short would crash the notebook). Load the file again (np.load(..., mmap_mode='r'), "
                    "torch.load(..., mmap=True)) and launch again")
            fd = opened
        try:
            size = os.fstat(fd).st_size
            if size < mapping.offset + nbytes:
                raise SharedDataError(
                    f"data in the call is mapped from {mapping.path}, which is now {size} bytes long but held data "
                    f"up to byte {mapping.offset + nbytes} when it was mapped: the file was cut short (rewritten) "
                    "since it was loaded, and reading the data would crash the notebook. Load the file again and "
                    "launch again")
        except BaseException:
            if key not in self._files:
                os.close(fd)
            raise
        if key in self._files:
            return self._files[key]
        if not mapping.clean:  # checked only: the piece is copied from memory
            os.close(fd)
            return -1
        self.packed.files.append(FileSegment(fd, None if mapping.path.startswith(OURS) else mapping.path,
                                             mapping.dev, mapping.ino))
        self._files[key] = len(self.packed.files) - 1
        return self._files[key]


def _open_same(path: str, dev: int, ino: int) -> Optional[int]:
    """A read-only descriptor on the file mapped at ``path`` (dev, ino): by its path, or for shared
    memory we placed, through a descriptor of this process that holds it (a mapping keeps one)."""
    if path.startswith(OURS):
        candidates = [f"/proc/self/fd/{n}" for n in os.listdir("/proc/self/fd")]
    else:
        candidates = [path]
    for candidate in candidates:
        try:
            st = os.stat(candidate)
            if (st.st_dev, st.st_ino) != (dev, ino) or not stat.S_ISREG(st.st_mode):
                continue  # a device's memory is not a file's contents
            fd = os.open(candidate, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (dev, ino):
            return fd
        os.close(fd)
    return None


@functools.lru_cache(maxsize=1)
def _allow_more_files() -> None:
    """Raise this process's soft limit on open files to its hard limit (at most 65536), once, at
    its first pack (a limit set later is the user's to keep): each file a call's data stays in,
    and each segment a result is mapped from, holds one descriptor, and 1024 is a common soft
    limit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def pack(obj: Any) -> Packed:
    """``obj`` pickled with its large tensors and arrays by reference (see the module's doc)."""
    packed = Packed(b"")
    buf = io.BytesIO()
    _allow_more_files()
    try:
        _SharingPickler(buf, packed).dump(obj)
    finally:
        packed._closer = weakref.finalize(packed, close_all, [f.fd for f in packed.files])  # the files it holds open
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
        self._closer = weakref.finalize(self, close_all, fds)
        self.seconds = 0.0

    @classmethod
    def of(cls, packed: Packed, progress: Optional[Callable[[int, int], None]] = None) -> Placement:
        t0 = time.monotonic()
        segments: list[dict[str, Any]] = [_describe(f.fd, f.path) for f in packed.files]
        fds: list[int] = []
        try:
            rows = _copy_pieces(packed, segments, fds, progress)
        except BaseException:  # interrupted: nothing half-made stays held
            close_all(fds)
            raise
        placement = cls({"segments": segments, "pieces": rows}, fds, keep=packed)
        placement.seconds = time.monotonic() - t0
        return placement

    def release(self) -> None:
        self._closer()


def _new_memfd(size: int, segments: list[dict[str, Any]], fds: list[int]) -> tuple[int, int]:
    """A new memfd of ``size`` bytes, held in ``fds`` and described in ``segments``: (fd, segment)."""
    fd = os.memfd_create("ddp-notebook-data", os.MFD_CLOEXEC)
    fds.append(fd)
    os.ftruncate(fd, size)
    segments.append(_describe(fd, None))
    return fd, len(segments) - 1


def _copy_pieces(packed: Packed, segments: list[dict[str, Any]], fds: list[int],
                 progress: Optional[Callable[[int, int], None]]) -> list[list[Any]]:
    """Copy the pieces that are not in a file, one after the other, into one new memfd; the
    table's rows for every piece. Each piece sits at the same place in a page as in memory, so it
    keeps its alignment (SIMD kernels read aligned data faster). The notebook's memory is only
    read: the notebook keeps its data and the ranks map the copy, so while the run lives the data
    is held twice (``share()`` holds it once)."""
    rows: list[list[Any]] = []
    total = packed.copied_bytes
    arena: Optional[tuple[int, int]] = None
    copied = offset = 0
    for piece in packed.pieces:
        if piece.file is not None:
            rows.append([piece.file[0], piece.file[1], piece.nbytes, piece.writable])
            continue
        if arena is None:
            arena = _new_memfd(_aligned(sum(p.nbytes + PAGE for p in packed.pieces if p.file is None)), segments, fds)
        (fd, segment), start = arena, offset + piece.address % PAGE
        offset = _aligned(start + piece.nbytes)
        view = _view(piece.address, piece.nbytes)
        done = 0
        while done < piece.nbytes:  # pwrite takes at most ~2 GB at a time
            done += os.pwrite(fd, view[done:done + _COPY_CHUNK], start + done)
            if progress is not None:
                progress(copied + done, total)
        rows.append([segment, start, piece.nbytes, True])
        copied += piece.nbytes
    return rows


def _aligned(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _describe(fd: int, path: Optional[str]) -> dict[str, Any]:
    """A segment as the table gives it: where to open it, what it must be, how to name it. A file's
    size and time of change are checked where it is mapped: it must not be rewritten meanwhile."""
    st = os.fstat(fd)
    seg = {"path": f"/proc/{os.getpid()}/fd/{fd}", "dev": st.st_dev, "ino": st.st_ino, "name": path or "shared memory"}
    if path is not None:
        seg.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
    return seg


class _LiveUnpickler(pickle.Unpickler):
    """Unpickles a ``Packed`` in the process that packed it, each piece its own live object."""

    def __init__(self, file: io.BytesIO, packed: Packed) -> None:
        super().__init__(file)
        self.packed = packed

    def persistent_load(self, pid: Any) -> Any:
        if pid[2] == "queue":
            return self.packed.queues[pid[1]]
        obj = self.packed.pieces[pid[1]].obj
        torch = _torch()
        if torch is not None and isinstance(obj, (torch.UntypedStorage, torch.storage.TypedStorage)):
            raw = obj if isinstance(obj, torch.UntypedStorage) else _untyped(obj)
            dtype = torch.uint8 if pid[2] == "untyped" else pid[3]  # (bytes: as torch pickles uint16, float8...)
            if not isinstance(obj, torch.storage.TypedStorage) or obj.dtype != dtype:  # another view of the bytes
                return torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)
        return obj
