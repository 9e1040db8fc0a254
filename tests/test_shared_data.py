"""Tensors and arrays by reference (transfer.packing): packed, placed once, mapped copy-on-write.

The unit tests pack, place and load in this process (its own /proc/PID/fd); the process tests
check what real ranks map, what comes back, and that nothing is left when a worker or the
notebook dies."""
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
import torch

import ddp_notebook
from ddp_notebook.transfer.loading import load
from ddp_notebook.transfer.packing import MIN_SHARED, SharedDataError, pack
from ddp_notebook.ui.text import format_run

import faults
from helpers import has_ended, mapping_at, wait_until

BIG = MIN_SHARED // 4  # float32 elements: exactly MIN_SHARED bytes


def roundtrip(obj):
    packed = pack(obj)
    placed = packed.place()
    try:
        return packed, load(packed.data, placed.table)
    finally:
        placed.release()


def my_memfds():
    """This process's open descriptors on shared data (memfds named by shared_data)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ddp-notebook-data"):
                out.append(fd)
        except OSError:
            pass
    return out


@pytest.mark.unit
def test_a_multiprocessing_queue_travels_as_a_reference_and_only_to_local_workers():
    import multiprocessing

    from ddp_notebook.transfer.queues import QueueEnd

    queue = multiprocessing.SimpleQueue()
    packed, (first, second, plain) = roundtrip((queue, queue, 3))
    assert packed.queues == [queue] and isinstance(first, QueueEnd) and first.index == second.index == 0
    assert plain == 3 and load(packed.data, None)[0].index == 0  # with no tensors, no table either
    for use in (lambda: first.put(1), first.get, first.empty, first.qsize):  # outside a worker
        with pytest.raises(ddp_notebook.errors.QueueUseError, match="not connected here"):
            use()
    with pytest.raises(SharedDataError, match="carries items from local workers only"):
        packed.inline()  # an ipyparallel engine's call is sent by value


@pytest.mark.unit
def test_tensors_views_and_tied_weights_map_one_storage_each():
    x = torch.randn(BIG, 4)
    a, b = torch.nn.Linear(128, 128), torch.nn.Linear(128, 128)
    b.weight = a.weight  # tied
    ds = torch.utils.data.TensorDataset(x, torch.arange(BIG))
    packed, out = roundtrip({"x": x, "tail": x[10:], "a": a, "b": b, "ds": ds, "small": torch.ones(3)})
    assert [p.nbytes for p in packed.pieces] == [x.nbytes, a.weight.nbytes, BIG * 8]  # each storage once
    assert len(packed.data) < 10_000  # the pickle itself holds none of the data
    assert torch.equal(out["x"], x) and torch.equal(out["tail"], x[10:]) and torch.equal(out["small"], torch.ones(3))
    assert out["tail"].untyped_storage().data_ptr() == out["x"].untyped_storage().data_ptr()
    assert out["ds"].tensors[0].untyped_storage().data_ptr() == out["x"].untyped_storage().data_ptr()
    assert out["b"].weight is out["a"].weight and isinstance(out["a"].weight, torch.nn.Parameter)
    out["x"][0, 0] = 1e9  # copy-on-write: the source is untouched
    assert x[0, 0] != 1e9


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_every_dtype_travels(dtype):
    x = (torch.rand(MIN_SHARED) * 10).to(dtype)
    _, out = roundtrip([x])
    assert out[0].dtype == dtype and torch.equal(out[0], x)


@pytest.mark.unit
def test_numpy_arrays_keep_order_dtype_and_read_only_flag():
    c = np.arange(MIN_SHARED, dtype=np.float64).reshape(-1, 64)
    f = np.asfortranarray(c)
    ro = np.ones(MIN_SHARED, dtype=np.int32)
    ro.flags.writeable = False
    rec = np.zeros(MIN_SHARED // 8, dtype=[("a", "<i4"), ("b", "<f4")])
    strided = c[:, ::2]  # not contiguous: by value
    objects = np.array([{"k": i} for i in range(MIN_SHARED)], dtype=object)  # by value
    packed, out = roundtrip([c, f, ro, rec, strided, objects])
    assert len(packed.pieces) == 4
    for got, want in zip(out, [c, f, ro, rec, strided, objects]):
        assert got.dtype == want.dtype and got.shape == want.shape and (got == want).all()
    assert out[1].flags.f_contiguous and not out[2].flags.writeable and out[0].flags.writeable


@pytest.mark.unit
def test_a_clean_memmap_travels_by_path_and_a_written_one_by_value(tmp_path):
    path = tmp_path / "x.f32"
    np.arange(4 * MIN_SHARED, dtype=np.float32).tofile(path)
    clean = np.memmap(path, dtype=np.float32, mode="r")
    written = np.memmap(path, dtype=np.float32, mode="c", offset=4 * MIN_SHARED)
    written[0] = -1.0  # only in this process's copy-on-write pages: the file does not say it
    packed, out = roundtrip([clean[MIN_SHARED:], written])
    assert [p.file is not None for p in packed.pieces] == [True, False]
    assert packed.files[0].path == str(path) and packed.copied_bytes == written.nbytes
    assert (out[0] == clean[MIN_SHARED:]).all() and not out[0].flags.writeable
    assert out[1][0] == -1.0 and (out[1][1:] == written[1:]).all()


@pytest.mark.unit
def test_torch_from_file_and_mmap_load_travel_by_path(tmp_path):
    x = torch.randn(MIN_SHARED)
    torch.save({"w": x}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", mmap=True)
    packed, out = roundtrip(loaded)
    assert packed.copied_bytes == 0 and packed.files[0].path == str(tmp_path / "ckpt.pt")
    assert torch.equal(out["w"], x)
    out["w"].add_(1)  # a private copy of the page, not the file
    assert torch.equal(torch.load(tmp_path / "ckpt.pt")["w"], x)


@pytest.mark.unit
def test_shared_data_is_sent_again_with_no_copy_until_it_is_written():
    x, arr = torch.randn(4 * BIG), np.arange(MIN_SHARED, dtype=np.int64)
    model = torch.nn.Linear(256, 256)
    sx, sarr, smodel = ddp_notebook.share((x, arr, model))
    assert torch.equal(sx, x) and (sarr == arr).all() and torch.equal(smodel.weight, model.weight)
    packed = pack({"x": sx, "ds": torch.utils.data.TensorDataset(sx), "arr": sarr, "w": smodel.weight})
    assert packed.copied_bytes == 0 and packed.in_place_bytes == x.nbytes + arr.nbytes + model.weight.nbytes
    placed = packed.place()
    out = load(packed.data, placed.table)
    placed.release()
    assert torch.equal(out["x"], x) and torch.equal(out["ds"].tensors[0], x) and (out["arr"] == arr).all()
    sx[-1] = 7.0  # written here: that page is this process's own now, so x is copied again (its new value)
    again = pack([sx, sarr])
    assert again.copied_bytes == x.nbytes and again.in_place_bytes == arr.nbytes
    assert ddp_notebook.share(3) == 3 and ddp_notebook.share(torch.ones(3)) is not None


@pytest.mark.unit
def test_views_of_the_same_bytes_with_another_dtype_shape_or_order_stay_what_they_are():
    a = np.arange(MIN_SHARED // 8, dtype=np.float64)
    t = torch.randn(MIN_SHARED // 4)
    objs = (a, a.view(np.int64), a.reshape(64, -1), a.reshape(64, -1).T,
            t, t.view(torch.int32), t.view(torch.uint8)[8:], torch.view_as_complex(t.view(-1, 2)))
    _, out = roundtrip(objs)
    by_value = ddp_notebook.transfer.pickling.loads(pack(objs).inline())
    for got in (out, by_value):
        for g, want in zip(got, objs):
            assert g.dtype == want.dtype and tuple(g.shape) == tuple(want.shape)
            assert (g == want).all()
    assert out[5].untyped_storage().data_ptr() == out[4].untyped_storage().data_ptr()  # one storage


@pytest.mark.unit
def test_a_file_mapped_for_writing_is_copied_and_a_rewritten_one_refused(tmp_path):
    path = tmp_path / "x.f32"
    np.zeros(MIN_SHARED, dtype=np.float32).tofile(path)
    shared = np.memmap(path, dtype=np.float32, mode="r+")  # the notebook's writes go to the file
    assert pack(shared).copied_bytes == shared.nbytes
    packed = pack(np.memmap(path, dtype=np.float32, mode="r"))
    placed = packed.place()
    np.ones(MIN_SHARED, dtype=np.float32).tofile(path)  # rewritten in place before a rank maps it
    with pytest.raises(SharedDataError, match=r"x.f32 was rewritten since the run was launched"):
        load(packed.data, placed.table)
    placed.release()


@pytest.mark.unit
def test_a_replaced_file_is_refused_by_name(tmp_path):
    path = tmp_path / "x.f32"
    np.zeros(MIN_SHARED, dtype=np.float32).tofile(path)
    packed = pack(np.memmap(path, dtype=np.float32, mode="r"))
    placed = packed.place()
    table = placed.table
    table["segments"][0]["ino"] += 1  # as if another file were there now
    with pytest.raises(SharedDataError, match=rf"{path} .*is not the file it was"):
        load(packed.data, table)
    placed.release()


@pytest.mark.unit
def test_inline_is_the_same_object_by_value():  # what an engine gets
    x = torch.randn(BIG)
    packed = pack({"x": x, "v": x[5:]})
    plain = ddp_notebook.transfer.pickling.loads(packed.inline())
    assert torch.equal(plain["x"], x) and torch.equal(plain["v"], x[5:])


@pytest.mark.unit
def test_release_closes_the_shared_memory_and_an_interrupted_copy_leaves_none():
    before = my_memfds()
    placed = pack(torch.zeros(BIG)).place()
    assert len(my_memfds()) == len(before) + 1
    placed.release()
    assert my_memfds() == before

    def interrupt(sent, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pack([torch.zeros(BIG), torch.zeros(BIG)]).place(interrupt)
    assert my_memfds() == before


@pytest.mark.processes
def test_another_user_cannot_open_the_shared_memory():
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    placed = pack(torch.zeros(BIG)).place()
    path = placed.table["segments"][0]["path"]
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                            f"open({path!r}, 'rb')"], capture_output=True, text=True)
    placed.release()
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe.stderr


# ---- real ranks -------------------------------------------------------------------------------
def what_ranks_map(ctx, x, arr, mm, ds):
    """Each rank: the values it sees, where they live, and that its writes stay its own."""
    import torch.distributed as dist

    maps = open("/proc/self/maps").read()
    seen = (float(x.sum()), float(arr.sum()), float(mm.sum()), int(ds.tensors[1].sum()))
    same_storage = ds.tensors[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    if ctx.rank == 1:
        x.zero_()
    dist.barrier()
    return {ctx.rank: seen} if ctx.rank else {"seen": seen, "x0_after_peer_wrote": float(x[0, 0]),
                                              "memfd": "/memfd:ddp-notebook-data" in maps, "file": "mm.f64" in maps,
                                              "same_storage": same_storage,
                                              "weights": {"w": torch.full((512, 512), 2.0), "b": torch.ones(512)}}


@pytest.mark.processes
def test_ranks_map_the_data_share_it_and_keep_their_writes(tmp_path):
    x = torch.ones(512, 256)
    arr = np.full((300, 300), 2.0)
    path = tmp_path / "mm.f64"
    np.full(70_000, 3.0).tofile(path)
    mm = np.memmap(path, dtype=np.float64, mode="r")
    ds = torch.utils.data.TensorDataset(x, torch.arange(512))
    run = ddp_notebook.launch(lambda ctx, *a: what_ranks_map(ctx, *a), devices="cpu*2", args=(x, arr, mm, ds))
    out = run.wait(timeout=120)
    assert out["seen"] == (x.sum().item(), arr.sum(), 210_000.0, sum(range(512)))
    assert out["memfd"] and out["file"] and out["same_storage"]
    assert out["x0_after_peer_wrote"] == 1.0  # rank 1's zero_() stayed in rank 1
    data = run.state.data
    assert data.total == x.nbytes + arr.nbytes and data.files == [str(path)] and data.seconds is not None
    # The result came back through the worker's shared memory: mapped here, not copied.
    assert torch.equal(out["weights"]["w"], torch.full((512, 512), 2.0))
    name, inode = mapping_at(out["weights"]["w"].data_ptr())
    assert name.startswith("/memfd:ddp-notebook-data")
    out["weights"]["w"].add_(1)  # private pages, as any tensor
    del out
    run._loaded = None
    gc.collect()  # once the result is dropped, nothing of its shared memory is left here
    assert my_memfds() == [] and f" {inode} " not in open("/proc/self/maps").read()
    assert (run.dir.path and os.path.exists(os.path.join(run.dir.path, "result.pkl")))


@pytest.mark.processes
def test_a_worker_killed_with_data_mapped_leaves_nothing_held():
    before = my_memfds()
    run = ddp_notebook.launch(faults.data_steps, devices="cpu*2", args=(torch.ones(1024, 1024),),
                              kwargs=dict(fault="sigkill", bad_rank=1))
    with pytest.raises(ddp_notebook.WorkerFailedError, match="worker 1 .*SIGKILL"):
        run.wait(timeout=120)
    assert my_memfds() == before and all(has_ended(w.pid) for w in run.workers)
    retry = run.retry(devices=["cpu:0"])  # the same data, placed again from the tensor the run keeps
    assert retry.wait(timeout=120) == [1.0, 1.0]
    assert retry.state.data.total == 2**22 and my_memfds() == before


NOTEBOOK = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    import ddp_notebook, faults
    run = ddp_notebook.launch(faults.hold_data, devices="cpu*2", args=(torch.ones(400 * 2**20 // 4),))
    while run.state.status != "running":
        time.sleep(0.05)
    print(" ".join(str(w.pid) for w in run.workers), flush=True)
    time.sleep(600)
""")


