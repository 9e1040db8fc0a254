"""Real-sized data to the ranks, and a large result back: time and memory, side by side.

Each measurement runs in a fresh Python process (a notebook) that makes one float32 tensor of the
given size and hands it to N ranks as an argument: ddp_notebook (fork server started ahead, as
``%load_ext`` does), torch.multiprocessing spawn, and fork. Every rank sums its data (reading
every page), notes the time, and waits; the notebook then reads the proportional memory (Pss, from
/proc/PID/smaps_rollup) of itself and every rank. Printed: the time from the launch call until
every rank has read its data, and the extra memory: the total Pss minus the same launch's with
1 MB. The first row of each size is the floor no launcher can beat on this machine: the same
bytes copied once into fresh shared memory and read by processes already waiting for them. The
free memory is touched once before anything is measured (see ``warm_memory``). Then a 500 MB
state_dict returned by rank 0: the time until the notebook holds it (every page read), and the
notebook's resident memory (Rss) over its start, once the ranks are gone and at its peak
meanwhile.

    .venv/bin/python benchmarks/data_bench.py            # 1 MB, 512 MB, 2 GB; 2 and 4 ranks
    .venv/bin/python benchmarks/data_bench.py --quick    # 1 MB and 64 MB, 2 ranks (CI smoke test)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import scratch  # (benchmarks/scratch.py)

LAUNCHERS = ("floor", "ours", "ours-shared", "mp-spawn", "mp-fork")
NAMES = {"ours": "ddp_notebook (fork server warm)", "ours-shared": "ddp_notebook, data from `ddp_notebook.share`",
         "mp-spawn": "torch.multiprocessing spawn", "mp-fork": "torch.multiprocessing fork",
         "floor": "floor: one copy into fresh shared memory, read by waiting processes (no launcher)"}
RESULT_LAUNCHERS = ("ours", "mp-spawn", "mp-fork")
MB = 2**20


def pss(pid: int, field: str = "Pss:") -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss() -> int:
    return pss(os.getpid(), "Rss:")


def _touch(rank: int, data, flags: str) -> None:
    """A rank's part: read every page of the data, say when, wait for the notebook's go."""
    float(data.sum())
    with open(os.path.join(flags, f"rank{rank}"), "w") as f:
        f.write(f"{time.time()} {os.getpid()}")
    while not os.path.exists(os.path.join(flags, "go")):
        time.sleep(0.01)


def _ours_rank(ctx, data, flags):
    _touch(ctx.rank, data, flags)


def _mp_rank(rank, data, flags):
    _touch(rank, data, flags)


def _ours_result(ctx, nbytes):
    import torch

    return {"w": torch.ones(nbytes // 4)} if ctx.rank == 0 else None


def _mp_result(rank, nbytes, queue):
    import torch

    if rank == 0:
        queue.put({"w": torch.ones(nbytes // 4)})
        time.sleep(1.0)  # the parent takes it (torch shares it through a file descriptor) before we leave


# A floor's reader: waits for the path of the shared memory, maps it, reads every page, says when.
_READER = """
import mmap, os, sys, time, numpy as np
print("ready", flush=True)
path, flags, rank = sys.stdin.readline().split()
with open(path, "rb") as f:
    m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
float(np.frombuffer(m, dtype=np.float32).sum())
with open(os.path.join(flags, "rank" + rank), "w") as f:
    f.write(f"{time.time()} {os.getpid()}")
while not os.path.exists(os.path.join(flags, "go")):
    time.sleep(0.01)
