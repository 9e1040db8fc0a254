"""Runs on ipyparallel engines spread over several hosts, simulated with Linux network namespaces
(``hosts.SimulatedHosts``): each host has its own address, hostname and runs folder (a private
tmpfs over the notebook's runs folder: nothing is shared on disk), the controller and this
notebook are on the bridge. Real gloo between the hosts, real faults: a raise, an engine killed,
a link cut mid-run.

Three hosts: h1 with two engines, h2 and h3 with one each. The tests that break a link or an
engine come last: the cut link is mended, the killed engine (the very last test) stays dead."""
import os
import signal

import pytest
import torch

import ddp_notebook
from ddp_notebook import InvalidDevicesError, WorkerFailedError

import faults
import models
import tutorial_ddp
from helpers import wait_for
from hosts import assert_engines_clean, check_a_host_cut_off_mid_run, listening, simulated

pytestmark = pytest.mark.multihost


@pytest.fixture(scope="module")
def hosts():
    yield from simulated([2, 1, 1])


def where(ctx):
    import socket

    return [socket.gethostname(), ctx.local_rank, ctx.local_world_size, os.environ["LOCAL_RANK"],
            os.environ.get("GLOO_SOCKET_IFNAME")]


def everyone(ctx):
    out = [None] * ctx.world_size
    torch.distributed.all_gather_object(out, where(ctx))
    return out


def test_the_hosts_share_no_runs_folder(hosts):
    runs = os.environ["DDP_NOTEBOOK_RUNS"]
    open(os.path.join(runs, "only-here"), "w").close()
    try:
        assert hosts.client[:].apply_sync(os.listdir, runs) == [[]] * 4
    finally:
        os.unlink(os.path.join(runs, "only-here"))


def test_local_rank_and_interface_are_per_host(hosts):
    view = hosts.client[hosts.on_host[0] + hosts.on_host[1]]  # two ranks on h1, one on h2
    found = ddp_notebook.launch(everyone, engines=view).wait(timeout=120)
    assert [f[:4] for f in found] == [["h1", 0, 2, "0"], ["h1", 1, 2, "1"], ["h2", 0, 1, "0"]]
    assert all(f[4] and f[4].startswith("e") for f in found), found  # each host's bridge link, not lo
    assert_engines_clean(hosts)


def _fit(**where):
    torch.manual_seed(0)
    x = torch.randn(384, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def model():
        torch.manual_seed(1)
        return torch.nn.Linear(4, 1)

    return ddp_notebook.fit(model, (x, y), loss=torch.nn.functional.mse_loss,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.05), epochs=2, batch_size=16, shuffle=False,
                            checkpoint=False, **where)


def test_what_listens_is_bound_to_the_host_s_address_and_only_while_the_run_runs(hosts):
    view = hosts.view([0, 1])
    pids = view.apply_sync(os.getpid)
    before = listening(pids)
    run = ddp_notebook.launch(faults.wait_for_stop, engines=view)
    try:
        wait_for(run, lambda s: all((w.step or 0) >= 1 for w in s.workers.values()), timeout=120)
        during = listening(pids)
    finally:
        run.stop(wait=True)
    assert run.status == "stopped"
    for pid, address in zip(pids, hosts.addresses):
        opened = during[pid] - before[pid]
        assert opened and {ip for ip, _port in opened} == {address}, opened  # never 0.0.0.0, never ::
    assert listening(pids) == before  # the store and gloo are gone with the run
    assert_engines_clean(hosts)


@pytest.mark.parametrize("n", [2, 3])
def test_the_same_fit_on_several_hosts_as_on_local_workers(hosts, n):
    on_hosts = _fit(engines=hosts.view(range(n)))
    local = _fit(devices=f"cpu*{n}")
    assert on_hosts.ranks_in_sync
    for a, b in zip(on_hosts.model.parameters(), local.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert_engines_clean(hosts)


def test_tutorial_spawn_code_meets_across_hosts(hosts):
    # Its env:// rendezvous meets in rank 0's store on h1 (MASTER_ADDR there), under the run's secret.
    result = ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2, engines=hosts.view([0, 1]), join=False)
    assert result.wait(timeout=120)[:2] == (0, 2)
    assert_engines_clean(hosts)


def test_a_rank_raising_on_host_2_is_named(hosts):
    view = hosts.view([0, 1, 2])
    run = ddp_notebook.launch(faults.ddp_steps, engines=view, kwargs=dict(fault="raise", bad_rank=1))
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=120)
    assert str(e.value).startswith(f"Distributed data parallel worker 1 (cpu:1 on engine {hosts.on_host[1][0]}) "
                                   "failed: ValueError: boom at step 3")
    assert all(f.consequence for f in run.failures if f is not e.value.failure)
    assert_engines_clean(hosts)


def test_a_session_across_hosts_runs_cells_and_names_the_rank_that_raised(hosts):
    # The ranks take the notebook's requests from a store it hosts on its bridge address.
    s = ddp_notebook.session(engines=hosts.view([0, 1, 2]))
    try:
        names = s.run("import socket\nout = [None] * world_size\ndist.all_gather_object(out, socket.gethostname())\nout")
        assert names[0] == names[2] and len(set(names[0])) == 3  # every rank sees the three hosts
        s.push(w=torch.ones(50_000))  # by value: no memory is shared across hosts
        assert s.run("float(w.sum()) * rank") == [0.0, 50_000.0, 100_000.0]
        with pytest.raises(ddp_notebook.errors.CellError) as e:
            s.run("if rank == 2:\n    raise KeyError('only on h3')\ndist.barrier()")
        assert str(e.value).startswith("cell 3 failed on rank 2 (cpu:2): KeyError: 'only on h3'. Ranks 0, 1 were "
                                       "left in it"), str(e.value)
        assert s.run("rank") == [0, 1, 2]  # formed again, on the same engines
    finally:
        s.close()
    assert_engines_clean(hosts)


