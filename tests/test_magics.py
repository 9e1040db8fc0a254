"""The %ddp_* magics in a real IPython shell."""
import json
import os
import platform
import re

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import ddp_notebook

from helpers import started_processes, wait_until

pytestmark = pytest.mark.kernel

CELL = '''
import torch, torch.distributed as dist
def train(ctx, epochs=2):
    t = torch.ones(1)
    for epoch in range(epochs):
        dist.all_reduce(t)
        ctx.log(step=epoch + 1, total=epochs, epoch=epoch, loss=1.0 / (epoch + 1))
    return t.item()

def until_stopped(ctx):
    step = 0
    while not ctx.should_stop:
        step += 1
        ctx.log(step=step)
        import time; time.sleep(0.01)
    return step

def without_ctx(steps):
    return steps

def fails(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on rank 1")
    return "ok"

x = torch.randn(128, 4); y = x.sum(1, keepdim=True)
config = dict(model=lambda: torch.nn.Linear(4, 1), train_data=(x, y), loss=torch.nn.MSELoss(), batch_size=16)
'''


@pytest.fixture(scope="module")
def ip(ipython_shell):
    shell = ipython_shell
    shell.run_line_magic("load_ext", "ddp_notebook")
    assert shell.run_cell(CELL).success
    yield shell
    ddp_notebook.set_default_devices(None)


def test_ddp_devices_validates_and_sets_the_default(ip):
    with capture_output() as out:
        ip.run_line_magic("ddp_devices", "cpu*2")
    assert "Device list 'cpu*2': OK" in out.stdout
    assert ddp_notebook.default_devices() == "cpu*2"
    with capture_output() as out:
        ip.run_line_magic("ddp_devices", "cpu:0,cpu:0")
    assert "cpu:0 is listed 2 times" in out.stdout and ddp_notebook.default_devices() == "cpu*2"
    assert "The default device list stays 'cpu*2': runs without --devices use it." in out.stdout


def test_ddp_fit_waits_and_returns_the_result(ip):
    with capture_output():
        result = ip.run_line_magic("ddp_fit", "train --epochs 3 --wait")
    assert result == 8.0
    run = ip.user_ns["_ddp_run"]
    assert run is ddp_notebook.last_run() and run.status == "succeeded"
    assert [w.step for w in run.workers] == [3, 3]
    with capture_output() as out:
        ip.run_line_magic("ddp_status", "")
    assert "succeeded" in out.stdout and "rank 1 cpu:1" in out.stdout


def test_ddp_fit_returns_at_once_then_stop(ip):
    with capture_output():
        assert ip.run_line_magic("ddp_fit", "until_stopped -d cpu:0,cpu:1") is None
    run = ip.user_ns["_ddp_run"]
    assert not run.done or run.status == "stopped"
    ip.run_line_magic("ddp_stop", "--grace 20")
    try:  # a stop during start-up is honoured too: by the function, or before its workers exist
        assert run.wait(timeout=60) >= 0
    except ddp_notebook.errors.RunStoppedError:
        assert run.pids() == [None, None]  # stopped while the fork server started: no worker was started
    assert run.status == "stopped"


def test_ddp_fit_with_a_fit_configuration(ip):
    with capture_output():
        result = ip.run_line_magic("ddp_fit", "config --epochs 2 --batch-size 32 --wait")
    assert isinstance(result, ddp_notebook.FitResult) and len(result.history) == 2 and result.ranks_in_sync


def test_ddp_retry_after_a_failure(ip):
    with capture_output():
        ip.run_line_magic("ddp_fit", "fails")
    failed = ip.user_ns["_ddp_run"]
    with pytest.raises(ddp_notebook.WorkerFailedError, match=r"worker 1 \(cpu:1\) failed: ValueError: boom on rank 1") as e:
        failed.wait(timeout=60)
    # The traceback names the cell as IPython does, in the card and in the text, not its temporary file.
    from ddp_notebook.ui.html import failure_card_html

    assert re.search(r'File "[^"]+", line \d+, in fails', failed.failures[0].traceback)
    assert re.search(r"Cell In\[\d+\], line \d+, in fails", failure_card_html(e.value.failure, e.value.failures))
    assert re.search(r"Cell In\[\d+\], line \d+, in fails", "\n".join(e.value._render_traceback_()))
    with capture_output():
        ip.run_line_magic("ddp_retry", "")
    retry = ip.user_ns["_ddp_run"]
    assert retry.parent is failed and retry.wait(timeout=60) == "ok"
    assert [str(d) for d in retry.devices] == ["cpu:0"]


