"""Runs on ipyparallel engines: a real local cluster (controller and engines on loopback),
real gloo between the engines, faults on the main and on a secondary rank.

After every test the engines must be idle and as they were: no process group, no RANK in
the environment, ipykernel's SIGINT handling back, no context (``engines_left_clean``)."""
import contextlib
import glob
import ipaddress
import os
import tempfile
import time

import ipyparallel as ipp
import psutil
import pytest
import torch

import ddp_notebook
from ddp_notebook import InvalidDevicesError, WorkerFailedError
from ddp_notebook.errors import EngineSelectionError, EngineUnavailableError, NotPicklableError
from ddp_notebook.executors.ipyparallel.engines import Engines
from ddp_notebook.executors.ipyparallel.network_plan import NetworkPlan

import faults
from helpers import CONTROLLER_ARGS, wait_for, wait_until

pytestmark = pytest.mark.engines

CLEAN = {"process_group": False, "rank_env": None, "sigint": True, "context": False, "torchs_init": True}


@contextlib.contextmanager
def local_cluster(n=2):
    cluster = ipp.Cluster(n=n, log_level=40, controller_args=CONTROLLER_ARGS)
    client = cluster.start_and_connect_sync()
    # The engines import the test helpers (faults) by name, as a user's engines would their own
    # modules; runs leave the engines' sys.path as they found it.
    # (apply_sync(sys.path.insert, ...) would insert into a copy of this process's sys.path)
    client[:].execute(f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})", block=True)
    # The controller may still count that task as queued a moment after its reply came: a cluster
    # is ready once it lists every engine idle.
    wait_until(lambda: engines_idle(client), timeout=60)
    try:
        yield client
    finally:
        client.close()
        cluster.stop_cluster_sync()


def engines_idle(client):
    """Whether the controller lists no task queued or running on any engine."""
    status = client.queue_status(verbose=False)
    return all(s.get("queue", 0) == 0 and s.get("tasks", 0) == 0 for s in status.values() if isinstance(s, dict))


@pytest.fixture(scope="module")
def cluster_client():
    with local_cluster(2) as client:
        yield client


@pytest.fixture
def rc(cluster_client):
    yield cluster_client
    assert_engines_clean(cluster_client)


def assert_engines_clean(client):
    # A busy engine would not answer: this also proves that no rank is still running.
    states = client[:].apply_async(faults.engine_is_clean).get(timeout=30)
    for state in states:
        assert {k: state[k] for k in CLEAN} == CLEAN, state


def test_launch_runs_one_rank_per_engine(rc):
    engine_pids = rc[:].apply_sync(__import__("os").getpid)
    run = ddp_notebook.launch(faults.ddp_steps, engines=rc, kwargs={"steps": 4})
    assert run.wait(timeout=60) == [16.0, 16.0]  # ones, all-reduced (summed) over two ranks four times
    assert [w.pid for w in run.workers] == engine_pids
    assert [w.status for w in run.workers] == ["succeeded", "succeeded"]
    assert [(w.step, w.total) for w in run.workers] == [(4, 4), (4, 4)]
    assert run.state.devices == ["cpu:0", "cpu:1"]


def test_engines_get_a_tensor_by_value_where_local_workers_map_it(rc):
    data = torch.ones(2**16)  # 256 kB: shared memory for local workers
    run = ddp_notebook.launch(faults.data_steps, engines=rc, args=(data,))
    assert run.wait(timeout=60) == [32.0, 32.0] and run.state.data is None  # sent by value, no shared memory


def test_local_rank_counts_the_ranks_on_the_engines_host(rc):
    def where(ctx):
        return [ctx.local_rank, ctx.local_world_size, os.environ["LOCAL_RANK"]]

    def all_ranks(ctx):
        out = [None] * ctx.world_size
        __import__("torch").distributed.all_gather_object(out, where(ctx))
        return out

    # both engines of this cluster are on this host
    assert ddp_notebook.launch(all_ranks, engines=rc).wait(timeout=60) == [[0, 2, "0"], [1, 2, "1"]]


def test_output_of_each_engine_is_kept_per_rank(rc):
    def hello(ctx):
        print(f"hello from rank {ctx.rank} of {ctx.world_size}")
        return ctx.rank

    run = ddp_notebook.launch(hello, engines=rc)
    assert run.wait(timeout=60) == 0
    assert run.output(0) == "hello from rank 0 of 2\n"
    assert run.output(1) == "hello from rank 1 of 2\n"


