"""Bad input gets a clear error, never an internal traceback (#11).

Property-based tests over every public entry point and every magic: whatever they are given, they
either accept it or refuse it with the package's own error (``UsageError`` for a magic) naming the
bad value; never a bare TypeError, ValueError, AttributeError... from inside the package.

Nothing here starts a process: the one place where a run would start (``start_run``) hands back a
run that never ran, devices are judged by a ``StaticProbe``, and fit's ``launch_with`` is a stand-in.
"""
import math
import os
import reprlib
import sys
import tempfile
from collections import deque
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import ddp_notebook
from ddp_notebook import DDPNotebookError, Device, LaunchOptions, Run, parse_devices, validate_devices
from ddp_notebook.core import probes
from ddp_notebook.core.devices import KINDS, MAX_WORKERS
from ddp_notebook.core.events import EventKind
from ddp_notebook.core.failures import FailureKind, WorkerFailure
from ddp_notebook.core.probes import StaticProbe
from ddp_notebook.core.rundir import RunDir
from ddp_notebook.core.stream import EventStream
from ddp_notebook.core.validation import CPU_WORKERS_PER_CORE, ValidationReport
from ddp_notebook.errors import DeviceSpecError
from ddp_notebook.executors.local.executor import LocalExecutor, set_default_devices
from ddp_notebook.lifecycle import launch as launch_module
from ddp_notebook.lifecycle.call import Call
from ddp_notebook.lifecycle.options import OPTION_NAMES
from ddp_notebook.recipes import fit as fit_module
from ddp_notebook.transfer.loading import Received
from ddp_notebook.transfer.pickling import dumps
from ddp_notebook.ui import magics as magics_module

from helpers import FINDING_CODES, WARNING_CODES

# No module-wide mark: a property test here is a fuzz test (a thousand examples each: seconds, too
# long for the unit part), the others are unit tests (conftest.py marks them).
EXAMPLES = 1000
_fuzz_settings = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                          suppress_health_check=list(HealthCheck))


def fuzz(test):
    """A property test of ``EXAMPLES`` examples, marked ``fuzz``: the whole suite runs it, ``-m unit`` does not."""
    return pytest.mark.fuzz(_fuzz_settings(test))

CPUS = 4
PROBE = StaticProbe(cpus=CPUS)

# ---- what users might pass ----------------------------------------------------------------------

WEIRD_NUMBERS = [0, -1, 1, 2, 3, 10**6, 10**30, -(10**30), 0.0, -0.0, 0.5, -2.5, 1e300, 1e-300, math.nan, math.inf,
                 -math.inf, True, False, 2**63, 2**64, 1 + 2j, Fraction(1, 3)]
WEIRD_TEXT = ["", " ", "auto", "AUTO", "off", "nan", "inf", "-1", "1", "3", "0", "1e999", "٣", "²", "1_000", " 5 ", "x",
              "'", '"', "#", "\\", "\x00", "\n", "é", "🙂", "cpu", "cuda", "---", "-d", "=", "gloo", "nccl", "mpi"]
WEIRD_OTHER = [None, b"", b"cpu", [], [1], ["cpu:0"], (), ("x",), {}, {"a": 1}, {1: 2}, set(), {1}, object(), len, str,
               int, lambda: 1, type("Thing", (), {})(), range(3), iter([1]), Ellipsis, NotImplemented]
WEIRD = WEIRD_NUMBERS + WEIRD_TEXT + WEIRD_OTHER
weird_text = st.sampled_from(WEIRD_TEXT)
# Drawn from prepared values mostly (cheap to draw: 1000 cases of each property stay fast), with
# random text and numbers mixed in.
anything = st.one_of(st.sampled_from(WEIRD), st.text(max_size=8), st.integers(), st.floats())


