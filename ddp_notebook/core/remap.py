"""Moving a buffer's memory onto shared memory in place, so that a call's data is held once.

Once a tensor's bytes are copied into the memfd the ranks map (``transfer.packing``), the pages
wholly inside the tensor are replaced, at the same addresses, by a private (copy-on-write)
mapping of that memfd: its anonymous pages are freed, and the notebook and every rank share one
copy. Nothing else changes for the notebook: the tensor, its views and any NumPy array or raw
pointer onto it still point to the same addresses and read the same bytes; a write makes the
written page the notebook's own again, and the ranks keep what was there at the launch.

This is unlike ``torch.Tensor.share_memory_()``, which moves the data to new addresses and frees
the old ones under any NumPy view of it. It is only done where it is known to be transparent:
memory that torch's or NumPy's own allocator got from glibc's malloc, which treats a mapping it
did not make like any other memory (it unmaps it whole, and never assumes that memory it gave
back with ``MADV_DONTNEED`` reads as zeros). Another malloc in the process (jemalloc, tcmalloc,
mimalloc), memory that CUDA may have pinned, or memory shared with another process, is left as
it is: the data is then held twice while the run lives.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from typing import Any

__all__ = ["movable", "move_pages", "MOVE_FROM", "map_headroom"]

MOVE_FROM = 2**20
"""Smaller buffers are not moved: each move splits a mapping, and the process has a limit on them."""

_PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10
_OTHER_MALLOCS = ("jemalloc", "tcmalloc", "mimalloc", "hoard", "snmalloc")


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc's malloc: see the module's doc
        return None
    try:
        with open("/proc/self/maps") as f:
            if any(name in line for line in f for name in _OTHER_MALLOCS):
                return None
    except OSError:
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return libc


def movable(obj: Any) -> bool:
    """Whether the memory of ``obj`` (a torch ``TypedStorage`` or a NumPy array) may be moved in
    place: allocated by torch's or NumPy's own allocator, shared with no other process, never
    pinned by CUDA (which is only possible once CUDA is initialised). Never raises."""
    try:
        return _libc() is not None and _movable(obj)
    except Exception:  # noqa: BLE001 - an odd object is simply not moved
        return False


def _movable(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.storage.TypedStorage):
        storage = obj._untyped_storage
        if storage.nbytes() < MOVE_FROM:
            return False
        cuda = getattr(torch, "cuda", None)
        # Only torch's CPU allocator makes resizable storages (not from_numpy, from_file or a
        # buffer); pinned memory comes from CUDA's.
        return bool(storage.resizable() and not storage.is_shared()
                    and not (cuda is not None and cuda.is_initialized())
                    and _in_mapped_block(storage.data_ptr(), storage.data_ptr(), storage.nbytes()))
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray) and obj.nbytes >= MOVE_FROM:
        root = obj
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.base is not None or not root.flags.owndata:
            return False  # a view of memory numpy did not allocate (bytes, an Arrow buffer, mmap)
        core = getattr(np, "_core", None) or getattr(np, "core", None)  # numpy 2, numpy 1
        handler_name = getattr(getattr(core, "multiarray", None), "get_handler_name", None)
        # Before numpy 1.22 there was no other allocator than its own.
        return ((handler_name is None or bool(handler_name(root) == "default_allocator"))
                and _in_mapped_block(root.ctypes.data, obj.ctypes.data, obj.nbytes))
    return False


def _in_mapped_block(block: int, address: int, nbytes: int) -> bool:
    """Whether ``block`` (what malloc returned) is a block glibc mapped for it alone, which free()
    unmaps whole (a block from the heap would be reused, and would keep the memfd alive), and
    ``[address, address + nbytes)`` lies inside it. glibc keeps, just before the block, its size
    with an "mmapped" flag (2) and, before that, how far into a page the mapping starts."""
    word = ctypes.c_size_t
    size = word.from_address(block - ctypes.sizeof(word)).value
    lead = word.from_address(block - 2 * ctypes.sizeof(word)).value
    chunk = block - 2 * ctypes.sizeof(word)
    if not size & 2 or size & 4 or (chunk - lead) % _PAGE or lead >= _PAGE:
        return False
    end = chunk + (size & ~7)
    return block <= address and address + nbytes <= end and end % _PAGE == 0


def map_headroom() -> int:
    """How many more mappings this process may have (``vm.max_map_count``), less a margin."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return 0
    return limit - used - 1000


def move_pages(address: int, nbytes: int, fd: int, offset: int) -> None:
    """Map ``fd`` privately over the pages wholly inside ``[address, address + nbytes)``, whose
    bytes are at ``offset`` in ``fd`` (``offset % PAGESIZE == address % PAGESIZE``); the part of a
    page shared with other memory at either end stays as it is."""
    libc = _libc()
    assert libc is not None and offset % _PAGE == address % _PAGE
    lo = (address + _PAGE - 1) // _PAGE * _PAGE
    hi = (address + nbytes) // _PAGE * _PAGE
    if hi <= lo:
        return
    # On failure (MAP_FAILED) the old pages are still there, untouched: the data is only held twice.
    libc.mmap(lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED, fd, offset + (lo - address))