def test_the_same_fit_on_engines_as_on_local_workers(rc):
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def model():
        torch.manual_seed(1)
        return torch.nn.Linear(4, 1)

    common = dict(loss=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.05), epochs=3,
                  batch_size=16, shuffle=False, checkpoint=False)
    on_engines = ddp_notebook.fit(model, (x, y), engines=rc, **common)
    local = ddp_notebook.fit(model, (x, y), devices="cpu*2", **common)
    assert on_engines.ranks_in_sync
    assert on_engines.history[-1]["train_loss"] < on_engines.history[0]["train_loss"] / 2
    for a, b in zip(on_engines.model.parameters(), local.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_fit_with_an_optuna_trial_on_engines_reports_each_epoch_and_is_pruned(rc):
    # Engines take no request from the notebook outside a session: the trial's verdicts cannot come,
    # and the fit's epochs must not wait for them (a minute each), nor the trial's thread fail.
    optuna = pytest.importorskip("optuna")
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True)
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=0.0, n_warmup_steps=1))
    trial = study.ask()
    started = time.monotonic()
    with pytest.raises(optuna.TrialPruned):
        ddp_notebook.fit(torch.nn.Linear(4, 1), (x, y), loss=torch.nn.functional.mse_loss,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.0), epochs=500, batch_size=16, engines=rc,
                         trial=trial)
    assert time.monotonic() - started < 50, "an epoch waited for a verdict that cannot come"
    assert sorted(study.trials[0].intermediate_values)[:2] == [0, 1]