@pytest.mark.parametrize("line, words", [
    ("nothing_here", "there is no 'nothing_here' in the notebook"),
    ("train --epochs many", "'many' is not a whole number >= 1"),
    ("train --tag lr=0.1 --tag lr=0.2", "--tag lr= is given twice; a tag has one value"),
    ("train --epochs 99999999999999999999", "'99999999999999999999' is not a whole number >= 1 (of at most 18 digits)"),
    ("train --devices cpu:0,cpu:0", "cpu:0 is listed 2 times"),
    ("train --devices tpu:0", "unknown device kind 'tpu'"),
    ("fails --epochs 2", "fails() takes no 'epochs' argument"),
    ("x", "x is a Tensor; %ddp_fit takes a training function"),
    ("", "the following arguments are required: func"),
    ("train --stall-timeout soon", "'soon' is not a number of seconds, 'auto' or 'off'"),
    ("train --stall-timeout -3", "'-3' is not a number of seconds, 'auto' or 'off' (seconds: > 0, at most 31536000)"),
])
def test_bad_arguments_raise_usage_errors(ip, line, words):
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ip.run_line_magic("ddp_fit", line)


@pytest.mark.parametrize("line, words", [
    ("--stop --restart", "--stop closes the session and --restart forms it again: give one of them"),
    ("--without-failed", "--without-failed goes with --restart"),
])
def test_session_lines_that_cannot_work_are_refused_before_anything_starts(ip, line, words):
    before = started_processes()
    with pytest.raises(UsageError, match=re.escape(f"%ddp_session: {words}")):
        ip.run_line_magic("ddp_session", line)
    assert started_processes() == before


@pytest.mark.parametrize("value, setting", [(None, "auto"), ("auto", "auto"), ("off", None), ("45", 45.0)])
def test_the_watchdog_is_on_unless_turned_off(ip, value, setting):
    with capture_output():
        ip.run_line_magic("ddp_fit", "train --wait" + (f" --stall-timeout {value}" if value else ""))
    assert ip.user_ns["_ddp_run"].options.stall_timeout == setting


def test_help_comes_from_magic_arguments(ip):
    doc = ip.find_line_magic("ddp_fit").__doc__
    assert "--devices" in doc and "--wait" in doc and "Launch a DDP run" in doc


def test_a_run_shows_through_the_display_formatter_and_unload_removes_it(ip):
    run = ddp_notebook.launch(lambda ctx: ctx.rank, devices="cpu*2")
    run.wait(timeout=60)
    with capture_output() as out:
        data, _ = ip.display_formatter.format(run)
    assert data == {} and "succeeded" in out.stdout and "rank 1 cpu:1" in out.stdout  # the text view, outside a notebook
    ip.run_line_magic("unload_ext", "ddp_notebook")
    try:
        assert ip.find_line_magic("ddp_fit") is None
        data, _ = ip.display_formatter.format(run)
        assert data["text/plain"] == repr(run)
    finally:
        ip.run_line_magic("load_ext", "ddp_notebook")
    assert ip.find_line_magic("ddp_fit") is not None


def test_a_trailing_comment_is_not_an_argument(ip):
    with capture_output() as out:
        ip.run_line_magic("ddp_devices", "cpu*2                       # validate and make it the default")
        ip.run_line_magic("ddp_status", "  # text summary of the last run")
    assert "Device list 'cpu*2': OK" in out.stdout and ddp_notebook.default_devices() == "cpu*2"


@pytest.mark.parametrize("line", ['"cpu:0, cpu:1"', "cpu:0, cpu:1", "cpu:0 cpu:1", "'cpu:0,cpu:1'"])
def test_device_lists_may_be_quoted_or_spaced(ip, line):
    with capture_output() as out:
        ip.run_line_magic("ddp_devices", line)
    assert "rank 1 = cpu:1" in out.stdout and "OK" in out.stdout
    ddp_notebook.set_default_devices("cpu*2")
    with capture_output():
        assert ip.run_line_magic("ddp_fit", f"train --devices {line} --epochs 1 --wait") == 2.0


