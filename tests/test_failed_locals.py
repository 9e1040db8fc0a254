"""The failed rank's locals: what the user's variables held when a rank raised, one line each, kept
with the failure (in the run's directory), shown on the card and by %ddp_debug."""
import pytest
import torch
from IPython.utils.capture import capture_output

import ddp_notebook
from ddp_notebook.ui.html import failure_card_html
from ddp_notebook.worker.failed_locals import NAMES_KEPT, SUMMARY_CHARS, summarize


def mismatched(ctx):
    images = torch.zeros(64, 3, 28, 28) if ctx.rank == 0 else torch.zeros(64, 3, 28, 27, dtype=torch.float64)
    labels = list(range(3))
    note = "x" * 500
    def nested(batch):
        size = batch.shape[-1]
        raise ValueError(f"bad width {size} on rank {ctx.rank}")
    if ctx.rank == 1:
        nested(images)
    return labels, note


@pytest.mark.unit
def test_a_summary_is_one_bounded_line_and_never_raises():
    class Broken:
        def __repr__(self):
            raise RuntimeError("no")

    assert summarize(torch.zeros(64, 3, 28, 28)) == "Tensor[64, 3, 28, 28] float32 cpu"
    assert summarize(torch.zeros(2, requires_grad=True)) == "Tensor[2] float32 cpu requires_grad"
    assert summarize(list(range(3))) == "list of 3" and summarize({"a": 1}) == "dict of 1"
    assert summarize(Broken()).startswith("<Broken ")  # (reprlib says what it is instead)
    assert len(summarize("y" * 10_000)) <= SUMMARY_CHARS and "\n" not in summarize("a\nb" * 30)


@pytest.mark.unit
def test_the_locals_are_the_users_frames_not_torchs_or_the_standard_librarys():
    import json

    from ddp_notebook.worker.failed_locals import failed_locals

    def parse(text):
        config = {"lr": 0.1}
        return json.loads(text), config  # raises inside json's own frames

    try:
        parse("{")
    except ValueError as e:
        frames = failed_locals(e.__traceback__)
    try:
        torch.ones(2) @ torch.ones(3)
    except RuntimeError as e:
        frames += failed_locals(e.__traceback__)
    assert [f["function"] for f in frames][:2] == ["parse", "test_the_locals_are_the_users_frames_not_torchs_or_the_standard_librarys"]
    assert frames[0]["locals"]["config"] == "dict of 1"
    assert all(f["file"] == __file__ for f in frames), frames


@pytest.mark.processes
def test_a_failed_ranks_locals_are_kept_shown_on_the_card_and_by_ddp_debug(ipython_shell, tmp_path):
    run = ddp_notebook.launch(mismatched, devices="cpu*2", run_root=str(tmp_path))
    with pytest.raises(ddp_notebook.WorkerFailedError, match="bad width 27 on rank 1"):
        run.wait(timeout=120)
    root = run.root_failure
    # (the ctx is left out: its rank and device are the headline's)
    assert root.rank == 1 and root.locals == {"batch": "Tensor[64, 3, 28, 27] float64 cpu", "size": "27"}
    assert [f["function"] for f in root.locals_frames] == ["nested", "mismatched"]  # innermost first
    outer = root.locals_frames[1]["locals"]
    assert outer["images"] == "Tensor[64, 3, 28, 27] float64 cpu" and outer["labels"] == "list of 3"
    assert len(outer["note"]) <= SUMMARY_CHARS and "ctx" not in outer and "nested" not in outer  # (code and the ctx left out)
    card = failure_card_html(root, run.failures)
    assert "Locals in nested (test_failed_locals.py:" in card and "Tensor[64, 3, 28, 27] float64 cpu" in card
    # Kept with the failure in the run's directory: read back after a restart.
    assert ddp_notebook.Run.load(run.run_dir).root_failure.locals == root.locals
    ip = ipython_shell
    ip.run_line_magic("load_ext", "ddp_notebook")
    ip.user_ns["_ddp_run"] = run
    with capture_output() as out:
        ip.run_line_magic("ddp_debug", run.id)
    assert "Locals in nested (test_failed_locals.py:" in out.stdout and "batch = Tensor[64, 3, 28, 27]" in out.stdout
    assert "Locals in mismatched (test_failed_locals.py:" in out.stdout and "labels = list of 3" in out.stdout


@pytest.mark.processes
def test_locals_are_bounded_in_number(tmp_path):
    def many(ctx):
        scope = {f"v{i}": i for i in range(NAMES_KEPT + 20)}
        exec("def f():\n" + "".join(f"    v{i} = {i}\n" for i in scope) + "    raise KeyError('k')\n", scope)
        scope["f"]()

    run = ddp_notebook.launch(many, devices="cpu:0", run_root=str(tmp_path))
    with pytest.raises(ddp_notebook.WorkerFailedError):
        run.wait(timeout=120)
    names = run.root_failure.locals
    assert len(names) == NAMES_KEPT + 1 and names["…"] == "20 more"


@pytest.mark.unit
def test_a_repr_that_hangs_loops_or_exits_never_holds_up_nor_ends_the_report(monkeypatch):
    import time

    from ddp_notebook.worker import failed_locals as module

    monkeypatch.setattr(module, "SUMMARY_SECONDS", 0.3)

    class Exits:
        def __repr__(self):
            raise SystemExit(1)

    class Hangs:
        def __repr__(self):
            time.sleep(1000)

    class Loops:
        def __repr__(self):
            while True:
                pass

    def fails():
        exits, hangs, loops, n = Exits(), Hangs(), Loops(), 3  # noqa: F841 - the locals summarized
        raise ValueError("x")

    started = time.monotonic()
    try:
        fails()
    except ValueError as e:
        frames = module.failed_locals(e.__traceback__)
    assert time.monotonic() - started < 5
    names = frames[0]["locals"]
    assert names["exits"] == "<Exits: its summary raised SystemExit>"
    assert names["hangs"] == "<Hangs: its summary took over 0.3 s>"
    assert names["loops"] == "<Loops: not summarized, the summaries took over 0.3 s>" and names["n"] == "3"