def test_gloo_between_engines_listens_on_loopback_only(rc):
    run = ddp_notebook.launch(faults.wait_for_stop, engines=rc)
    try:
        wait_for(run, lambda s: all((w.step or 0) >= 1 for w in s.workers.values()))
        listening = []
        for w in run.workers:
            listening += [c.laddr for c in psutil.Process(w.pid).net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
        assert listening
        assert all(ipaddress.ip_address(a.ip).is_loopback for a in listening), listening
    finally:
        run.stop(grace=5, wait=True)
    assert run.status == "stopped"


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_rank_that_raises_is_named_and_its_peer_is_a_consequence(rc, bad_rank):
    run = ddp_notebook.launch(faults.ddp_steps, engines=rc, kwargs=dict(fault="raise", bad_rank=bad_rank))
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    name = "main worker" if bad_rank == 0 else "worker 1"
    assert str(e.value).startswith(f"Distributed data parallel {name} (cpu:{bad_rank} on engine {bad_rank}) "
                                   "failed: ValueError: boom at step 3")
    assert 'raise ValueError(f"boom at step {step}")' in e.value.failure.traceback
    assert os.path.join("ddp_notebook", "worker") not in e.value.failure.traceback
    assert all(f.consequence for f in run.failures if f is not e.value.failure)
    assert run.status == "failed"


def test_stop_asks_every_engine_and_the_function_returns(rc):
    run = ddp_notebook.launch(faults.wait_for_stop, engines=rc)
    wait_for(run, lambda s: all((w.step or 0) >= 1 for w in s.workers.values()))
    run.stop(wait=True)
    assert run.status == "stopped" and [w.status for w in run.workers] == ["stopped", "stopped"]
    assert run.wait().startswith("stopped at step ")  # the main worker's own return value


def test_stop_interrupts_engines_that_ignore_it(rc):
    run = ddp_notebook.launch(faults.wait_for_stop, engines=rc, kwargs={"honour": False}, stop_grace=0.5)
    wait_for(run, lambda s: all((w.step or 0) >= 1 for w in s.workers.values()))
    run.stop(wait=True)
    assert run.status == "stopped" and [w.status for w in run.workers] == ["stopped", "stopped"]
    assert not run.failures
    with pytest.raises(ddp_notebook.errors.RunStoppedError, match="was stopped"):
        run.wait()


def test_a_naive_stop_between_collectives_is_a_stop_not_a_failure(rc):
    run = ddp_notebook.launch(faults.allreduce_until_stopped, engines=rc, stop_grace=1.0)
    wait_for(run, lambda s: all((w.step or 0) >= 3 for w in s.workers.values()))
    run.stop(wait=True)
    assert run.status == "stopped" and not run.failures, [f.headline() for f in run.failures]
    assert {w.status for w in run.workers} <= {"succeeded", "stopped"}


def test_stall_names_the_straggler_engine_with_its_stack(rc):
    run = ddp_notebook.launch(faults.ddp_steps, engines=rc, kwargs=dict(fault="stall", bad_rank=1),
                              stall_timeout=2.0)
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    assert str(e.value).startswith("Distributed data parallel worker 1 (cpu:1 on engine 1) failed: stalled: "
                                   "no progress for")
    assert "time.sleep(3600)" in e.value.failure.traceback
    assert os.path.join("ddp_notebook", "worker") not in e.value.failure.traceback
    assert "ipykernel" not in e.value.failure.traceback


@pytest.mark.parametrize("bad_rank, kept", [(1, 0), (0, 1)])
def test_retry_runs_on_the_engine_of_a_healthy_rank(rc, bad_rank, kept):
    run = ddp_notebook.launch(faults.ddp_steps, engines=rc, kwargs=dict(fault="raise", bad_rank=bad_rank, at_step=2))
    with pytest.raises(WorkerFailedError):
        run.wait(timeout=60)
    again = run.retry()
    assert again.options.engines.ids == (rc.ids[kept],) and [str(d) for d in again.devices] == [f"cpu:{kept}"]
    if bad_rank == 0:  # the fault is on rank 0, which the retry has too: it reproduces alone
        with pytest.raises(WorkerFailedError, match=r"main worker \(cpu:1 on engine 1\) failed: ValueError"):
            again.wait(timeout=60)
    else:
        assert again.wait(timeout=60) == [1.0, 1.0]
        assert again.workers[0].pid == run.workers[0].pid


def test_an_argument_that_fails_to_load_on_an_engine_is_a_startup_failure(rc):
    run = ddp_notebook.launch(faults.takes_arg, engines=rc, args=(faults.LoadFault(1, "raise"),))
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    assert str(e.value).startswith("Distributed data parallel worker 1 (cpu:1 on engine 1) failed: the function "
                                   "or its arguments could not be unpickled in the worker: ModuleNotFoundError")


def test_unpicklable_function_is_refused_before_any_engine_runs(rc):
    import threading

    lock = threading.Lock()
    with pytest.raises(NotPicklableError, match="lock"):
        ddp_notebook.launch(lambda ctx: lock.acquire(), engines=rc)


def test_bad_engine_selections_are_refused_with_what_would_be_valid(rc):
    with pytest.raises(InvalidDevicesError, match=r"3 devices for 2 engines \(ids 0, 1\): each engine runs one rank"):
        ddp_notebook.launch(faults.takes_arg, engines=rc, args=(1,), devices="cpu*3")
    with pytest.raises(InvalidDevicesError, match="engine 7 is not available"):
        ddp_notebook.launch(faults.takes_arg, engines=Engines(rc, [0, 7]), args=(1,))
    with pytest.raises(EngineSelectionError, match="engines= takes an ipyparallel Client .* not str"):
        ddp_notebook.launch(faults.takes_arg, engines="rc", args=(1,))
    with pytest.raises(InvalidDevicesError, match=r"cuda:0 does not exist on engine 0 \(host .*\): it sees no CUDA device"):
        ddp_notebook.launch(faults.takes_arg, engines=rc, args=(1,), devices="cuda:0,cuda:1")


def test_an_engine_whose_task_ends_during_validation_gets_the_full_time_to_answer():
    import time

    with local_cluster(1) as client:
        client[0].apply_async(time.sleep, 0.8)  # busy when validation starts, idle long before any deadline
        wait_until(lambda: not engines_idle(client), timeout=30)  # the controller lists it as busy
        info = Engines(client, [0]).describe()  # its first answer imports torch: more than the rest of the second
        assert "error" not in info[0], info


def test_an_engine_busy_with_another_task_is_said_to_be_busy():
    import signal
    import time

    with local_cluster(1) as client:
        pid = client[0].apply_sync(os.getpid)
        client[0].apply_async(time.sleep, 30)  # busy all through validation
        wait_until(lambda: not engines_idle(client), timeout=30)
        started = time.monotonic()
        info = Engines(client, [0]).describe()
        assert info[0]["error"].startswith("engine 0 is busy with another task"), info
        assert time.monotonic() - started < 15  # not the whole 30 s: the busy wait
        # The sleep interrupted (KeyboardInterrupt in the task): an engine that is still busy would
        # hold the cluster's stop for its 5 s before it is killed.
        os.kill(pid, signal.SIGINT)
        wait_until(lambda: engines_idle(client), timeout=30)


# Each death on one rank at least, and each rank twice (a cluster each: about 10 s a case).
@pytest.mark.parametrize(("bad_rank", "fault"), [(0, "segfault"), (0, "sigkill"), (1, "exit"), (1, "segfault")])
def test_an_engine_that_dies_is_the_cause_not_its_peer(bad_rank, fault):
    # The engine dies: a cluster of its own, stopped at the end, so no test is left short of one.
    stack_files = set(glob.glob(os.path.join(tempfile.gettempdir(), "ddp-notebook-stacks-*")))
    with local_cluster(2) as client:
        run = ddp_notebook.launch(faults.ddp_steps, engines=client, kwargs=dict(fault=fault, bad_rank=bad_rank))
        with pytest.raises(WorkerFailedError) as e:
            run.wait(timeout=60)
        # The dead engine's stack file went with it (it was unlinked as soon as it was open).
        assert set(glob.glob(os.path.join(tempfile.gettempdir(), "ddp-notebook-stacks-*"))) <= stack_files
        name = "main worker" if bad_rank == 0 else "worker 1"
        assert str(e.value).startswith(f"Distributed data parallel {name} (cpu:{bad_rank} on engine {bad_rank}) "
                                       f"failed: engine {bad_rank} died")
        assert e.value.failure.kind == "engine" and not e.value.failure.consequence
        assert all(f.consequence for f in run.failures if f is not e.value.failure)
        survivor = client[1 - bad_rank].apply_sync(faults.engine_is_clean)  # idle again, and as it was
        assert {k: survivor[k] for k in CLEAN} == CLEAN
        if bad_rank == 1:  # the retry runs on the survivor (on rank 0 the fault would come back)
            assert run.retry().wait(timeout=60) == [1.0, 1.0]
            runs_before = set(os.listdir(os.environ["DDP_NOTEBOOK_RUNS"]))
            with pytest.raises(EngineUnavailableError, match=r"engine 1 is not available any more; the engines now "
                                                             r"are \[0\]"):
                run.retry(devices=["cpu:0", "cpu:1"])
            assert set(os.listdir(os.environ["DDP_NOTEBOOK_RUNS"])) == runs_before  # nothing was created


def test_ddp_fit_magic_runs_on_engines_by_name(rc, ipython_shell):
    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    from ddp_notebook.ui.text import format_run

    shell = ipython_shell
    shell.run_line_magic("load_ext", "ddp_notebook")
    assert shell.run_cell("def where(ctx):\n    return [ctx.rank, ctx.world_size]\nrc_for_magic = None").success
    shell.user_ns["rc_for_magic"] = rc
    with capture_output():
        assert shell.run_line_magic("ddp_fit", "where --engines rc_for_magic --wait") == [0, 2]
    text = format_run(shell.user_ns["_ddp_run"].state)
    assert "rank 0 cpu:0 on engine 0 on " in text and "rank 1 cpu:1 on engine 1 on " in text
    with pytest.raises(UsageError, match="there is no 'no_such_client' in the notebook; define an ipyparallel Client"):
        shell.run_line_magic("ddp_fit", "where --engines no_such_client")
    shell.user_ns["not_a_client"] = 42
    with pytest.raises(UsageError, match="engines= takes an ipyparallel Client .* not int"):
        shell.run_line_magic("ddp_fit", "where --engines not_a_client")


def test_spawn_style_code_runs_on_engines_of_one_host(rc):
    import tutorial_ddp

    # Tutorial-style code destroys its group and then drops its DDP model: torch's teardown
    # deadlocked about one run in seven here before ddp_notebook._teardown deferred it.
    for _ in range(12):
        assert ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2, engines=rc,
                                  join=False).wait(timeout=60)[:2] == (0, 2)
    with pytest.raises(WorkerFailedError) as e:
        ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2, 1), nprocs=2, engines=rc)
    assert str(e.value) == "Distributed data parallel worker 1 (cpu:1 on engine 1) failed: ValueError: bad batch on rank 1"