def test_checkpoints_reach_the_notebook_and_a_retry_on_host_1_resumes_from_them(hosts):
    x, y = models.regression_data()
    kw = dict(train_data=(x[:384], y[:384]), valid_data=(x[384:], y[384:]), loss=torch.nn.MSELoss(),
              optimizer=models.sgd(0.0), metrics={"same": models.constant(1.0)}, monitor="same", epochs=10,
              batch_size=32, early_stopping=2)
    # 6 batches an epoch per rank; rank 1 (on h2) fails in epoch 2, after checkpoints of epochs 0 and 1,
    # which rank 0 saved on h1, where the notebook's runs folder is an empty tmpfs.
    run = ddp_notebook.fit(model=models.FailsOnRank1(fail_after=14), engines=hosts.view([0, 1]), wait=False, **kw)
    with pytest.raises(WorkerFailedError, match="bad batch 15 on rank 1"):
        run.wait(timeout=120)
    # ("best" names epoch 0: the metric watched never improves after it)
    assert sorted(os.listdir(run.checkpoint_dir)) == ["best", "epoch-0000.pt", "epoch-0001.pt", "latest"]
    assert open(os.path.join(run.checkpoint_dir, "best")).read() == "epoch-0000.pt"
    # (with a deadline: an engine still busy with the failed run's rank would be a defect, not a hang)
    assert hosts.client[hosts.on_host[0][0]].apply_async(os.path.exists, run.checkpoint_dir).get(timeout=60) is False
    resumed = run.retry(resume=True, devices="cpu:0").wait(timeout=120)
    assert resumed.resumed_from_epoch == 1 and [h["epoch"] for h in resumed.history] == [0, 1, 2]
    assert_engines_clean(hosts)


def test_an_engine_that_cannot_reach_rank_0_is_refused_before_the_run(hosts):
    # h3 still reaches the controller (the notebook's side) but no longer h1, where rank 0 runs.
    ns, h1 = hosts.namespaces[2], hosts.addresses[0]
    os.system(f"ip netns exec {ns} ip route add blackhole {h1}/32")
    try:
        view = hosts.view([0, 2])
        runs_before = set(os.listdir(os.environ["DDP_NOTEBOOK_RUNS"]))
        with pytest.raises(InvalidDevicesError, match=rf"engine {hosts.on_host[2][0]} \(host h3\) cannot reach "
                                                      rf"rank 0's engine {hosts.on_host[0][0]} \(host h1\) over TCP "
                                                      rf"\({h1}: "):
            ddp_notebook.launch(faults.ddp_steps, engines=view)
        # Loopback named by hand: gloo would wait out its 30 minutes in C++ on rank 0's engine.
        with pytest.raises(InvalidDevicesError, match=r"GLOO_SOCKET_IFNAME='lo' \(env=\) is loopback on engine"):
            ddp_notebook.launch(faults.ddp_steps, engines=hosts.view([0, 1]), env={"GLOO_SOCKET_IFNAME": "lo"})
        assert set(os.listdir(os.environ["DDP_NOTEBOOK_RUNS"])) == runs_before  # nothing was created
    finally:
        os.system(f"ip netns exec {ns} ip route del blackhole {h1}/32")


def test_a_rank_that_holds_the_gil_past_the_network_timeout_is_not_taken_as_cut_off(hosts, monkeypatch):
    # Its pulse thread cannot beat meanwhile, but its host's kernel still answers for it.
    monkeypatch.setenv("DDP_NOTEBOOK_NETWORK_TIMEOUT", "3")
    run = ddp_notebook.launch(faults.holds_the_gil_on_rank_1, engines=hosts.view([0, 1]), kwargs={"seconds": 8})
    assert run.wait(timeout=120) == 4.0
    assert_engines_clean(hosts)


def test_a_host_cut_off_mid_run_is_named_within_the_bound_and_the_retry_runs_on_the_rest(hosts, monkeypatch):
    monkeypatch.setenv("DDP_NOTEBOOK_NETWORK_TIMEOUT", "5")  # not 10 s: the bound follows it
    check_a_host_cut_off_mid_run(hosts)


def test_an_engine_killed_on_host_2_is_the_cause_and_the_retry_runs_on_host_1(hosts):
    # The last test: h2's engine stays dead.
    run = ddp_notebook.launch(faults.allreduce_until_stop_agreed, engines=hosts.view([0, 1]))
    wait_for(run, lambda s: all((w.step or 0) >= 2 for w in s.workers.values()), timeout=120)
    os.kill(run.workers[1].pid, signal.SIGKILL)  # the engine process on h2
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=120)
    assert e.value.failure.rank == 1 and e.value.failure.kind == "engine", e.value.failure
    assert all(f.consequence for f in run.failures if f is not e.value.failure)
    again = run.retry(devices="cpu:0")
    assert again.options.engines.ids == (hosts.on_host[0][0],)
    wait_for(again, lambda s: (s.workers[0].step or 0) >= 2, timeout=120)
    again.stop(wait=True)
    assert again.status == "stopped"
