"""Launch options: declared once, shown in every entry point's signature, checked before a start."""
import inspect
import re

import pytest

import ddp_notebook
from ddp_notebook.errors import LaunchOptionError
from ddp_notebook.lifecycle.call import check_arguments


@pytest.mark.parametrize("option, value, words", [
    ("timeout", float("inf"), "timeout must be a number of seconds > 0, not inf"),
    ("timeout", 0, "timeout must be a number of seconds > 0, not 0"),
    ("stall_timeout", -2.0, "stall_timeout must be a number of seconds > 0, 'auto' or None, not -2.0"),
    ("stop_grace", float("nan"), "stop_grace must be a number of seconds >= 0, not nan"),
    ("kill_grace", "3", "kill_grace must be a number of seconds >= 0, not '3'"),
    ("progress_interval", True, "progress_interval must be a number of seconds >= 0, not True"),
    ("threads_per_worker", 0, "threads_per_worker must be a whole number >= 1 or None, not 0"),
    ("min_free_memory", 1.5, "min_free_memory must be a whole number >= 0 or None, not 1.5"),
])
def test_a_bad_option_is_refused_before_anything_starts(option, value, words, tmp_path):
    with pytest.raises(LaunchOptionError) as e:
        ddp_notebook.launch(lambda ctx: None, devices="cpu:0", run_root=str(tmp_path), **{option: value})
    assert str(e.value) == words and list(tmp_path.iterdir()) == []


def test_an_unknown_option_names_the_known_ones():
    with pytest.raises(TypeError, match=r"^launch\(\) got unexpected keyword argument\(s\) 'stall'; launch options "
                                        r"are backend, engines, env, kill_grace"):
        ddp_notebook.launch(lambda ctx: None, devices="cpu:0", stall=3)


@pytest.mark.parametrize("entry", [ddp_notebook.launch, ddp_notebook.fit, ddp_notebook.spawn])
def test_every_entry_point_shows_every_option(entry):
    params = inspect.signature(entry).parameters
    for name in ("stall_timeout", "kill_grace", "engines", "env", "run_root"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY and name in entry.__doc__
    assert params["timeout"].default == 1800.0 and params["env"].default == {}


def test_arguments_the_function_cannot_take_are_refused_before_anything_starts(tmp_path):
    def train(ctx, steps, lr=0.1):
        return steps

    with pytest.raises(ddp_notebook.errors.ArgumentsError, match=r"^train\(ctx, \.\.\.\) cannot take these arguments: "
                                                          r"missing a required argument: 'steps'$"):
        ddp_notebook.launch(train, devices="cpu*2", run_root=str(tmp_path))
    with pytest.raises(ddp_notebook.errors.ArgumentsError, match=r"^train\(rank, \.\.\.\) cannot take these arguments"):
        ddp_notebook.spawn(train, args=(1, 2, 3), nprocs=2, run_root=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fn, words", [
    ("def train(steps): pass", "train(steps) does not take the worker context: write def train(ctx, steps) ("),
    ("def train(steps=5, lr=0.1): pass", "write def train(ctx, steps=5, lr=0.1) ("),
    ("def train(*, steps): pass", "write def train(ctx, *, steps) ("),
    ("def train(): pass", "train() does not take the worker context: write def train(ctx) ("),
    ("def train(steps: int): pass", "train(steps) does not take the worker context"),
    ("train = lambda: 1", "the lambda does not take the worker context: write lambda ctx: ... ("),
])
def test_a_function_without_the_worker_context_is_named_before_anything_starts(tmp_path, fn, words):
    scope: dict = {}
    exec(fn, scope)
    with pytest.raises(ddp_notebook.errors.ArgumentsError, match=re.escape(words)):
        ddp_notebook.launch(scope["train"], devices="cpu*2", run_root=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fn", ["def train(ctx, steps=1): pass", "def train(context): pass",
                                "def train(worker_ctx): pass", "def train(c: 'WorkerContext'): pass",
                                "def train(*args): pass"])
def test_the_usual_ways_to_take_the_context_pass_the_check(fn):
    scope: dict = {}
    exec(fn, scope)
    check_arguments(scope["train"], "ctx", (), {})


@pytest.mark.processes  # the run it stops is a real one
@pytest.mark.parametrize("grace", [float("nan"), -1.0, float("inf"), "5"])
def test_a_stop_grace_that_would_never_end_the_stop_is_refused(grace):
    run = ddp_notebook.launch(lambda ctx: ctx.rank, devices="cpu:0")
    try:
        with pytest.raises(LaunchOptionError, match=r"^grace must be a number of seconds >= 0, not "):
            run.stop(grace=grace)
        assert not run.stop_requested
    finally:
        run.wait(timeout=60)


@pytest.mark.unit
@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", 10_000])
def test_max_restarts_takes_a_whole_number(bad):
    from ddp_notebook.lifecycle.options import LaunchOptions

    with pytest.raises(LaunchOptionError, match="max_restarts must be a whole number from 0 to 1000, not"):
        LaunchOptions(max_restarts=bad)
    assert LaunchOptions(max_restarts=3).max_restarts == 3


@pytest.mark.unit
def test_a_session_refuses_max_restarts_before_anything_starts():
    with pytest.raises(LaunchOptionError, match="a session does not take max_restarts: session.restart"):
        ddp_notebook.session("cpu*2", max_restarts=1)