def test_panel_of_an_engine_run_offers_engine_slots_and_validates_on_the_engines(rc):
    from ddp_notebook.ui.panel import DDPPanel

    run = ddp_notebook.launch(faults.ddp_steps, engines=rc, kwargs=dict(fault="raise", bad_rank=1, at_step=2))
    with pytest.raises(WorkerFailedError):
        run.wait(timeout=60)
    relaunched = []
    panel = DDPPanel(run, launcher=lambda devices: relaunched.append(devices) or run,
                     available=run._device_choices(), selected=[str(d) for d in run.devices],
                     validator=run._validate_devices)
    assert panel.picker.options == ("cpu:0", "cpu:1")  # one slot per engine, no GPU on these engines
    assert "<small>engine 1 on " in panel.views[0].rows[1].detail.value  # under the columns: rows keep one line
    panel.picker.value = ("cpu:0", "cpu:1")
    assert panel.validate() and relaunched == []
    assert "3 devices for 2 engines" in panel.validator(["cpu:0", "cpu:1", "cpu:2"]).summary()
    view = panel.views[0]
    view.retry_single.click()  # the card's one-click retry: on the engine of the healthy rank
    retry = panel.views[1].run
    assert retry.wait(timeout=60) == [1.0, 1.0] and retry.options.engines.ids == (rc.ids[0],)