def shmem_bytes():
    for line in open("/proc/meminfo"):
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


@pytest.mark.processes
def test_the_notebook_dying_frees_the_shared_memory():
    baseline = shmem_bytes()
    nb = subprocess.Popen([sys.executable, "-c", NOTEBOOK.format(tests=os.path.dirname(__file__))],
                          stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in nb.stdout.readline().split()]
    assert len(pids) == 2 and shmem_bytes() > baseline + 300 * 2**20  # 400 MB placed once, not per rank
    nb.send_signal(signal.SIGKILL)
    nb.wait()
    nb.stdout.close()
    psutil.wait_procs([psutil.Process(p) for p in pids if not has_ended(p)], timeout=30)
    assert all(has_ended(p) for p in pids)
    gc.collect()
    wait_until(lambda: shmem_bytes() < baseline + 100 * 2**20, timeout=30)  # nothing left in /dev/shm or anywhere



@pytest.mark.processes
def test_a_long_copy_shows_while_launch_makes_it(capsys):
    from ddp_notebook.lifecycle.sending import SHOWN_FROM, show_while_sending
    from ddp_notebook.ui.display import show_sending

    show_while_sending(show_sending)  # as the front end registers it (stderr outside a notebook)
    try:
        run = ddp_notebook.launch(faults.data_steps, devices="cpu*2", args=(torch.ones(SHOWN_FROM // 4),))
        assert run.wait(timeout=120) == [32.0, 32.0]
    finally:
        show_while_sending(None)
    err = capsys.readouterr().err
    # stderr is not a terminal here: two whole lines, no carriage returns
    assert "sending data 0 B/268 MB\n" in err and "\ndata: 268 MB copied to shared memory in " in err, err
    assert "\r" not in err, err
    assert "\n  data: 268 MB copied to shared memory in " in format_run(run.state)  # the text view says it too


def sum_of(ctx, x):
    return float(x.sum())


@pytest.mark.processes
def test_a_result_goes_to_the_next_run_with_no_copy():
    weights = ddp_notebook.launch(big_result, devices="cpu*2").wait(timeout=120)
    run = ddp_notebook.launch(sum_of, devices="cpu*2", args=(weights,))
    assert run.wait(timeout=120) == 17 * 2**20
    assert (run.state.data.total, run.state.data.in_place) == (0, 68 * 2**20 // 4 * 4)
    assert "data: 71 MB already in shared memory (no copy)" in format_run(run.state)


def big_result(ctx):
    return torch.ones(17 * 2**20) if ctx.rank == 0 else None


@pytest.mark.processes
def test_a_result_over_the_kept_limit_is_not_written_to_disk_and_a_reload_says_so():
    run = ddp_notebook.launch(big_result, devices="cpu*2")
    assert run.wait(timeout=120).sum() == 17 * 2**20  # in hand here, mapped from the worker's memfd
    assert not os.path.exists(os.path.join(run.run_dir, "result.pkl"))
    with pytest.raises(ddp_notebook.errors.NoResultError, match=r"returned a result of 68 MB, which was not kept on disk "
                                                         r"\(results over 64 MB with tensors are not\)"):
        ddp_notebook.Run.load(run.run_dir).result()


@pytest.mark.processes
def test_only_the_last_runs_given_data_keep_it_for_a_retry():
    from ddp_notebook.lifecycle.launch import KEEP_DATA_OF

    runs = [ddp_notebook.launch(faults.data_steps, devices="cpu*2", args=(torch.ones(2**16),),
                                kwargs=dict(fault="raise", bad_rank=1)) for _ in range(KEEP_DATA_OF + 1)]
    for run in runs:
        with pytest.raises(ddp_notebook.WorkerFailedError):
            run.wait(timeout=120)
    with pytest.raises(ddp_notebook.DDPNotebookError, match=rf"run {runs[0].id} cannot be retried: it no longer holds "
                                                           rf"the tensors and arrays it was given: only the last "
                                                           rf"{KEEP_DATA_OF} runs given data keep theirs"):
        runs[0].retry()
    assert runs[1].retry(devices=["cpu:0"]).wait(timeout=120) == [1.0, 1.0]  # sent again from the tensor it keeps
    done = ddp_notebook.launch(sum_of, devices="cpu*2", args=(torch.ones(2**16),))
    assert done.wait(timeout=120) == 2**16
    with pytest.raises(ddp_notebook.DDPNotebookError, match=rf"run {done.id} cannot be retried: run {done.id} "
                                                           r"succeeded and let go of the tensors and arrays"):
        done.retry()


def log_then_return(ctx):
    ctx.log(step=1)
    ctx.flush()
    if ctx.rank == 1:  # keeps rank 0 alive after it sent its result (a rank waits for every rank to be done),
        time.sleep(120)  # however late a loaded machine delivers its progress: the kill always finds it
    return torch.ones(2**20) if ctx.rank == 0 else None


@pytest.mark.processes
def test_a_main_worker_killed_after_sending_its_result_is_blamed_for_its_death():
    import signal
    import time

    for _ in range(3):
        run = ddp_notebook.launch(log_then_return, devices="cpu*2")
        killed = []

        def hold(event, run=run, killed=killed):  # a busy supervisor while rank 0 sends its result and dies
            if event.get("kind") == "progress" and event.get("rank") == 0 and not killed:
                time.sleep(1.0)
                pid = run.state.workers[0].pid
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                wait_until(lambda: has_ended(pid), timeout=30)

        run.subscribe(hold)
        with pytest.raises(ddp_notebook.WorkerFailedError, match=r"main worker \(cpu:0\) failed: .*SIGKILL"):
            run.wait(timeout=120)
        assert killed and run.failures[0].rank == 0


@pytest.mark.processes
def test_a_retry_sends_what_shared_data_holds_now():
    x = ddp_notebook.share(torch.zeros(2**18))
    run = ddp_notebook.launch(faults.data_steps, devices="cpu*2", args=(x,), kwargs=dict(fault="raise", bad_rank=1))
    with pytest.raises(ddp_notebook.WorkerFailedError):
        run.wait(timeout=120)
    assert run.state.data.in_place == x.nbytes
    x += 1  # in place, in the notebook: a retry must see it
    retry = run.retry(devices=["cpu:0"])
    assert retry.wait(timeout=120) == [1.0, 1.0]  # data_steps checks that the data sums to its size
    assert retry.state.data.total == x.nbytes and retry.state.data.in_place == 0


# ---- the notebook's data stays the notebook's -----------------------------------------------------
@pytest.mark.processes
def test_writes_another_thread_makes_while_launch_sends_the_data_are_never_lost():
    import threading

    x = torch.zeros(2**24)  # 64 MB: the copy takes long enough to race with the thread
    per_page = mmap_page() // x.element_size()
    pages = x.numel() // per_page
    marked = []
    go = threading.Event()

    def mark():
        go.wait()
        for page in range(pages):  # one float per page, in order, while launch copies the tensor
            x[page * per_page] = 1.0
            marked.append(page)

    thread = threading.Thread(target=mark)
    thread.start()
    go.set()
    run = ddp_notebook.launch(faults.takes_arg, devices="cpu*2", args=(x,))
    thread.join()
    run.wait(timeout=120)
    assert len(marked) == pages
    lost = [p for p in marked if x[p * per_page] != 1.0]
    assert not lost, f"{len(lost)} of {pages} marks were lost"


def mmap_page():
    import mmap

    return mmap.PAGESIZE


@pytest.mark.processes
def test_a_retry_sends_the_model_as_it_is_now_every_piece_alike():
    net = torch.nn.Linear(1000, 1000)  # the weight (4 MB) travels by reference, the bias (4 kB) by value
    run = ddp_notebook.launch(faults.means_unless_two, devices="cpu*2", args=(net,))
    with pytest.raises(ddp_notebook.WorkerFailedError, match="the first try fails"):
        run.wait(timeout=120)
    with torch.no_grad():
        net.weight.fill_(1.0)
        net.bias.fill_(1.0)
    assert run.retry().wait(timeout=120) == (1.0, 1.0)  # one state: the model as it is now


@pytest.mark.processes
def test_a_mapped_file_cut_short_is_refused_by_name_and_the_notebook_lives(tmp_path):
    # In a child process: a notebook that read past the end of a mapped file would die of SIGBUS.
    path = tmp_path / "data.npy"
    script = textwrap.dedent(f"""
        import numpy as np, sys
        import ddp_notebook
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import faults
        path = {str(path)!r}
        np.save(path, np.ones(2**20, dtype=np.float32))
        data = np.load(path, mmap_mode="r")
        run = ddp_notebook.launch(faults.takes_arg, devices="cpu*2", args=(data,))
        run.wait(timeout=120)
        failed = ddp_notebook.launch(faults.fails_when_two, devices="cpu*2", args=(data,))
        try:
            failed.wait(timeout=120)
        except ddp_notebook.WorkerFailedError:
            pass
        open(path, "wb").close()  # cut short in place (as np.save over it does first)
        for again in (lambda: failed.retry(), lambda: ddp_notebook.launch(faults.takes_arg, devices="cpu*2",
                                                                          args=(data,))):
            try:
                again()
            except ddp_notebook.errors.SharedDataError as e:
                print("REFUSED:", e)
        print("ALIVE")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    refusals = [line for line in done.stdout.splitlines() if line.startswith("REFUSED:")]
    assert len(refusals) == 2 and all(str(path) in r and "cut short" in r for r in refusals), done.stdout
    assert done.stdout.rstrip().endswith("ALIVE")


@pytest.mark.processes
def test_a_rank_killed_by_sigbus_reading_a_file_of_the_call_names_the_file(tmp_path):
    from helpers import wait_for

    path, flag = tmp_path / "data.npy", tmp_path / "go"
    np.save(path, np.ones(2**20, dtype=np.float32))
    data = np.load(path, mmap_mode="r")
    run = ddp_notebook.launch(faults.sum_when_told, devices="cpu:0", args=(data, str(flag)))
    wait_for(run, lambda s: s.workers[0].step == 0, timeout=120)
    open(path, "wb").close()  # cut short under the rank, which has it mapped
    flag.touch()
    with pytest.raises(ddp_notebook.WorkerFailedError) as raised:
        run.wait(timeout=120)
    message = str(raised.value)
    assert "SIGBUS" in message and str(path) in message and "cut short" in message, message


@pytest.mark.processes  # a fresh interpreter: torch warns of TypedStorage once per process
def test_packing_a_call_lets_no_torch_deprecation_warning_reach_the_notebook():
    code = textwrap.dedent("""
        import torch, ddp_notebook
        run = ddp_notebook.launch(lambda ctx, x: float(x[0]), devices="cpu*2", args=(torch.ones(100000),))
        print(run.wait(120))
    """)
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DDP_NOTEBOOK_PROGRESS": "0"})
    assert done.returncode == 0 and done.stdout == "1.0\n", done.stderr
    assert "Warning" not in done.stderr, done.stderr