def test_a_mistyped_device_is_named_as_written_and_what_d_took_is_said(ip):
    with capture_output() as out:
        ip.run_line_magic("ddp_devices", "cpu:0 cpu1")  # every word a device: the bad one named alone
    assert "cannot read device 'cpu1'" in out.stdout and ddp_notebook.default_devices() == "cpu*2"
    with pytest.raises(UsageError, match=r"unrecognized arguments: train \(-d took 'cpu:0' as its device list and "
                                         r"'cpu1' as what follows it"):
        ip.run_line_magic("ddp_fit", "-d cpu:0 cpu1 train --wait")
    with pytest.raises(UsageError, match=r"cannot read device '': an empty entry"):  # the comma ends the list
        ip.run_line_magic("ddp_fit", "-d cpu:0, train --wait")
    with pytest.raises(UsageError, match=r"required: func \(-d took 'train' as its device list: give the devices"):
        ip.run_line_magic("ddp_fit", "-d train --wait")
    with pytest.raises(UsageError, match=r"no run 'cpu1' .*'cpu1' reads as a device, not a run"):
        ip.run_line_magic("ddp_retry", "-d cpu:0 cpu1")
    with capture_output():  # an abbreviation of --devices takes a spaced list too
        assert ip.run_line_magic("ddp_fit", "--dev cpu:0 cpu:1 train --epochs 1 --wait") == 2.0


def test_an_unbalanced_quote_is_a_usage_error(ip):
    with pytest.raises(UsageError, match=r"""^%ddp_devices: cannot read '"cpu:0': no closing quotation"""):
        ip.run_line_magic("ddp_devices", '"cpu:0')


def test_stop_and_retry_say_what_they_do(ip):
    with capture_output():
        ip.run_line_magic("ddp_fit", "until_stopped")
    run = ip.user_ns["_ddp_run"]
    with pytest.raises(UsageError, match=rf"run {run.id} is still (starting|running); stop it first \(%ddp_stop\)"):
        ip.run_line_magic("ddp_retry", "")
    with capture_output() as out:
        ip.run_line_magic("ddp_stop", "")
    assert out.stdout.startswith(f"Stopping run {run.id} on cpu:0,cpu:1: each worker sees ctx.should_stop")
    with capture_output():
        ip.run_line_magic("ddp_retry", "--device cpu:1")  # waits for the stop to end, then retries
    retry = ip.user_ns["_ddp_run"]
    assert run.status == "stopped" and retry.parent is run
    retry.stop(grace=20, wait=True)
    with capture_output() as out:
        ip.run_line_magic("ddp_stop", "")
    assert out.stdout == f"Run {retry.id} has already ended (stopped): nothing to stop.\n"
    with capture_output():
        assert ip.run_line_magic("ddp_fit", "train --wait") == 4.0
    with pytest.raises(UsageError, match=r"succeeded: there is nothing to retry \(%ddp_fit runs it again\)"):
        ip.run_line_magic("ddp_retry", "")


def test_ddp_fit_calls_the_function_with_arguments_read_not_evaluated(ip):
    ip.user_ns["three"] = 3
    with capture_output():
        assert ip.run_line_magic("ddp_fit", "train(three) --wait  # three epochs") == 8.0
        assert ip.run_line_magic("ddp_fit", "train(epochs=1) -d cpu:0, cpu:1 --wait") == 2.0
        # Options before the call (a named run here would add a column to the lists later tests read).
        assert ip.run_line_magic("ddp_fit", "--ui text -d cpu:0 train(epochs=1) --wait") == 1.0
        assert ip.user_ns["_ddp_run"].options.ui == "text" and [str(d) for d in ip.user_ns["_ddp_run"].devices] == ["cpu:0"]
        # -d takes one word: a bare function name after it is the function, not a device.
        assert ip.run_line_magic("ddp_fit", "-d cpu:0, cpu:1 train --wait") == 4.0
        assert ip.run_line_magic("ddp_fit", "-d cpu:0 cpu:1 train --wait") == 4.0


@pytest.mark.parametrize("line, words", [
    ("train(1, 2)", "train(ctx, ...) cannot take these arguments: too many positional arguments"),
    ("train(epoch=2)", "train(ctx, ...) cannot take these arguments: got an unexpected keyword argument 'epoch'"),
    ("train(nowhere)", "there is no 'nowhere' in the notebook for the call"),
    ("train(__import__('os').getpid())", "an argument of the call is a literal (100, 0.1, 'adam', [1, 2]) or a name"),
    ("train(*[1])", "*args and **kwargs are not read in the call"),
    ("train(epochs=1, epochs=2)", "the call gives epochs= twice (train(epochs=1, epochs=2)); give each argument once"),
    ("train(1", "cannot read the call in 'train(1': write it as Python"),
    ("config(1)", "config is a dict of fit() arguments, not a function to call"),
    ("without_ctx --devices cpu*2", "without_ctx(steps) does not take the worker context: write "
                                    "def without_ctx(ctx, steps)"),
])
def test_a_call_that_cannot_work_is_refused_before_anything_starts(ip, line, words):

    before = started_processes()
    with pytest.raises(UsageError, match=re.escape(words)):
        ip.run_line_magic("ddp_fit", line)
    assert started_processes() == before