def engines_on(*hosts, gpus=1, cores=8):
    """Engines as validation sees them (what each engine said of itself), without a cluster."""
    fake = Engines(None, list(range(len(hosts))))
    fake._info = [{"host": h, "cuda_count": gpus, "cpu_count": cores, "nccl": True,
                   "ddp_notebook": ddp_notebook.__version__} for h in hosts]
    # Every engine reaches rank 0 over the network (as the probe would find on a real cluster).
    fake._plans = {n: NetworkPlan("10.0.0.1", ["10.0.0.1"] * n, ["eth0"] * n, True) for n in range(1, len(hosts) + 1)}
    return fake


def test_validation_judges_each_gpu_on_the_host_of_its_engine():
    from ddp_notebook.executors.ipyparallel.engine_checks import validate_on_engines

    two_hosts = validate_on_engines("cuda:0,cuda:0", engines_on("gpu-a", "gpu-b"))
    assert two_hosts.ok and two_hosts.backend == "nccl"
    one_host = validate_on_engines("cuda:0,cuda:0", engines_on("gpu-a", "gpu-a", gpus=2))
    assert [f.message for f in one_host.errors] == [
        "cuda:0 is listed 2 times on host gpu-a (ranks 0, 1); each device may appear once per host."]
    missing = validate_on_engines("cuda:0,cuda:1", engines_on("gpu-a", "gpu-b"))
    assert [f.message for f in missing.errors] == ["cuda:1 does not exist on engine 1 (host gpu-b): it sees 1 CUDA device."]
    assert [f.code for f in validate_on_engines("cpu:0,cpu:0", engines_on("a", "b")).errors] == ["duplicate"]


def test_cpu_oversubscription_is_judged_per_host():
    from ddp_notebook.executors.ipyparallel.engine_checks import validate_on_engines

    spread = validate_on_engines("cpu*4", engines_on("a", "a", "b", "b", cores=2))
    assert spread.ok and not spread.warnings
    crowded = validate_on_engines("cpu*3", engines_on("a", "a", "a", cores=2))
    assert [f.message for f in crowded.warnings] == [
        "3 CPU ranks share the 2 cores of host a: each gets one thread and the run will be slower than with "
        "fewer ranks there."]


def test_an_interface_named_in_env_must_exist_on_every_engine_and_not_be_loopback_across_hosts():
    from ddp_notebook.executors.ipyparallel.engine_checks import validate_on_engines

    engines = engines_on("a", "b")
    for info, address in zip(engines._info, ("10.0.0.1", "10.0.0.2")):
        info.update(machine=info["host"], addresses={"lo": "127.0.0.1", "eth0": address})
    assert validate_on_engines("cpu*2", engines, env={"GLOO_SOCKET_IFNAME": "eth0"}).ok
    typo = validate_on_engines("cpu*2", engines, env={"GLOO_SOCKET_IFNAME": "eht0"})
    assert [f.message for f in typo.errors][0] == (
        "GLOO_SOCKET_IFNAME='eht0' (env=) names an interface engine 0 (host a) does not have; it has: eth0, lo. "
        "Leave it unset: each engine's interface to rank 0 is found before the run.")
    loopback = validate_on_engines("cpu*2", engines, env={"NCCL_SOCKET_IFNAME": "lo"})
    assert [f.message for f in loopback.errors] == [
        "NCCL_SOCKET_IFNAME='lo' (env=) is loopback on engine 0 (host a): ranks on several hosts cannot reach each "
        "other over it. Leave it unset, or name an interface that reaches rank 0's host."]
    one_host = engines_on("a", "a")
    for info in one_host._info:
        info.update(machine="a", addresses={"lo": "127.0.0.1"})
    assert validate_on_engines("cpu*2", one_host, env={"GLOO_SOCKET_IFNAME": "lo"}).ok


