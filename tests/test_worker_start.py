"""How a rank's process starts: forked by the fork server, or a fresh interpreter where there is
none; either way with the notebook's environment and directory as they are at launch. The warm
pool of earlier releases is retired: its API warns and starts the fork server."""
import warnings

import pytest

import ddp_notebook
from ddp_notebook.executors.local import forkserver

import faults

pytestmark = pytest.mark.processes


@pytest.fixture(params=["forked", "fresh"])
def how(request):
    if request.param == "fresh":
        forkserver.disable()
    yield request.param
    forkserver.enable()


def test_workers_see_the_notebooks_environment_and_directory_at_launch(how, monkeypatch, tmp_path):
    monkeypatch.setenv("DDP_NB_REMOVED_LATER", "set in an earlier cell")
    if how == "forked":  # the server started while the variable was set
        ddp_notebook.launch(faults.ddp_steps, devices="cpu*2").wait(timeout=120)
    monkeypatch.setenv("DDP_NB_SET_LATER", "in a later cell")
    monkeypatch.delenv("DDP_NB_REMOVED_LATER")
    monkeypatch.chdir(tmp_path)
    run = ddp_notebook.launch(faults.environment, devices="cpu*2", args=(("DDP_NB_SET_LATER", "DDP_NB_REMOVED_LATER"),))
    seen, cwd = run.wait(timeout=120)
    assert seen == {"DDP_NB_SET_LATER": "in a later cell", "DDP_NB_REMOVED_LATER": None}
    assert cwd == str(tmp_path)


def test_input_on_a_rank_says_that_nothing_can_answer_it(how):
    with pytest.raises(ddp_notebook.WorkerFailedError, match=r"failed the same way: EOFError: a worker has no "
                                                             r"standard input: input\(\) cannot be answered"):
        ddp_notebook.launch(faults.asks_for_input, devices="cpu*2").wait(timeout=120)


def test_what_utf8_cannot_carry_is_printed_escaped_not_raised(how):
    run = ddp_notebook.launch(faults.prints_a_lone_surrogate, devices="cpu*2")
    assert run.wait(timeout=120) == 0 and run.output(1) == "x\\ud800\n"


def test_a_worker_imports_the_packages_api_only_when_its_code_asks_for_it(how):
    """A rank imports the submodules it runs; the package's ``__init__`` (the API, the front ends:
    ipywidgets and 220 modules, 0.2 s of a fresh interpreter's start) only when code asks the
    package for a name, and then whole."""
    before, failed, cell, loaded = ddp_notebook.launch(faults.front_ends_loaded_then_the_api,
                                                       devices="cpu*2").wait(timeout=120)
    assert before == [] and (failed, cell, loaded) == ("WorkerFailedError", "CellError", True)


def test_the_retired_pool_warns_and_starts_the_fork_server():
    forkserver.stop()
    with pytest.warns(DeprecationWarning, match=r"ddp_notebook.pool.enable\(\) is deprecated"):
        ddp_notebook.pool.enable(2)
    assert forkserver.status()["running"]  # what %load_ext does: the next launch forks its workers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert ddp_notebook.pool.status() == {"enabled": False, "size": 0, "idle": 0}
        ddp_notebook.pool.disable()
    assert ddp_notebook.launch(faults.ddp_steps, devices="cpu*2").wait(timeout=120) == [32.0, 32.0]


@pytest.mark.kernel
def test_load_ext_starts_the_fork_server(ipython_shell):
    forkserver.stop()
    ipython_shell.run_line_magic("load_ext", "ddp_notebook")
    ipython_shell.run_line_magic("reload_ext", "ddp_notebook")
    assert forkserver.status()["running"]
