"""Which memory of this process another process can map instead of being sent a copy: memory
inside a mapping of a regular file, or of shared memory that ``transfer.packing`` placed, whose
pages still say what the file says (none of them written here since: a private mapping's written
pages are this process's own copies, which /proc/self/pagemap tells apart page by page).

>>> FileMappings().find(id(object()), 8) is None  # the heap is no file
True
"""
from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from typing import Optional

__all__ = ["FileMappings", "FileMapping", "OURS"]

OURS = "/memfd:ddp-notebook-data"  # how /proc/self/maps names the shared memory shared_data places
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class FileMapping:
    """Where some memory of this process lies in a file: its path (as the mapping names it), the
    file's identity, the offset of the memory in it, and whether the ranks may map the file
    instead of being sent a copy (``clean``: nothing the notebook wrote differs from the file)."""

    path: str
    dev: int
    ino: int
    offset: int
    writable: bool
    clean: bool


class FileMappings:
    """This process's mappings (/proc/self/maps), read once per pack."""

    def __init__(self) -> None:
        self._rows: Optional[list[tuple[int, int, str, int, int, int, str]]] = None

    def find(self, address: int, nbytes: int) -> Optional[FileMapping]:
        """The mapping of a regular file (or of our shared memory) that holds all of
        ``[address, address + nbytes)``, or None for other memory (anonymous, a deleted file's,
        a device's, or spanning several mappings)."""
        if self._rows is None:
            self._rows = _read_maps()
        for start, end, perms, offset, dev, ino, path in self._rows:
            if start <= address and address + nbytes <= end:
                ours = path.startswith(OURS)
                if ino == 0 or not (ours or path.startswith("/")) or (path.endswith(" (deleted)") and not ours):
                    return None
                # Written through to the file (a shared writable mapping), the notebook's later writes
                # would reach the ranks; copy-on-write pages written since no longer say what the file
                # holds: either way the ranks get a copy, not the file.
                written_through = perms[3] == "s" and perms[1] == "w" and not ours
                written_here = perms[3] == "p" and not unwritten(address, nbytes)
                clean = not (written_through or written_here)
                return FileMapping(path, dev, ino, offset + address - start, perms[1] == "w", clean)
        return None


def _read_maps() -> list[tuple[int, int, str, int, int, int, str]]:
    rows = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 5:
                continue
            if len(parts) == 5:  # anonymous: no name
                parts.append("")
            lo, hi = parts[0].split("-")
            major, minor = parts[3].split(":")
            rows.append((int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), os.makedev(int(major, 16),
                         int(minor, 16)), int(parts[4]), parts[5].rstrip("\n")))
    return rows


def unwritten(address: int, nbytes: int) -> bool:
    """Whether no page of ``[address, address + nbytes)`` is a private copy made by a write here
    (/proc/self/pagemap: a present page that is not the file's, or a swapped one)."""
    first, last = address // _PAGE, (address + max(nbytes, 1) - 1) // _PAGE
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            raw = f.read((last - first + 1) * 8)
    except OSError:
        return False
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # 262,144 entries a GB: a Python loop would take a second per 30 GB
        e = numpy.frombuffer(raw, dtype=numpy.uint64)
        return not bool(((e >> 62) & 1).any() or (((e >> 63) & 1) & ~((e >> 61) & 1)).any())
    return not any(e >> 62 & 1 or (e >> 63 & 1 and not e >> 61 & 1) for e in memoryview(raw).cast("Q"))