def test_validation_tells_gpus_of_engines_pinned_to_one_gpu_each_apart():
    from ddp_notebook.executors.ipyparallel.engine_checks import validate_on_engines

    pinned = engines_on("gpu-a", "gpu-a")
    for i, info in enumerate(pinned._info):
        info["cuda_visible"] = str(i)  # each engine sees its own GPU as cuda:0
    assert validate_on_engines("cuda:0,cuda:0", pinned).ok
    broken = engines_on("a", "b", "b")
    broken._info[0] = {"error": "engine 0 did not answer within 30 s (busy with another task?)"}
    report = validate_on_engines("cpu:0,cpu:1,cpu:1", broken)
    assert [f.message for f in report.errors] == [
        "engine 0 did not answer within 30 s (busy with another task?)",
        "cpu:1 is listed 2 times (ranks 1, 2); each device may appear once per host."]
    unused_without_gpu = engines_on("gpu-a", "gpu-b", "cpu-only")
    unused_without_gpu._info[2]["cuda_count"] = 0
    assert validate_on_engines("cuda:0,cuda:0", unused_without_gpu).ok  # the third engine is not used


def test_a_rank_left_in_a_collective_by_a_peer_that_returned_is_the_straggler(rc):
    run = ddp_notebook.launch(faults.one_more_allreduce_on_rank_1, engines=rc, stall_timeout=2.0)
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    assert str(e.value).startswith("Distributed data parallel worker 1 (cpu:1 on engine 1) failed: stalled")
    assert "dist.all_reduce(t)" in e.value.failure.traceback
    assert run.workers[0].status == "succeeded"  # rank 0 returned and waited: not to blame


def test_engines_busy_with_a_run_are_refused_to_another(rc):
    run = ddp_notebook.launch(faults.wait_for_stop, engines=rc)
    try:
        wait_for(run, lambda s: all((w.step or 0) >= 1 for w in s.workers.values()))
        with pytest.raises(InvalidDevicesError, match=rf"engine 0 is in use by run {run.id} \(running\): stop it "):
            ddp_notebook.launch(faults.takes_arg, engines=rc, args=(1,))
        assert "engine 1 is in use" in run._validate_devices("cpu:0,cpu:1").summary()
    finally:
        run.stop(grace=5, wait=True)
    assert ddp_notebook.launch(faults.takes_arg, engines=rc, args=(1,)).wait(timeout=60) == 1  # free again


# ---- sessions on engines: the same cells, blame and judgement as on local workers ----------------
def test_a_session_on_engines_runs_cells_prints_pushes_and_pulls(rc):
    engine_pids = rc[:].apply_sync(__import__("os").getpid)
    s = ddp_notebook.session(engines=rc)
    try:
        assert s.devices == ["cpu:0", "cpu:1"] and "engine 0" in (s.current_run.state.workers[0].place or "")
        assert s.run("import os; x = rank * 10\nos.getpid()") == engine_pids  # one rank per engine, kept
        assert s.run("print('hello from', rank); x + 1") == [1, 11]  # the namespace stays
        assert s.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t); t.item()") == [3.0, 3.0]
        s.push(lr=0.5, w=torch.ones(100_000))  # by value: an engine may be on another host
        assert s.run("lr * float(w.sum())", ranks=1) == [50_000.0]
        assert s.pull("x") == [0, 10]
        s.run("print('second', rank)")
        out = s.current_run.output(1)  # what the rank printed, kept once, in order, with the answers
        assert out.count("hello from 1\n") == 1 and out.index("hello from 1") < out.index("second 1"), out
        # A value over a store value's 8 MiB travels in parts.
        s.push(big=torch.ones(3 * 1024 * 1024))
        assert s.run("float(big.sum())") == [3.0 * 1024 * 1024] * 2
    finally:
        s.close()
    assert s.current_run.state.status.value == "succeeded"
    assert_engines_clean(rc)