"""


def _floor(data, ranks: int, flags: str) -> list:
    """What no launcher can beat: the data copied once into fresh shared memory (a memfd, as
    ``launch`` does) and read by ``ranks`` processes already started and waiting for it."""
    readers = [subprocess.Popen([sys.executable, "-c", _READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True) for _ in range(ranks)]
    for reader in readers:
        reader.stdout.readline()  # numpy imported: the reader waits for the data
    t0 = time.time()
    fd = os.memfd_create("floor")
    os.ftruncate(fd, data.nbytes)
    view, done = memoryview(data.numpy()).cast("B"), 0
    while done < data.nbytes:
        done += os.pwrite(fd, view[done:done + 2**30], done)
    for rank, reader in enumerate(readers):
        reader.stdin.write(f"/proc/{os.getpid()}/fd/{fd} {flags} {rank}\n")
        reader.stdin.flush()
    return [t0, readers, fd]


def one_data(launcher: str, nbytes: int, ranks: int) -> dict:
    """In this fresh process: the data to ``ranks`` ranks with ``launcher``."""
    import torch

    flags = tempfile.mkdtemp()
    ours = launcher.startswith("ours")
    if ours:
        from ddp_notebook import launch, share
        from ddp_notebook.executors.local import forkserver

        forkserver.start()
        while not forkserver.status()["ready"]:
            time.sleep(0.05)
    data = torch.ones(nbytes // 4)
    if launcher == "ours-shared":
        data = share(data)  # once, as data is loaded: the original is dropped
    t0 = time.time()
    if launcher == "floor":
        t0, readers, fd = _floor(data, ranks, flags)
    elif ours:
        run = launch(_ours_rank, devices=f"cpu*{ranks}", args=(data, flags))
    else:
        import torch.multiprocessing as mp

        ctx = mp.start_processes(_mp_rank, args=(data, flags), nprocs=ranks, join=False,
                                 start_method=launcher.split("-")[1])
    files = [os.path.join(flags, f"rank{r}") for r in range(ranks)]
    while not all(os.path.exists(p) and os.path.getsize(p) for p in files):
        time.sleep(0.005)
    seen = [open(p).read().split() for p in files]
    seconds = max(float(t) for t, _ in seen) - t0
    total = pss(os.getpid()) + sum(pss(int(pid)) for _, pid in seen)
    open(os.path.join(flags, "go"), "w").close()
    if launcher == "floor":
        [reader.wait(timeout=600) for reader in readers]
        os.close(fd)
    elif ours:
        run.wait(timeout=600)
    else:
        ctx.join()
    return {"seconds": seconds, "pss": total}


def one_result(launcher: str, nbytes: int) -> dict:
    """In this fresh process: a ``nbytes`` state_dict from rank 0 of 2, until it is in hand."""
    import torch  # noqa: F401 - a notebook that trains has torch, before the memory is measured

    if launcher == "ours":
        from ddp_notebook import launch
        from ddp_notebook.executors.local import forkserver

        forkserver.start()
        while not forkserver.status()["ready"]:
            time.sleep(0.05)
    base = rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.time()
    if launcher == "ours":
        value = launch(_ours_result, devices="cpu*2", args=(nbytes,)).wait(timeout=600)
    else:
        import torch.multiprocessing as mp

        queue = mp.get_context(launcher.split("-")[1]).SimpleQueue()
        ctx = mp.start_processes(_mp_result, args=(nbytes, queue), nprocs=2, join=False,
                                 start_method=launcher.split("-")[1])
        value = queue.get()
    float(value["w"].sum())  # every page read, in the notebook
    seconds = time.time() - t0
    if launcher != "ours":
        ctx.join()  # (ddp_notebook's ranks have left when wait() returns)
    held = rss()  # the ranks gone: what holding the result costs the notebook
    done.set()
    return {"seconds": seconds, "peak": max(peak[0], held) - base, "held": held - base}


def measure(args: list[str], timeout: float, server_first: bool = False) -> dict:
    """One measurement in a fresh process (and its own session: a hang is ended, children too).
    ``server_first``: ddp_notebook's fork server is started before that process imports torch (the
    two import it at once); it is ready before anything is timed either way."""
    proc = subprocess.Popen([sys.executable, __file__, "--one", *args, *(["--server-first"] if server_first else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"hung: no outcome after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": (err.strip().splitlines() or ["failed"])[-1]}
    return json.loads(out.strip().splitlines()[-1])


def warm_memory() -> float:
    """Touch most of the free memory once, in a process that then leaves. A virtual machine is
    handed its memory by the host on first touch (3 s per GB here, against 0.5 s later): without
    this, whichever launcher first uses some memory pays the host, not its own cost."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import mmap, os; mmap.mmap(-1, int(os.sysconf('SC_PAGE_SIZE') * "
                    "os.sysconf('SC_AVPHYS_PAGES') * 0.85), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | "
                    "mmap.MAP_POPULATE)"], check=False)
    return time.monotonic() - t0