def test_runs_are_listed_and_addressable_by_id(ip):
    with capture_output():
        first = ip.run_line_magic("ddp_fit", "train --wait")
        ip.run_line_magic("ddp_fit", "until_stopped")
    older = [r for r in ddp_notebook.runs() if r.status == "succeeded"][-1]
    current = ip.user_ns["_ddp_run"]
    assert first == 4.0 and current is ddp_notebook.last_run() and current is not older
    with capture_output() as out:
        ip.run_line_magic("ddp_runs", "")
    lines = out.stdout.splitlines()  # newest first: the current run on top, marked
    assert lines[0].startswith(f"Runs launched from {os.getcwd()}, newest first: ") and lines[1].split()[:3] == [
        "run", "status", "devices"]
    assert lines[2].startswith(f"* {current.id}") and any(line.split()[:2] == [older.id, "succeeded"] for line in lines)
    with capture_output() as out:
        ip.run_line_magic("ddp_status", older.id[-6:])  # the end of an id is enough
    assert out.stdout.startswith(f"Run {older.id} succeeded")
    with pytest.raises(UsageError, match=r"%ddp_stop: no run 'nope' in this kernel nor in .*: %ddp_runs --all lists the runs"):
        ip.run_line_magic("ddp_stop", "nope")
    with capture_output():
        ip.run_line_magic("ddp_stop", f"{current.id} --grace 20")
    current.wait(timeout=60)
    assert current.status == "stopped" and ddp_notebook.Run.load(older.id).result() == 4.0


def test_a_misspelled_option_is_named_with_the_nearest_one(ip):
    with pytest.raises(UsageError, match=r"^%ddp_fit: unrecognized arguments: --devcies cpu\*2 \(did you mean "
                                         r"--devices\?\); %ddp_fit\? lists them$"):
        ip.run_line_magic("ddp_fit", "train --devcies cpu*2")
    with pytest.raises(UsageError, match=r"^%ddp_stop: argument --grace: "):
        ip.run_line_magic("ddp_stop", "--grace")
    # An unknown option is named even where it hides the function's name (not "func is required").
    with pytest.raises(UsageError, match=r"^%ddp_fit: unrecognized arguments: --bogus; %ddp_fit\? lists them$"):
        ip.run_line_magic("ddp_fit", "--bogus")
    with pytest.raises(UsageError, match=r"^%ddp_fit: unrecognized arguments: --wiat \(did you mean --wait\?\)"):
        ip.run_line_magic("ddp_fit", "--wiat")


def test_ddp_fit_takes_a_function_by_a_dotted_name(ip):
    import types

    ip.user_ns["helpers"] = types.SimpleNamespace(train=ip.user_ns["train"], cfg=types.SimpleNamespace(epochs=1))
    with capture_output():
        assert ip.run_line_magic("ddp_fit", "helpers.train(helpers.cfg.epochs) --wait") == 2.0
        assert ip.run_line_magic("ddp_fit", "helpers.train --wait") == 4.0
    with pytest.raises(UsageError, match=r"^%ddp_fit: there is no 'helpers.trian' in the notebook; define a training"):
        ip.run_line_magic("ddp_fit", "helpers.trian")
    with pytest.raises(UsageError, match=r"^%ddp_fit: there is no 'helpers.nope' in the notebook for the call"):
        ip.run_line_magic("ddp_fit", "helpers.train(helpers.nope)")