PRINTS_FLAT_OUT = """
import sys, threading
def flood():
    i = 0
    while not getattr(sys, "_ddp_test_stop", False):
        print("flood", i)
        i += 1
threading.Thread(target=flood, daemon=True).start()
"""


def test_closing_a_session_whose_cell_left_a_thread_printing_flat_out_leaves_the_engines_alive(rc):
    """The session puts the engine's streams back as it ends while the thread prints: a print
    holding the session's stream must not write through a freed object (both engines crashed
    with SIGSEGV in 11 of 12 closes)."""
    engine_pids = rc[:].apply_sync(__import__("os").getpid)
    try:
        for _ in range(2):
            s = ddp_notebook.session(engines=rc)
            s.run(PRINTS_FLAT_OUT)
            time.sleep(0.5)
            s.close()
            assert s.current_run.state.status.value == "succeeded"
        time.sleep(1)
        assert rc[:].apply_sync(__import__("os").getpid) == engine_pids
    finally:
        rc[:].execute("import sys; sys._ddp_test_stop = True", block=True)
    assert_engines_clean(rc)


def test_a_cell_failing_on_one_engine_is_blamed_and_the_peer_left_waiting_is_named(rc):
    s = ddp_notebook.session(engines=rc)
    try:
        first = s.current_run
        with pytest.raises(ddp_notebook.errors.CellError) as e:
            s.run("if rank == 1:\n    raise ValueError('bad on one')\ndist.all_reduce(torch.ones(1))")
        message = str(e.value)
        assert message.startswith("cell 1 failed on rank 1 (cpu:1): ValueError: bad on one. Rank 0 was left in it: "
                                  "waits in all_reduce"), message
        assert "formed again" in message and s.current_run is not first and s.current_run.parent is first
        assert first.state.status.value == "stopped"
        assert s.run("rank") == [0, 1]  # the new ranks serve
        # A cell failing on every rank is said once, and the session goes on.
        with pytest.raises(ddp_notebook.errors.CellError, match="failed on every rank .* the same way: ZeroDivision"):
            s.run("1 / 0")
        assert s.alive and s.run("rank + 1") == [1, 2]
    finally:
        s.close()
    assert_engines_clean(rc)


def test_a_cell_on_engines_is_interrupted_and_the_session_goes_on(rc):
    s = ddp_notebook.session(engines=rc)
    try:
        s.run("import time")
        future = s.run("time.sleep(60)", block=False)
        wait_until(lambda: s.state.request is not None and s.state.request.background, timeout=30)
        assert s.interrupt()
        with pytest.raises(ddp_notebook.errors.SessionInterrupted):
            future.result(timeout=30)
        assert s.run("rank") == [0, 1]
    finally:
        s.close()
    assert_engines_clean(rc)


@pytest.fixture
def shell_with_engines(rc, ipython_shell):
    """The IPython shell with the extension loaded and the cluster's client as ``engines_here``."""
    ipython_shell.run_line_magic("load_ext", "ddp_notebook")
    ipython_shell.user_ns["engines_here"] = rc
    yield ipython_shell
    ipython_shell.user_ns.pop("engines_here", None)


def test_a_view_without_engines_is_said_alone_and_a_magic_takes_a_view_of_a_client(rc, shell_with_engines):
    from IPython.core.error import UsageError

    with pytest.raises(InvalidDevicesError) as e:
        ddp_notebook.session(engines=rc[5:7])
    assert str(e.value) == ("invalid device list 'cpu': The view has no engines: start some (ipcluster start -n 2, or "
                            "ipyparallel.Cluster(n=2).start_and_connect_sync()), or choose a view of engines that "
                            "exist (rc.ids lists them).")
    shell = shell_with_engines
    shell.run_line_magic("ddp_session", "--engines engines_here[1:]")
    s = shell.user_ns["_ddp_session"]
    assert s.devices == ["cpu:0"] and "engine 1" in (s.current_run.state.workers[0].place or "")
    shell.run_line_magic("ddp_session", "--stop")
    for bad in ("engines_here[a]", "engines_here[1.5]", "engines_here(1)", "nowhere[0]"):
        with pytest.raises(UsageError, match="there is no"):
            shell.run_line_magic("ddp_session", f"--engines {bad}")
    assert_engines_clean(rc)