def fmt_size(n: int) -> str:
    return f"{n / 2**30:g} GB" if n >= 2**30 else f"{n / MB:g} MB"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="--quick without the rows that only add fresh "
                        "interpreters (torch.multiprocessing spawn, the warm pool without a fork server), each "
                        "fork server started before its process imports torch: the CI smoke test")
    parser.add_argument("--one", nargs="+")
    parser.add_argument("--server-first", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=None, help="runs of each measurement (median); default 3, "
                        "1 with --quick")
    opts = parser.parse_args()
    if opts.one:
        kind, launcher, *rest = opts.one
        if opts.server_first and launcher.startswith("ours"):
            from ddp_notebook.executors.local import forkserver

            forkserver.start()
        size = int(rest[0])
        print(json.dumps(one_data(launcher, size, int(rest[1])) if kind == "data" else one_result(launcher, size)))
        return
    opts.quick = opts.quick or opts.smoke
    # (smoke: torch.multiprocessing fork hangs here on the data, deterministically, after a minute: the
    # full table says so; its result row still runs)
    launchers = tuple(k for k in LAUNCHERS if not k.startswith("mp-")) if opts.smoke else LAUNCHERS
    result_launchers = tuple(k for k in RESULT_LAUNCHERS if k != "mp-spawn") if opts.smoke else RESULT_LAUNCHERS
    opts.repeat = opts.repeat or (1 if opts.quick else 3)
    sizes = (1 * MB, 64 * MB) if opts.quick else (1 * MB, 512 * MB, 2048 * MB)
    rank_counts = (2,) if opts.quick else (2, 4)
    hang = 60  # seconds with no outcome: hung (a fresh interpreter and its launcher included, on a busy machine)
    total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    warmed = None if opts.quick else warm_memory()
    rows = []
    for ranks in rank_counts:
        base: dict[str, int] = {}
        ratio: dict[str, float] = {}
        hung: set[str] = set()
        for size in sizes:
            runs: dict[str, list[dict]] = {}
            skipped: dict[str, str] = {}
            for launcher in launchers:
                if launcher in hung:
                    skipped[launcher] = "not run: it hung with less data"
                elif size > MB and launcher in ratio and (ratio[launcher] + 1) * size > 0.6 * total_ram:
                    need = ratio[launcher] * size / 2**30
                    skipped[launcher] = f"not run: needs about {need:.0f} GB more memory than this machine has"
            for _ in range(opts.repeat):  # interleaved: each launcher meets the machine in the same states
                for launcher in launchers:
                    if launcher in skipped:
                        continue
                    got = measure(["data", launcher, str(size), str(ranks)], timeout=hang + 30 * size / 2**30,
                                  server_first=opts.smoke)
                    if "error" in got:
                        skipped[launcher] = got["error"]
                        if got["error"].startswith("hung"):
                            hung.add(launcher)
                        continue
                    runs.setdefault(launcher, []).append(got)
            for launcher in launchers:
                if launcher in skipped:
                    rows.append((launcher, ranks, size, None, skipped[launcher]))
                    continue
                seconds = statistics.median(g["seconds"] for g in runs[launcher])
                total = statistics.median(g["pss"] for g in runs[launcher])
                if size == MB:
                    base[launcher] = total
                if launcher not in base:
                    rows.append((launcher, ranks, size, seconds, None))
                    continue
                extra = total - base[launcher]
                if size > MB:
                    ratio[launcher] = extra / size
                rows.append((launcher, ranks, size, seconds, extra))
    print("| launcher | ranks | data | launch → every rank has read its data | extra memory (Pss) | × the data |")
    print("|---|---|---|---|---|---|")
    for launcher, ranks, size, seconds, extra in rows:
        if seconds is None:
            print(f"| {NAMES[launcher]} | {ranks} | {fmt_size(size)} | {extra} | | |")
            continue
        times = f"{seconds:.2f} s" + (f" ({seconds / (size / 2**30):.2f} s/GB)" if size >= 64 * MB else "")
        if extra is None:
            print(f"| {NAMES[launcher]} | {ranks} | {fmt_size(size)} | {times} | (no 1 MB baseline) | |")
            continue
        print(f"| {NAMES[launcher]} | {ranks} | {fmt_size(size)} | {times} | {extra / MB:,.0f} MB | "
              f"{extra / size:.2f}× |" if size > MB else f"| {NAMES[launcher]} | {ranks} | {fmt_size(size)} | "
              f"{times} | (baseline) | |")
    print()
    result_size = 64 * MB if opts.quick else 512 * MB
    print(f"| launcher | a {fmt_size(result_size)} state_dict from rank 0 → in the notebook | the notebook's memory "
          "once the ranks are gone | its peak meanwhile |")
    print("|---|---|---|---|")
    for launcher in result_launchers:
        got = measure(["result", launcher, str(result_size)], timeout=hang + 60, server_first=opts.smoke)
        if "error" in got:
            print(f"| {NAMES[launcher]} | {got['error']} | | |")
        else:
            held, peak = got["held"], got["peak"]
            print(f"| {NAMES[launcher]} | {got['seconds']:.2f} s | +{held / MB:,.0f} MB ({held / result_size:.2f}×) "
                  f"| +{peak / MB:,.0f} MB ({peak / result_size:.2f}×) |")
    print(f"\n{os.cpu_count()} cores, {total_ram / 2**30:.0f} GB of memory; Pss counts a page shared by k "
          f"processes as 1/k in each; medians of {opts.repeat}."
          + (f" Free memory touched once first ({warmed:.0f} s)." if warmed else ""))


if __name__ == "__main__":
    scratch.use()
    main()