def test_ddp_runs_all_lists_the_runs_on_disk_and_clean_prunes_them(ip, tmp_path, monkeypatch):
    from ddp_notebook.core.rundir import RunDir

    monkeypatch.setenv("DDP_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    with capture_output() as out:
        ip.run_line_magic("ddp_runs", "--all")
    assert out.stdout.startswith(f"No run on disk in {tmp_path / 'runs'}")
    # a run of an earlier kernel, cut off at step 3: its log has no end, and its notebook process is
    # gone (the pid recorded is this process's, which did not start then: that one ended)
    earlier = RunDir.create(str(tmp_path / "runs"))
    earlier.write_private(RunDir.NOTEBOOK, json.dumps({"pid": os.getpid(), "started": 1.0,
                                                       "host": platform.node()}).encode())
    with earlier.open_log() as log:
        for event in ({"kind": "run_started", "time": 1.0, "run_id": earlier.id, "devices": ["cpu:0"]},
                      {"kind": "ready", "time": 2.0, "rank": 0},
                      {"kind": "progress", "time": 3.0, "rank": 0, "step": 3, "total": 9}):
            log.write(json.dumps(event) + "\n")
    with capture_output():
        ip.run_line_magic("ddp_fit", "train --wait")
        ok = ip.user_ns["_ddp_run"]
        ip.run_line_magic("ddp_fit", "fails --devices cpu*2")
        failed = ip.user_ns["_ddp_run"]
    wait_until(lambda: failed.done, timeout=120)
    with capture_output() as out:
        ip.run_line_magic("ddp_runs", "--all")
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"Runs in {tmp_path / 'runs'}, newest first: 3 runs, ")
    assert lines[1].split()[:3] == ["run", "status", "devices"]
    assert lines[2].startswith(f"* {failed.id}  failed     cpu:0,cpu:1 ")
    assert lines[2].endswith("Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom on rank 1")
    assert lines[3].startswith(f"  {ok.id}  succeeded  cpu:0,cpu:1 ")
    assert lines[4].startswith(f"  {earlier.id}  stopped    cpu:0 ")
    assert lines[4].endswith("the notebook process ended (kernel restart or crash) at step 3 of 9")
    with capture_output() as out:
        ip.run_line_magic("ddp_runs", "--all -n 1")
    assert len(out.stdout.splitlines()) == 4 and out.stdout.splitlines()[-1] == "  ... and 2 older: %ddp_runs --all " \
                                                                                 "-n 3 lists them all"
    monkeypatch.setenv("DDP_NOTEBOOK_KEEP_RUNS", "1")
    with capture_output() as out:
        ip.run_line_magic("ddp_runs", "--clean")
    # the earlier kernel's run goes; this kernel's runs are kept
    assert out.stdout.startswith("Removed 1 finished run (") and "2 runs (" in out.stdout, out.stdout
    assert not os.path.exists(earlier.path) and os.path.exists(ok.run_dir)
    monkeypatch.setenv("DDP_NOTEBOOK_KEEP_RUNS", "many")
    with pytest.raises(UsageError, match=r"^%ddp_runs: \$DDP_NOTEBOOK_KEEP_RUNS must be a whole number of runs >= 1"):
        ip.run_line_magic("ddp_runs", "--clean")
    with pytest.raises(UsageError, match=r"^%ddp_runs: argument -n: '0' is not a whole number >= 1"):
        ip.run_line_magic("ddp_runs", "-n 0")


def test_ddp_fit_names_tags_and_trackers_and_ddp_compare(ip):
    with capture_output():
        assert ip.run_line_magic("ddp_fit", "train --name first --tag arch=mlp --tag lr=0.1 --wait") == 4.0
        first = ip.user_ns["_ddp_run"]
        assert ip.run_line_magic("ddp_fit", "train(1) --name second --report-to none --wait") == 2.0
        second = ip.user_ns["_ddp_run"]
    assert (first.name, first.tags, second.name) == ("first", {"arch": "mlp", "lr": 0.1}, "second")
    assert first.config["epochs"] == 2 and second.config["epochs"] == 1
    comparison = ip.run_line_magic("ddp_compare", f"{first.id} {second.id[-6:]} --metric loss")
    assert comparison.run_ids == [first.id, second.id] and comparison.metrics == ["loss"]
    assert "epochs" in repr(comparison).splitlines()[0]  # what differs between them
    for line, words in (("train --report-to tensorbord", "%ddp_fit: report_to names 'tensorbord'"),
                        ("train --tag arch", "%ddp_fit: argument --tag: 'arch' is not KEY=VALUE")):
        with pytest.raises(UsageError, match=re.escape(words)):
            ip.run_line_magic("ddp_fit", line)
    with capture_output():  # a list is no tag value: the text written is kept
        ip.run_line_magic("ddp_fit", "train --tag x=[1] --wait")
    assert ip.user_ns["_ddp_run"].tags == {"x": "[1]"}
    with pytest.raises(UsageError, match=r"^%ddp_compare: no run 'nope' in this kernel nor in "):
        ip.run_line_magic("ddp_compare", "nope")
    with pytest.raises(UsageError, match=r"^%ddp_compare: no run of this comparison logged 'acc'"):
        ip.run_line_magic("ddp_compare", f"{first.id} --metric acc")