def test_ddp_session_magic_forms_a_session_on_engines_by_name(rc, shell_with_engines):
    from IPython.core.error import UsageError
    from IPython.utils.capture import capture_output

    shell = shell_with_engines
    try:
        shell.run_line_magic("ddp_session", "--engines engines_here")
        s = shell.user_ns["_ddp_session"]
        assert "engine 1" in (s.current_run.state.workers[1].place or "")
        with pytest.raises(UsageError, match="there is no 'nowhere' in the notebook"):
            shell.run_line_magic("ddp_session", "--engines nowhere")
        with pytest.raises(UsageError, match="a new one on engines would lose its namespaces"):
            shell.run_line_magic("ddp_session", "--engines engines_here[0:2]")  # a view, read as written
        assert shell.run_cell_magic("ddp", "", "rank * 2") is None
        assert s.run("rank * 3") == [0, 3]
        # What a rank displays comes to the cell, labelled by rank, not to the engine's own output.
        with capture_output() as shown:
            shell.run_cell_magic("ddp", "", "from IPython.display import HTML\ndisplay(HTML(f'<b>rank {rank}</b>'))")
        html = [o.data.get("text/html") for o in shown.outputs]
        assert "<b>rank 0</b>" in html and "<b>rank 1</b>" in html, (html, shown.stdout)
        assert "[rank 1]" in shown.stdout
    finally:
        shell.run_line_magic("ddp_session", "--stop")
    assert_engines_clean(rc)


CHILD_SESSION = """
import os, sys, time, ipyparallel as ipp, ddp_notebook
rc = ipp.Client(profile=sys.argv[1], cluster_id=sys.argv[2])
s = ddp_notebook.session(engines=rc)
marker = sys.argv[3]
s.run(f"import time\\nopen({marker!r} + str(rank), 'w').close()\\nwhile True:\\n    time.sleep(0.5)", block=False)
while not all(os.path.exists(marker + str(r)) for r in (0, 1)):  # both ranks in the cell
    time.sleep(0.05)
print("running", flush=True)
time.sleep(600)
"""


def test_a_notebook_killed_mid_cell_frees_its_engines_and_an_engine_death_leaves_a_session_to_form_again(tmp_path):
    # Its own cluster: an engine is killed at the end.
    import select
    import signal
    import subprocess
    import sys
    import time

    cluster = ipp.Cluster(n=2, log_level=40, controller_args=CONTROLLER_ARGS)
    rc = cluster.start_and_connect_sync()
    try:
        rc[:].execute(f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})", block=True)
        # The notebook dies (the out-of-memory killer) while its session's cell loops on the engines:
        # the ranks see the notebook's request store go, and leave the cell.
        child = subprocess.Popen([sys.executable, "-c", CHILD_SESSION, cluster.profile, cluster.cluster_id,
                                  str(tmp_path / "in-cell-")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
        said = []
        try:
            deadline = time.monotonic() + 120
            while "running\n" not in said and time.monotonic() < deadline and child.poll() is None:
                if select.select([child.stdout], [], [], 1.0)[0]:
                    said.append(child.stdout.readline())
            assert "running\n" in said, "".join(said)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        started = time.monotonic()
        assert rc[:].apply_async(os.getpid).get(timeout=60)  # the engines answer again
        assert time.monotonic() - started < 30
        assert_engines_clean(rc)
        # An engine dies: the session ends naming it; restart() cannot form it on a gone engine and
        # leaves the session as it was; restart(without_failed=True) forms it on the other one.
        s = ddp_notebook.session(engines=rc)
        pids = s.run("import os; os.getpid()")
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(ddp_notebook.errors.SessionEndedError, match="engine 1 died.* "
                           r"session.restart\(without_failed=True\) forms it again on the other engines"):
            s.run("import time; time.sleep(30)")
        ended = s.current_run
        with pytest.raises(EngineUnavailableError, match="engine 1 is not available any more"):
            s.restart()
        assert s.current_run is ended and s.devices == ["cpu:0", "cpu:1"]
        s.restart(without_failed=True)
        assert s.devices == ["cpu:0"] and s.run("import os; os.getpid()") == [pids[0]]
        s.close()
    finally:
        rc.close()
        cluster.stop_cluster_sync()
