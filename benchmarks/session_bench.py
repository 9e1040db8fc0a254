"""A trivial cell on every rank, from running it to every rank's result: a ddp_notebook session
(``%%ddp``, as a notebook user runs it, and ``session.run``, on local workers and on 2 engines)
beside ipyparallel's ``%px`` and ``DirectView.execute`` on 2 other engines of the same local
cluster (a session's ranks keep their engines busy).

Each trial runs the cell ``1`` (and ``print(1)``, whose output comes back too) on 2 ranks and
waits for every rank's result; trials are interleaved; medians and 95th percentiles in
milliseconds are printed as a markdown table. Not in benchmarks/run.py's suite::

    .venv/bin/python benchmarks/session_bench.py              # 200 trials each
    .venv/bin/python benchmarks/session_bench.py --trials 20
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import scratch  # (benchmarks/scratch.py)


def _ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return f"{statistics.median(ordered) * 1000:.2f} | {p95 * 1000:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()

    import ipyparallel as ipp
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    import ddp_notebook
    from ddp_notebook.lifecycle.session import set_current_session
    from ddp_notebook.ui.session_magics import SessionMagics

    shell = InteractiveShell.instance()
    shell.register_magics(SessionMagics)
    cluster = ipp.Cluster(n=4, log_level=40)
    rc = cluster.start_and_connect_sync(activate=False)
    session = ddp_notebook.session("cpu*2")
    on_engines = None
    try:
        rc.wait_for_engines(4, timeout=120)
        on_engines = ddp_notebook.session(engines=rc[2:4])
        view = rc[0:2]
        view.activate()  # %px on these engines

        def px(code: str) -> None:
            with capture_output():
                shell.run_cell_magic("px", "--block", code)  # as a notebook user sees it: waits for every engine

        def execute(code: str) -> None:
            result = view.execute(code, silent=False, block=True)
            result.get()

        def ours(code: str) -> None:
            with capture_output():
                values = session.run(code)
            assert len(values) == 2

        def ours_on_engines(code: str) -> None:
            with capture_output():
                values = on_engines.run(code)
            assert len(values) == 2

        set_current_session(session)

        def magic(code: str) -> None:
            with capture_output():
                shell.run_cell_magic("ddp", "", code)  # each rank's value formatted there, shown here

        cases = {"ddp_notebook %%ddp": magic, "ddp_notebook session.run": ours,
                 "ddp_notebook session.run on engines": ours_on_engines,
                 "ipyparallel DirectView.execute": execute, "ipyparallel %px --block": px}
        times: dict[tuple[str, str], list[float]] = {}
        for fn in cases.values():  # warm up: the first contact imports and connects
            for code in ("1", "print(1)"):
                fn(code)
        for _ in range(args.trials):
            for code in ("1", "print(1)"):
                for name, fn in cases.items():
                    t0 = time.perf_counter()
                    fn(code)
                    times.setdefault((name, code), []).append(time.perf_counter() - t0)
        print(f"{args.trials} trials each, 2 ranks / 2 engines, on {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs, Python {platform.python_version()}, ipyparallel {ipp.__version__}")
        print()
        print("| cell, from running it to every rank's result | `1`: median ms | p95 ms "
              "| `print(1)`: median ms | p95 ms |")
        print("|---|---|---|---|---|")
        for name in cases:
            print(f"| {name} | {_ms(times[(name, '1')])} | {_ms(times[(name, 'print(1)')])} |")
    finally:
        session.close()
        if on_engines is not None:
            on_engines.close()
        rc.close()
        cluster.stop_cluster_sync()


if __name__ == "__main__":
    scratch.use()
    main()
