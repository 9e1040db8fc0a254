"""The first error at once: rank 0 raises while rank 1 sleeps (it will never raise too); the
seconds from the raise until the notebook has the error, side by side with accelerate's
``notebook_launcher`` on the same function, trials interleaved, each launcher in a fresh Python
process (a notebook) that has imported torch:

    .venv/bin/python benchmarks/first_error_bench.py            # 5 trials each
    .venv/bin/python benchmarks/first_error_bench.py --quick    # 1 trial each

The raising rank writes the time before it raises; the notebook notes the time it has the error.
Also printed: the first line of the error the notebook gets (which rank it names).
It needs accelerate (the test extras have it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import scratch  # (benchmarks/scratch.py)

LAUNCHERS = {"ddp_notebook": "`ddp_notebook.launch` (+ `wait()`)",
             "accelerate": "accelerate `notebook_launcher`"}

TRIAL = r'''
import json, os, sys, time
import torch

MARK = sys.argv[2]

def body(rank):
    if rank == 0:
        time.sleep(0.5)
        with open(MARK, "w") as f:
            f.write(repr(time.time()))
        raise ValueError("rank 0 raised")
    time.sleep(30)

launcher = sys.argv[1]
try:
    if launcher == "ddp_notebook":
        import ddp_notebook
        ddp_notebook.launch(lambda ctx: body(ctx.rank), "cpu*2").wait(120)
    else:
        from accelerate import notebook_launcher

        def fn():
            body(int(os.environ.get("RANK", "0")))
        notebook_launcher(fn, (), num_processes=2)
    error = "no error"
except BaseException as e:  # noqa: BLE001 - whatever the launcher raises is the result
    error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
had = time.time()
print(json.dumps({"seconds": had - float(open(MARK).read()), "error": error[:110]}))
'''


def trial(launcher: str) -> dict:
    mark = os.path.join(tempfile.gettempdir(), f"first-error-bench-{os.getpid()}")
    done = subprocess.run([sys.executable, "-c", TRIAL, launcher, mark], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"seconds": float("nan"), "error": f"no result (exit {done.returncode}): {done.stderr[-300:]}"}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one trial each")
    parser.add_argument("--smoke", action="store_true", help="as --quick")
    args = parser.parse_args()
    trials = 1 if args.quick or args.smoke else 5
    results: dict[str, list[dict]] = {name: [] for name in LAUNCHERS}
    for _ in range(trials):
        for name in LAUNCHERS:  # interleaved: a busy moment of the machine falls on both
            results[name].append(trial(name))
    print(f"### The first error at once ({trials} trial{'s' if trials > 1 else ''} each, median)\n")
    print("| launcher | raise → the notebook has the error (s) | the error the notebook gets |")
    print("|---|---|---|")
    for name, rows in results.items():
        seconds = statistics.median(r["seconds"] for r in rows)
        print(f"| {LAUNCHERS[name]} | {seconds:.3f} | {rows[-1]['error']} |")


if __name__ == "__main__":
    scratch.use()
    main()
