"""Running a cell again: launch → result after a pause, first launch, failure → parent, many clean runs.

Side by side in one run, each launcher in a fresh Python process (a notebook), trials interleaved:
ddp_notebook with its fork server (the default: started by the first launch, or ahead of it as
``%load_ext`` does), with fresh interpreters (the server off, as off Linux), and
torch.multiprocessing with fork and with spawn. Every launcher runs the same rank body (a gloo
process group from a file rendezvous, one all_reduce, the result back to the parent):

    .venv/bin/python benchmarks/relaunch_bench.py            # 3 trials, 200 clean runs
    .venv/bin/python benchmarks/relaunch_bench.py --quick    # 1 trial, no pause, 10 clean runs (CI smoke test)

Printed: time from the launch call to the result after a pause of 0-8 s since the previous run
ended (a user changing a number and running the cell again), the first launch in a fresh process
(from the call, and from the interpreter's start, its own ``import torch`` included), rank 1
raising → the parent has the error, runs that hung (no result in 60 s) out of N clean runs in a row,
and the memory of the idle fork server.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import scratch  # (benchmarks/scratch.py)

LAUNCHERS = ("forkserver", "forkserver-early", "fresh", "mp-fork", "mp-spawn")
NAMES = {"forkserver": "ddp_notebook, fork server (default)",
         "forkserver-early": "ddp_notebook, fork server started by `%load_ext`",
         "fresh": "ddp_notebook, fresh interpreters, fork server off", "mp-fork": "torch.multiprocessing fork",
         "mp-spawn": "torch.multiprocessing spawn"}
PAUSES = (0, 1, 2, 4, 8)
# Launchers that take seconds a run get a tenth of the clean runs (a hang is still a minute's wait).
SLOW = ("fresh", "mp-spawn")
HANG = 60.0


def _ours_rank(ctx, fail: bool = False):
    import torch
    import torch.distributed as dist

    if fail and ctx.rank == 1:
        raise ValueError("boom")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _mp_rank(rank, queue, init_file, fail=False):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    if fail and rank == 1:
        raise ValueError("boom")
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 0:
        queue.put(t.item())
    dist.barrier()
    dist.destroy_process_group()


class Launcher:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind.startswith(("forkserver", "fresh")):
            import ddp_notebook
            from ddp_notebook.executors.local import forkserver

            self.dn = ddp_notebook
            self.forkserver = forkserver
            if kind == "fresh":
                forkserver.disable()  # every worker a fresh interpreter, as where there is no fork server
            elif kind == "forkserver-early":
                forkserver.start()  # what %load_ext does
                while not forkserver.status()["ready"]:  # the user writes the next cell
                    time.sleep(0.05)

    def once(self, fail: bool = False, timeout: float = HANG) -> float:
        """Launch → the result (or the error), in seconds; raises TimeoutError on a hang."""
        t0 = time.perf_counter()
        if self.kind.startswith("mp-"):
            self._mp(fail, timeout)
        else:
            run = self.dn.launch(_ours_rank, devices="cpu*2", args=(fail,))
            try:
                run.wait(timeout)
            except self.dn.errors.WaitTimeoutError:
                run.stop(force=True)
                raise TimeoutError from None
            except self.dn.WorkerFailedError:
                if not fail:
                    raise
        return time.perf_counter() - t0

    def _mp(self, fail: bool, timeout: float) -> None:
        import torch.multiprocessing as mp
        from torch.multiprocessing.spawn import ProcessException

        method = self.kind.split("-")[1]
        queue = mp.get_context(method).SimpleQueue()
        init_file = os.path.join(tempfile.mkdtemp(), "rdv")
        procs = mp.start_processes(_mp_rank, args=(queue, init_file, fail), nprocs=2, join=False,
                                   start_method=method)
        deadline = time.monotonic() + timeout
        try:
            while not procs.join(timeout=0.01):
                if time.monotonic() > deadline:
                    for p in procs.processes:
                        p.kill()
                    raise TimeoutError
        except ProcessException:
            if not fail:  # a clean run that died at exit (seen: SIGABRT in gloo's teardown): counted
                MISREPORTED.append(self.kind)
            for p in procs.processes:
                p.join()
            return
        if not fail:
            queue.get()

    def settle(self) -> None:
        """Between measured runs: what the launcher does in the background after a run is its own."""
        # (nothing: the fork server keeps nothing of a run, and fresh interpreters start anew)


MISREPORTED: list[str] = []


def _busy_thread() -> Callable[[], None]:
    """A notebook process has threads (the kernel's, a data loader's): one computes all along, as
    fork-after-threads would meet it."""
    import torch

    stop = threading.Event()

    def work() -> None:
        x = torch.ones(256, 256)
        while not stop.is_set():
            torch.mm(x, x)  # work in torch's thread pool: the state a fork copies

    thread = threading.Thread(target=work, daemon=True)
    thread.start()

    def end() -> None:  # before the interpreter exits: torch aborts on a thread still in an op
        stop.set()
        thread.join()

    return end


def trial(kind: str, started: float, clean_runs: int, pauses: tuple[int, ...]) -> dict:
    import torch  # noqa: F401 - a notebook has torch imported before it launches

    launcher = Launcher(kind)
    out: dict = {}
    t0 = time.perf_counter()
    launcher.once()
    out["first_call"] = time.perf_counter() - t0
    out["first_total"] = time.time() - started
    for pause in pauses:
        launcher.once()  # the previous run, ended just now
        time.sleep(pause)
        out[f"pause_{pause}"] = launcher.once()
    out["raise"] = min(launcher.once(fail=True) for _ in range(3))
    end_busy = _busy_thread()
    hangs, times = 0, []
    for _ in range(clean_runs):
        try:
            times.append(launcher.once(timeout=HANG))
        except TimeoutError:
            hangs += 1
    end_busy()
    out.update(clean=clean_runs, hangs=hangs, clean_median=statistics.median(times) if times else None,
               misreported=len(MISREPORTED))
    if kind.startswith("forkserver"):
        import psutil

        info = psutil.Process(launcher.forkserver.status()["pid"]).memory_full_info()
        out.update(server_rss=info.rss, server_pss=info.pss, server_uss=info.uss,
                   server_threads=launcher.forkserver.status()["threads"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="--quick without the rows that only add fresh "
                        "interpreters (torch.multiprocessing spawn, ddp_notebook without a fork server): the CI "
                        "smoke test")
    parser.add_argument("--trial", choices=LAUNCHERS)
    parser.add_argument("--started", type=float)
    args = parser.parse_args()
    args.quick = args.quick or args.smoke
    pauses = (0,) if args.quick else PAUSES
    runs = 10 if args.quick else args.runs
    if args.trial:
        print(json.dumps(trial(args.trial, args.started, max(1, runs // 10) if args.trial in SLOW else runs, pauses)))
        return
    trials = 1 if args.quick else args.trials
    launchers = tuple(k for k in LAUNCHERS if k not in SLOW) if args.smoke else LAUNCHERS
    results: dict[str, list[dict]] = {k: [] for k in launchers}
    env = dict(os.environ, DDP_NOTEBOOK_RUNS=tempfile.mkdtemp())
    for _ in range(trials):
        for kind in launchers:
            out = subprocess.run([sys.executable, __file__, "--trial", kind, "--started", repr(time.time()),
                                  *(["--quick"] if args.quick else ["--runs", str(runs)])],
                                 capture_output=True, text=True, env=env, timeout=3600)
            if out.returncode != 0:
                raise SystemExit(f"{kind} failed:\n{out.stderr}")
            results[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"2 gloo ranks on CPU, launch → result; median of {trials} fresh processes per launcher")
    print()
    print("| launcher | " + " | ".join(f"relaunch after {p} s" for p in pauses)
          + " | first launch (from the call / from process start) | rank 1 raises → error | hung runs |")
    print("|---" * (len(pauses) + 4) + "|")
    for kind in launchers:
        rows = results[kind]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], (int, float))}
        hung = sum(r["hangs"] for r in rows)
        print(f"| {NAMES[kind]} | " + " | ".join(f"{med[f'pause_{p}']:.3f} s" for p in pauses)
              + f" | {med['first_call']:.2f} s / {med['first_total']:.2f} s | {med['raise']:.3f} s"
              + f" | {hung} of {sum(r['clean'] for r in rows)} |")
    server = results["forkserver"][-1]
    print()
    mb = {k: server[f"server_{k}"] / 2**20 for k in ("pss", "uss", "rss")}
    print(f"Idle fork server: {mb['pss']:.0f} MB proportional ({mb['uss']:.0f} MB its own, {mb['rss']:.0f} MB "
          f"resident), {server['server_threads']} OS threads when "
          "ready to fork (the BLAS pool's, stopped by its own fork handler).")
    lost = {NAMES[k]: sum(r["misreported"] for r in results[k]) for k in launchers}
    if any(lost.values()):
        print("Clean runs reported as failed (exit-time crash): "
              + ", ".join(f"{k}: {v}" for k, v in lost.items() if v))


if __name__ == "__main__":
    scratch.use()
    main()
