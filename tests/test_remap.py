"""Moving a call's data onto its shared copy in place (core.remap): the notebook holds it once,
and nothing changes for it: same addresses, same bytes, NumPy views and writes as before."""
import gc
import os

import numpy as np
import pytest
import torch

import ddp_notebook
from ddp_notebook.core import remap
from ddp_notebook.transfer.packing import pack

from helpers import mapping_at

MB = 2**20


def mapping_of(address):
    return mapping_at(address)[0]


def anonymous_kb(address, nbytes):
    """Private (anonymous) memory of this process in the mappings over [address, address+nbytes)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not line.startswith(("VmFlags", "Name")):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < address + nbytes and hi > address
        elif inside and line.startswith("Anonymous:"):
            total += int(line.split()[1])
    return total


@pytest.mark.unit
# glibc maps blocks over 32 MB (and smaller ones until it raises its threshold) for them alone:
# only those are moved. A block from the heap is copied, and must read as before all the same.
@pytest.mark.parametrize("size", [MB, 40 * MB + 100, 64 * MB])
def test_a_moved_tensor_reads_and_writes_as_before_and_is_held_once(size):
    for _ in range(5):
        x = torch.arange(size // 4, dtype=torch.float32)
        want = x.clone()
        raw = memoryview((__import__("ctypes").c_char * (size // 4 * 4)).from_address(x.data_ptr()))  # a raw pointer
        placed = pack([x]).place()
        view = x.numpy()
        assert torch.equal(x, want) and (view == want.numpy()).all() and bytes(raw[4:8]) == want[1:2].numpy().tobytes()
        moved = mapping_of(x.data_ptr() + 2 * 4096).startswith("/memfd:ddp-notebook-data")
        assert moved or size < 32 * MB
        float(x.sum())  # every page read: from the shared copy, not a private one
        assert not moved or anonymous_kb(x.data_ptr() + 4096, size - 8192) < 64
        x[size // 8] = -1.0  # a write: that page is the notebook's own again, seen through the view
        assert view[size // 8] == -1.0
        placed.release()
        del x, view
        gc.collect()
        _ = [torch.ones(size // 4) for _ in range(3)]  # the allocator reuses the memory as usual


@pytest.mark.unit
def test_memory_not_from_torch_or_numpy_allocators_is_left_alone():
    kept = bytes(4 * MB)
    arr = np.frombuffer(kept, dtype=np.uint8)  # numpy does not own it
    from_numpy = torch.from_numpy(np.ones(MB))  # torch does not own it
    shared = torch.ones(MB).share_memory_()  # another process may map it
    viewed = torch.ones(MB)
    _numpy_view = viewed.numpy()  # torch then calls it not resizable: it is left alone (and copied)
    small = torch.ones(1000)
    objs = (arr, from_numpy, shared, viewed)
    packed = pack([*objs, small])
    assert [p.movable for p in packed.pieces] == [False] * 4  # (small is pickled)
    before = [mapping_of(o.ctypes.data if isinstance(o, np.ndarray) else o.data_ptr()) for o in objs]
    packed.place().release()
    after = [mapping_of(o.ctypes.data if isinstance(o, np.ndarray) else o.data_ptr()) for o in objs]
    assert before == after and not any("ddp-notebook-data" in m for m in after)
    big = np.ones(5 * MB)  # 40 MB: a block of its own
    assert remap.movable(big) and remap.movable(big[10:])  # a view of an owned array


def snapshot(ctx, x, flag):
    """Read x only once the notebook has written to it after the launch."""
    import time

    while not os.path.exists(flag):
        time.sleep(0.01)
    return [float(x[0]), float(x[-1])]


@pytest.mark.processes
def test_ranks_keep_the_data_of_the_launch_when_the_notebook_writes_after_it(tmp_path):
    x = torch.ones(40 * MB // 4)  # a block of its own (see above)
    run = ddp_notebook.launch(snapshot, devices="cpu*2", args=(x, str(tmp_path / "go")))
    assert mapping_of(x.data_ptr() + 8192).startswith("/memfd:ddp-notebook-data")  # moved: held once
    view = x.numpy()
    x[0] = 5.0
    view[-1] = 6.0
    (tmp_path / "go").touch()
    assert run.wait(timeout=120) == [1.0, 1.0]
    assert float(x[0]) == 5.0 and float(x[-1]) == 6.0 and view[0] == 5.0