def either(*valid):
    """A value of an argument: one of ``valid`` about half the time, else one of the weird ones
    (one draw: for many keyword arguments at a time)."""
    return st.sampled_from(list(valid) * (len(WEIRD) // len(valid)) + WEIRD)


@st.composite
def some_of(draw, strategies, most):
    """Keyword arguments: up to ``most`` names of ``strategies``, each with a value from its own."""
    names = draw(st.lists(st.sampled_from(sorted(strategies)), max_size=most, unique=True))
    return {name: draw(strategies[name]) for name in names}


def says(error, value):
    """The message of ``error`` names ``value`` as Python writes it (shortened by ``reprlib`` when
    long; an object without a readable value by its type; a dict or a list by the bad key or item)."""
    text = str(error)
    if isinstance(value, dict) and any(says(error, k) or says(error, v) for k, v in value.items()):
        return True
    if isinstance(value, (list, tuple)) and any(says(error, v) for v in value):
        return True
    if repr(value) in text or reprlib.repr(value) in text:  # a long one, shortened
        return True
    unreadable = " at 0x" in repr(value) or isinstance(value, type) or callable(value)
    return unreadable and type(value).__name__ in text


# ---- stand-ins: nothing starts --------------------------------------------------------------------

FAILURE = WorkerFailure(rank=1, device="cpu:1", kind=FailureKind.EXCEPTION, time=2.0, exc_type="ValueError",
                        message="boom")


NOWHERE = os.path.join(tempfile.gettempdir(), "ddp-notebook-fuzz-nowhere")  # never created


def a_run(run_id, status="failed", finished=True, restart=None, executor=None, devices=("cpu:0", "cpu:1")):
    """A run that never ran: its log says it started on ``devices`` and (if ``finished``) ended."""
    events = [{"kind": EventKind.RUN_STARTED, "time": 1.0, "run_id": run_id, "devices": list(devices),
               "backend": "gloo"}]
    if status == "failed":
        events.append({"kind": EventKind.FAILURE, "time": 2.0, "rank": 1, "failure": FAILURE.to_dict()})
    if finished:
        events.append({"kind": EventKind.RUN_FINISHED, "time": 3.0, "status": status})
    run = Run(RunDir(os.path.join(NOWHERE, run_id)), EventStream.replay(events), parse_devices(list(devices)), executor=executor,
              restart=restart)
    if finished:
        run._end(Received(dumps(4.0)) if status == "succeeded" else None)
    return run


def restart(devices, options, settings, parent):
    """How a run's retry starts (``start_run`` with its call bound)."""
    return launch_module.start_run(Call(len, ()), devices, options, settings, parent=parent)


STARTED = a_run("20260101-000009-started", status="succeeded")
FAILED = a_run("20260101-000000-aaaaaa", restart=restart, executor=LocalExecutor())
RUNNING = a_run("20260101-000001-bbbbbb", status="running", finished=False, executor=LocalExecutor())
SUCCEEDED = a_run("20260101-000002-cccccc", status="succeeded", restart=restart, executor=LocalExecutor())


@pytest.fixture
def quiet(tmp_path, monkeypatch):
    """``start_run`` validates as it would, then hands back a finished run instead of starting one;
    devices are judged by a four-core machine without GPUs."""
    started = []

    def start_run(payload, devices, options, settings=None, parent=None, probe=None, report=None):
        report = report or launch_module._validated(devices, options, probe)
        started.append(report.devices)
        return STARTED

    monkeypatch.setattr(probes, "_default", PROBE)
    monkeypatch.setattr(launch_module, "start_run", start_run)
    monkeypatch.setenv("DDP_NOTEBOOK_PROGRESS", "0")
    monkeypatch.setenv("DDP_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    return started


# ---- devices ------------------------------------------------------------------------------------

digits = st.sampled_from(["0", "1", "7", "01", "1023", "1024", "4096", "9" * 30, "1" * 5000, "٣", "３", "²", "-1",
                          "", "x", "1.5", " 2"])
device_item = st.one_of(
    st.builds(lambda k, sep, n: f"{k}{sep}{n}", st.sampled_from(["cpu", "CUDA", "gpu", "tpu", "Cpu", " cpu", "", "cpu "]),
              st.sampled_from([":", "*", "", "-", "::"]), digits),
    st.builds(lambda k, a, b: f"{k}:{a}-{b}", st.sampled_from(["cpu", "cuda"]), digits, digits),
    st.text(max_size=10),
)
device_spec = st.one_of(
    st.lists(device_item, max_size=4).map(",".join),
    st.lists(st.one_of(device_item, anything), max_size=3),
    st.text(),
    anything,
)


@fuzz
@given(device_spec)
def test_a_device_list_parses_or_is_refused_naming_the_entry(spec):
    """parse_devices, and set_default_devices, which reads the list the same way."""
    try:
        devices = parse_devices(spec, cuda_count=lambda: 2)
    except DeviceSpecError as e:
        assert str(e).startswith(("cannot read device", "'cuda' means", "the device list has more than", "Device "))
        if spec is not None:  # None resets the default
            with pytest.raises(DeviceSpecError):
                ddp_notebook.set_default_devices(spec)
    else:
        assert len(devices) <= MAX_WORKERS
        assert all(d.kind in KINDS and type(d.index) is int and 0 <= d.index < MAX_WORKERS for d in devices)
        ddp_notebook.set_default_devices(spec)
        assert ddp_notebook.default_devices() is spec
    finally:
        set_default_devices(None)


def test_only_ascii_digits_count_in_a_device():
    """Every digit of Unicode but 0-9 (int() reads "٣" as 3, the device parser must not)."""
    digits = [chr(c) for c in range(128, sys.maxunicode + 1) if chr(c).isnumeric()]
    assert len(digits) > 1000
    for digit in digits:
        for item in (f"cpu:{digit}", f"cuda*{digit}", f"gpu:0-{digit}"):
            with pytest.raises(DeviceSpecError) as e:
                parse_devices(item, cuda_count=lambda: 2)
            assert item in str(e.value)


@fuzz
@given(st.one_of(anything, st.sampled_from(["cpu", "CUDA", " Gpu ", "tpu", "cuda:0"])),
       st.one_of(anything, st.integers(-3, 2 * MAX_WORKERS)))
def test_a_device_value_is_normalised_or_refused(kind, index):
    try:
        d = Device(kind, index)
    except DeviceSpecError as e:
        assert says(e, kind) or says(e, index)
    else:
        assert d.kind in KINDS and type(d.index) is int and 0 <= d.index < MAX_WORKERS
        assert parse_devices(str(d)) == [d]  # what it prints reads back as itself


# ---- validate_devices and every keyword argument -----------------------------------------------------

valid_or_any = {
    "backend": either(None, "gloo", "nccl"),
    "min_free_memory": either(None, 0, 1 << 20),
    "probe": st.one_of(st.sampled_from([None, PROBE, StaticProbe(cpus=1, gpus_free=[(1 << 30, 1 << 31)])]), anything),
    "dataset_size": either(None, 0, 10, 1000),
    "batch_size": either(None, 1, 32),
    "drop_last": either(True, False),
}


def usable_argument(name, value):
    """What validate_devices documents for its keyword arguments (a backend it does not know is a
    ``backend`` finding, not an argument error)."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if name in ("min_free_memory", "dataset_size"):
        return value is None or (whole and value >= 0)
    if name == "batch_size":
        return value is None or (whole and value >= 1)
    if name == "probe":
        return value is None or isinstance(value, probes.Probe)
    if name == "drop_last":
        return isinstance(value, bool)
    return True


@fuzz
@given(device_spec, some_of(valid_or_any, 4))
def test_validate_devices_never_raises_and_names_a_bad_argument(monkeypatch, spec, kwargs):
    monkeypatch.setattr(probes, "_default", PROBE)
    report = validate_devices(spec, **kwargs)
    assert isinstance(report, ValidationReport)
    for f in report.findings:
        assert f.code in FINDING_CODES and f.level == ("warning" if f.code in WARNING_CODES else "error") and f.message
    assert report.ok == all(f.level == "warning" for f in report.findings)
    # A keyword argument validation cannot use is an argument error naming it and its value, and
    # the only finding: the devices are not looked at with it.
    bad = {name for name, value in kwargs.items() if not usable_argument(name, value)}
    named = [f.message.split(" ")[0] for f in report.findings if f.code == "argument"]
    assert sorted(named) == sorted(bad), report
    assert all(says(f.message, kwargs[f.message.split(" ")[0]]) for f in report.findings if f.code == "argument")
    if bad:
        assert len(named) == len(report.findings) and report.devices == () and not report.ok
    if report.ok:
        cpu = [d for d in report.devices if d.kind == "cpu"]
        cores = (kwargs.get("probe") or PROBE).cpu_count()
        assert len(cpu) <= CPU_WORKERS_PER_CORE * cores


@pytest.mark.parametrize("cpus", [1, 2, 64])
def test_more_cpu_workers_than_the_limit_are_refused_naming_it(cpus):
    most = CPU_WORKERS_PER_CORE * cpus
    assert validate_devices(f"cpu*{most}", probe=StaticProbe(cpus=cpus)).ok
    r = validate_devices(f"cpu*{most + 1}", probe=StaticProbe(cpus=cpus))
    assert [f.code for f in r.errors] == ["too_many"]
    assert f"{most + 1} CPU workers are too many" in r.errors[0].message and f"at most {most}" in r.errors[0].message


# ---- launch options, launch() and spawn() ---------------------------------------------------------------

option_values = {
    "backend": either(None, "gloo"),
    "min_free_memory": either(None, 0, 1),
    "stall_timeout": either("auto", None, 30.0, 1),
    "timeout": either(1800.0, 5, 0.1),
    "run_root": st.one_of(either(None, "runs"), st.text(max_size=8)),
    "threads_per_worker": either(None, 1, 4),
    "stop_grace": either(10.0, 0, 1),
    "kill_grace": either(3.0, 0),
    "progress_interval": either(0.1, 0),
    "env": st.one_of(st.dictionaries(st.sampled_from(["A", "B_2", "", "X=Y", "N\x00"]),
                                     either("1", "", "a\x00b"), max_size=2), anything),
    "engines": either(None),
}
launch_options = some_of(option_values, 4)


def check_option_error(e, options):
    assert isinstance(e, DDPNotebookError), repr(e)
    assert any(says(e, v) for v in options.values()) or "unexpected keyword" in str(e), str(e)


@fuzz
@given(launch_options)
def test_every_launch_option_is_checked_and_named(options):
    try:
        o = LaunchOptions(**options)
    except DDPNotebookError as e:
        check_option_error(e, options)
    else:
        for name in ("timeout", "stop_grace", "kill_grace", "progress_interval"):
            value = getattr(o, name)
            assert type(value) in (int, float) and math.isfinite(value) and value >= 0
        assert o.stall_timeout in ("auto", None) or (type(o.stall_timeout) in (int, float) and o.stall_timeout > 0)
        assert all(type(k) is str and type(v) is str for k, v in o.env.items())


def train(ctx, steps=1, lr=0.1):
    return steps


@fuzz
@given(st.one_of(st.just(train), anything), st.one_of(st.sampled_from([None, "cpu*2", "cpu:0"]), device_spec),
       st.one_of(st.sampled_from([(), (3,), [3, 0.1]]), anything),
       either(None, {}, {"lr": 0.5}), launch_options,
       st.dictionaries(st.sampled_from(["stall", "epochs", "device"]), anything, max_size=1))
def test_launch_starts_or_refuses_with_our_error(quiet, fn, devices, args, kwargs, options, unknown):
    try:
        run = ddp_notebook.launch(fn, devices, args, kwargs, **options, **unknown)
    except DDPNotebookError as e:
        assert str(e)
        if unknown and callable(fn) and isinstance(args, (tuple, list)) and \
                (kwargs is None or (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs))):
            # the function and its arguments are what launch takes: the unknown keyword is refused, by name
            assert "unexpected keyword" in str(e) and all(repr(name) in str(e) for name in unknown), str(e)
    else:
        assert isinstance(run, Run) and not unknown and callable(fn)
        assert isinstance(args, (tuple, list))


@fuzz
@given(st.one_of(st.just(train), anything), either((), (2,)),
       st.one_of(either(None, 1, 2), st.integers()), either(True, False),
       st.one_of(st.sampled_from([None, "cpu*2"]), device_spec), launch_options)
def test_spawn_starts_or_refuses_with_our_error(quiet, fn, args, nprocs, join, devices, options):
    try:
        ddp_notebook.spawn(fn, args, nprocs, join, devices, **options)
    except DDPNotebookError as e:
        assert str(e)
    else:
        assert nprocs is None or (type(nprocs) is int and nprocs >= 1)
        assert isinstance(join, bool)


# ---- fit() -------------------------------------------------------------------------------------------

X = torch.randn(16, 2)
Y = X.sum(1, keepdim=True)
MODEL = torch.nn.Linear(2, 1)
FIT_ARGS = {
    "epochs": either(1, 2),
    "batch_size": either(4, 8),
    "valid_batch_size": either(None, 4),
    "shuffle": either(True, False),
    "drop_last": either(True, False),
    "grad_accum": either(1, 2),
    "early_stopping": either(None, 1, 3),
    "monitor": either(None, "train_loss", "valid_loss", "mae"),
    "mode": either("min", "max"),
    "min_delta": either(0.0, 0.01, 1),
    "checkpoint": either(True, False),
    "preflight": st.sampled_from([False, False, False, True, 1, None]),
    "seed": either(0, 1234, 2**63 - 1),
    "wait": either(True, False),
    "metrics": either(None, {}, {"mae": torch.nn.L1Loss()}),
    "optimizer": either(None, torch.optim.SGD),
    "devices": st.one_of(st.sampled_from([None, "cpu*2", "cpu:0"]), device_spec),
    "valid_data": st.sampled_from([None, (X[:8], Y[:8])]),
    "timeout": option_values["timeout"],
    "threads_per_worker": option_values["threads_per_worker"],
    "stall_timeout": option_values["stall_timeout"],
}


@fuzz
@given(some_of(FIT_ARGS, 5), st.one_of(st.just(torch.nn.MSELoss()), anything))
def test_fit_checks_its_arguments_in_the_notebook(monkeypatch, tmp_path_factory, kwargs, loss):
    launched = []
    monkeypatch.setattr(probes, "_default", PROBE)
    monkeypatch.setenv("DDP_NOTEBOOK_PROGRESS", "0")
    monkeypatch.setattr(fit_module, "launch_with", lambda *a, **k: launched.append(a) or "started")
    monkeypatch.setattr(fit_module, "wait_showing", lambda run: run)
    try:
        out = ddp_notebook.fit(MODEL, (X, Y), loss, **kwargs)
    except ddp_notebook.errors.PreflightError as e:  # a loss or optimizer that is a function, the wrong one
        assert not launched and isinstance(e.__cause__, Exception)
    except DDPNotebookError as e:
        assert not launched
        assert any(says(e, v) for v in [*kwargs.values(), loss]) or "batch" in str(e), str(e)
    else:
        assert out == "started" and len(launched) == 1
        for name in ("shuffle", "drop_last", "checkpoint", "preflight", "wait"):
            assert isinstance(kwargs.get(name, True), bool)
        for name in ("epochs", "batch_size", "grad_accum", "seed"):
            assert type(kwargs.get(name, 1)) is int


# ---- Run: stop, wait, retry, load --------------------------------------------------------------------------

@fuzz
@given(st.one_of(either(None, 0, 0.5, 60), st.floats(), st.integers()), either(True, False),
       st.one_of(either(None, 0, 10.0), st.floats(), st.integers()))
def test_wait_and_stop_check_their_arguments(timeout, wait, grace):
    try:
        assert SUCCEEDED.wait(timeout=timeout) == 4.0
    except DDPNotebookError as e:
        assert says(e, timeout)
    try:
        SUCCEEDED.stop(grace=grace, wait=wait)
    except DDPNotebookError as e:
        assert says(e, grace) or says(e, wait)


def test_wait_refuses_a_timeout_it_cannot_wait():
    run = a_run("20260101-000003-dddddd", finished=False)
    for timeout in (math.nan, -1, "5", True, 1e300):
        with pytest.raises(ddp_notebook.errors.LaunchOptionError, match="timeout"):
            run.wait(timeout=timeout)
    with pytest.raises(ddp_notebook.errors.WaitTimeoutError):
        run.wait(timeout=0)


@fuzz
@given(st.one_of(st.sampled_from([None, "cpu:0", "cpu:1", Device("cpu", 3)]), device_spec),
       either(True, False), st.one_of(st.none(), device_spec),
       st.one_of(st.just({}), st.dictionaries(st.sampled_from([*OPTION_NAMES, "epochs", "grace"]), anything,
                                              max_size=2)))
def test_retry_starts_or_refuses_with_our_error(quiet, device, resume, devices, changes):
    try:
        new = FAILED.retry(device=device, resume=resume, devices=devices, **changes)
    except DDPNotebookError as e:
        assert str(e)
    else:
        assert isinstance(new, Run) and resume is False


LOG_LINES = ['{"kind": "run_started"}', '{"kind": "run_started", "devices": 5}', '{"kind": "run_started", '
             '"devices": ["tpu:0"]}', '[1, 2]', '{"kind": 3}', '{"kind": "run_finished", "status": "bogus"}',
             '{"kind": "failure"}', '{"kind": "output", "rank": 0}', 'null', '{"kind": "progress", "rank": 0}',
             '{"kind": "run_started", "devices": ["cpu:0"], "places": 7}', '{', 'x', '"\\ud800"', '',
             '{"kind": "run_started", "devices": ["cpu:0"]}', '{"kind": "run_finished", "status": "succeeded"}',
             '{"kind": "exited", "rank": 0, "time": "late"}', '{"kind": "output", "rank": 0, "stream": "stdout", '
             '"text": 5}']
START = LOG_LINES.index('{"kind": "run_started", "devices": ["cpu:0"]}')


@pytest.fixture(scope="module")
def run_folders(tmp_path_factory):
    """Folders that are runs, or look like one: every log line alone, after a good start, and
    before a good end; a log that is not UTF-8; a result that is a folder."""
    logs = [[line] for line in LOG_LINES] + [[LOG_LINES[START], line] for line in LOG_LINES]
    logs += [[LOG_LINES[START], line, LOG_LINES[START + 1]] for line in LOG_LINES]
    folders = []
    for i, lines in enumerate([*logs, None, "result-is-a-folder"]):
        folder = tmp_path_factory.mktemp(f"run{i}")
        folder.chmod(0o700)
        if lines is None:
            (folder / RunDir.EVENTS).write_bytes(b"\xff\xfe\x00")
        elif lines == "result-is-a-folder":
            (folder / RunDir.EVENTS).write_text("\n".join(logs[START]))
            (folder / RunDir.RESULT).mkdir()
        else:
            (folder / RunDir.EVENTS).write_text("\n".join(lines))
        folders.append(str(folder))
    return folders


@fuzz
@given(st.one_of(anything, st.text(max_size=30), st.sampled_from(["", ".", "/", "~", "..", "no-such-run"])),
       st.one_of(st.none(), st.integers(0, 3 * len(LOG_LINES) + 1)))
def test_run_load_reads_a_run_or_says_there_is_none(run_folders, tmp_path_factory, monkeypatch, path, folder):
    monkeypatch.setenv("DDP_NOTEBOOK_RUNS", str(tmp_path_factory.getbasetemp() / "runs"))
    if folder is not None:
        path = run_folders[folder]
    try:
        run = Run.load(path)
    except (ddp_notebook.errors.RunLoadError, ddp_notebook.errors.UnsafeRunDirError) as e:
        assert str(e)
    else:
        assert run.done and isinstance(run.status, str)


# ---- the magics, in a real IPython shell ------------------------------------------------------------

@pytest.fixture(scope="module")
def shell(ipython_shell):
    ipython_shell.register_magics(magics_module.DDPMagics)  # the magics only: no pool, no process
    ipython_shell.user_ns.update(
        train=train, config=dict(model=lambda: torch.nn.Linear(2, 1), train_data=(X, Y), loss=torch.nn.MSELoss(),
                                 batch_size=4, preflight=False),
        tensor=X, number=3, builtin=dict, not_a_view=object())
    yield ipython_shell
    set_default_devices(None)


@pytest.fixture
def runs(shell, quiet, monkeypatch):
    """This kernel's runs: a failed one, a running one (it never ran), a succeeded one; any retry
    or %ddp_fit "starts" a run that never runs."""
    made = [FAILED, RUNNING, SUCCEEDED]
    monkeypatch.setattr(launch_module, "_runs", deque(made))
    monkeypatch.setattr(magics_module, "show_run", lambda run, **kw: None)
    monkeypatch.setattr(magics_module, "show_report", lambda report: None)
    return made


def magic(shell, name, line):
    """Run ``%name line``: its value, or the UsageError it raised (any other error fails the test).
    The line goes to the magic as typed (``run_line_magic`` would first expand ``$x`` and ``{x}``,
    IPython's business, and slowly for a line of thousands of digits)."""
    with capture_output():
        try:
            return shell.find_line_magic(name)(line)
        except UsageError as e:
            assert str(e).strip()
            return e


WORDS = WEIRD_TEXT + [
    "train", "config", "tensor", "number", "builtin", "not_a_view", "nothing", "train()", "train(2)",
    "train(steps=2, lr=0.5)", "train(number)", "train(nothing)", "train(1 + 2j)", "train({[1]: 2})", "train(*x)",
    "train(**x)", "train(", "train(\x00)", "train(lambda: 1)", "train(" + "(" * 300 + ")", "train(" + "9" * 5000 + ")",
    "cpu*2", "cpu:0,cpu:1", "cpu:0, cpu:1", "'cpu:0,cpu:1'", "cpu*1024", "cuda", "cpu:٣", "-1", "nan", "aaaaaa",
    "bbbbbb", "cccccc", "20260101-000000-aaaaaa", "--epochs", "--batch-size", "--stall-timeout", "--devices", "-d",
    "--engines", "--wait", "--grace", "--device", "--resume", "--without-failed", "-h", "--help", "--dev", "--", "-",
    "--epochs=2", "--grace=-1", "--stall-timeout=nan", "--engines=tensor", "--engines=not_a_view", "--devices=cpu*2"]
word = st.one_of(st.sampled_from(WORDS), st.text(max_size=8))
magic_line = st.lists(word, max_size=6).map(" ".join)


@pytest.mark.parametrize("name", ["ddp_fit", "ddp_devices", "ddp_stop", "ddp_retry", "ddp_status", "ddp_runs"])
@fuzz
@given(line=magic_line)
def test_a_magic_runs_or_gives_a_usage_error(runs, shell, name, line):
    magic(shell, name, line)


values = st.one_of(weird_text, st.text(max_size=6).filter(lambda v: v != "--"), st.sampled_from(["-5", "0", "1", "2", "1e3", "1e999", "-0", "3.5",
                                                                    "٣", "nan", "-nan", "inf", "1" * 30]))


def quoted(text):
    return "'" + text.replace("'", "") + "'"


def names(error, value):
    """A magic's error names the value as it was typed (quotes aside)."""
    typed = value.replace("'", "")
    return typed in str(error) or repr(typed) in str(error)


@fuzz
@given(st.sampled_from(["ddp_fit config --epochs", "ddp_fit config --batch-size", "ddp_fit config --stall-timeout",
                        "ddp_stop bbbbbb --grace"]), values)
def test_a_magic_names_a_bad_option_value(runs, shell, command, value):
    name, _, rest = command.partition(" ")
    out = magic(shell, name, f"{rest}={quoted(value)}")
    typed = value.replace("'", "")
    if isinstance(out, UsageError):
        assert names(out, value)
    elif not (command.endswith("--stall-timeout") and typed.lower() in ("auto", "off")):
        number = float(typed)  # only a number in range got through, written in ASCII
        assert typed.isascii() and math.isfinite(number) and number >= 0
        assert number > 0 or command.endswith("--grace")
        assert number == int(number) or not command.endswith(("--epochs", "--batch-size"))


device_text = st.one_of(st.lists(device_item, max_size=4).map(",".join), st.text(max_size=20))


@fuzz
@given(st.sampled_from(["ddp_devices", "ddp_fit train --devices", "ddp_retry aaaaaa --device"]), device_text)
def test_a_bad_device_list_is_a_usage_error_or_a_report(runs, shell, command, spec):
    name, _, rest = command.partition(" ")
    magic(shell, name, f"{rest} {quoted(spec)}")
