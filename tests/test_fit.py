"""The built-in fit with real 2-rank CPU runs."""
import functools
import os
import threading

import pytest
import torch

import ddp_notebook
from ddp_notebook import FitResult, WorkerFailedError
from ddp_notebook.errors import NotPicklableError, PreflightError

import models
from helpers import started_processes

pytestmark = pytest.mark.processes


def test_two_rank_fit_converges_with_identical_weights_on_every_rank():
    x, y = models.regression_data()
    model = models.linear()
    before = model.weight.detach().clone()
    result = ddp_notebook.fit(model=model, train_data=(x, y), loss=torch.nn.MSELoss(), optimizer=models.sgd(0.1),
                              epochs=5, batch_size=32, devices="cpu:0,cpu:1")
    first, last = result.history[0]["train_loss"], result.history[-1]["train_loss"]
    assert last < first / 20, (first, last)  # stated factor: the loss drops more than 20x
    assert result.ranks_in_sync
    assert result.model is model and not torch.equal(model.weight, before)  # trained in place
    assert [h["epoch"] for h in result.history] == [0, 1, 2, 3, 4]
    ranks = result.run.workers
    assert all(w.step == w.total == 5 * 8 for w in ranks)  # 512 / 2 ranks / 32 = 8 steps an epoch
    assert all("train_loss" in w.metrics and w.metrics["samples_per_s"] > 0 for w in ranks)


def test_one_device_and_two_devices_agree_with_the_same_global_batch():
    # Same seed and global batch (1 x 64 vs 2 x 32): DistributedSampler gives the two ranks the
    # even and odd positions of one shuffled order, so each step averages the same 64 samples.
    # Only the order of floating-point additions differs, so the weights agree to ~1e-6;
    # we allow 1e-4.
    x, y = models.regression_data()
    kw = dict(train_data=(x, y), loss=torch.nn.MSELoss(), optimizer=models.sgd(0.05), epochs=3, seed=7)
    one = ddp_notebook.fit(model=models.linear, batch_size=64, devices="cpu:0", **kw)
    two = ddp_notebook.fit(model=models.linear, batch_size=32, devices="cpu*2", **kw)
    for a, b in zip(one.model.parameters(), two.model.parameters()):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    assert abs(one.history[-1]["train_loss"] - two.history[-1]["train_loss"]) < 1e-4


def test_gradient_accumulation_matches_the_larger_batch():
    x, y = models.regression_data()
    kw = dict(model=models.linear, train_data=(x, y), loss=torch.nn.MSELoss(), optimizer=models.sgd(0.05),
              epochs=2, devices="cpu:0", shuffle=False)
    big = ddp_notebook.fit(batch_size=64, **kw)
    accumulated = ddp_notebook.fit(batch_size=32, grad_accum=2, **kw)
    for a, b in zip(big.model.parameters(), accumulated.model.parameters()):
        assert torch.allclose(a, b, atol=1e-5)


def test_validation_metrics_and_early_stopping():
    x, y = models.regression_data()
    result = ddp_notebook.fit(model=models.linear, train_data=(x[:384], y[:384]), valid_data=(x[384:], y[384:]),
                              loss=torch.nn.MSELoss(), optimizer=models.sgd(0.0), metrics={"close": models.within(0.5)},
                              epochs=10, batch_size=32, devices="cpu*2", early_stopping=2)
    assert result.stopped_early and len(result.history) == 3  # lr 0: never improves after the first epoch
    assert {"valid_loss", "close", "train_loss"} <= set(result.history[0])
    assert 0.0 <= result.history[0]["close"] <= 1.0


def test_an_epoch_takes_the_same_seconds_in_the_result_and_in_the_panel_and_run_history():
    x, y = models.regression_data()
    run = ddp_notebook.fit(model=models.linear, train_data=(x[:384], y[:384]), valid_data=(x[384:], y[384:]),
                           loss=torch.nn.MSELoss(), optimizer=models.sgd(0.1), epochs=3, batch_size=32,
                           devices="cpu*2", wait=False)
    result = run.wait(timeout=120)
    shown = [(h["epoch"], h["seconds"]) for h in run.history]  # what the panel's epoch table shows
    assert [(h["epoch"], h["seconds"]) for h in result.history] == shown and len(shown) == 3


def test_a_resumed_fit_stops_early_where_the_original_would_have():
    x, y = models.regression_data()
    kw = dict(train_data=(x[:384], y[:384]), valid_data=(x[384:], y[384:]), loss=torch.nn.MSELoss(),
              optimizer=models.sgd(0.0), metrics={"same": models.constant(1.0)}, monitor="same", epochs=10,
              batch_size=32, early_stopping=2)
    # 6 batches an epoch per rank; rank 1 fails in epoch 2, after checkpoints of epochs 0 and 1.
    # Uninterrupted, the fit stops after epoch 2 (no gain in epochs 1 and 2).
    run = ddp_notebook.fit(model=models.FailsOnRank1(fail_after=14), devices="cpu*2", wait=False, **kw)
    with pytest.raises(WorkerFailedError):
        run.wait(timeout=120)
    resumed = run.retry(resume=True).wait(timeout=120)
    assert resumed.resumed_from_epoch == 1 and resumed.stopped_early
    assert [h["epoch"] for h in resumed.history] == [0, 1, 2]
    # Resuming a fit that had stopped early trains nothing more.
    again = ddp_notebook.fit(model=models.FailsOnRank1(), devices="cpu:0", resume_from=resumed, **kw)
    assert again.resumed_from_epoch == 2 and again.stopped_early and again.history == resumed.history
    assert not any(e["kind"] == "progress" and "loss" in e for e in again.run.events)


def test_a_resumed_fit_with_dropout_ends_bit_equal_to_an_uninterrupted_one(tmp_path):
    x, y = models.regression_data()
    kw = dict(train_data=(x, y), loss=torch.nn.MSELoss(), optimizer=models.sgd(0.05), epochs=3, batch_size=32,
              devices="cpu*2", seed=3)
    straight = ddp_notebook.fit(model=models.DropoutNet, **kw)  # built in the workers, after the seed
    fail = tmp_path / "fail"
    fail.touch()
    # 8 batches an epoch per rank: rank 1 fails in epoch 1, after the checkpoint of epoch 0
    run = ddp_notebook.fit(model=functools.partial(models.DropoutNet, str(fail), after=12), wait=False, **kw)
    with pytest.raises(WorkerFailedError):
        run.wait(timeout=120)
    fail.unlink()
    resumed = run.retry(resume=True, devices=run.devices).wait(timeout=120)
    assert resumed.resumed_from_epoch == 0
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_a_nan_loss_fails_the_fit_at_its_step_naming_the_rank():
    x, y = models.regression_data()
    x[2 * (32 * 3 + 5) + 1, 0] = float("nan")  # unshuffled, rank 1 takes the odd samples: its 4th batch
    with pytest.raises(WorkerFailedError) as e:
        ddp_notebook.fit(model=models.linear, train_data=(x, y), loss=torch.nn.MSELoss(), epochs=2, batch_size=32,
                         shuffle=False, devices="cpu*2")
    assert str(e.value).startswith("Distributed data parallel worker 1 (cpu:1) failed: NonFiniteLossError: the loss "
                                   "is nan or inf at step 4 (epoch 1, batch 4 of 8)"), str(e.value)
    assert _checkpoints(e.value.run_dir) == []  # it failed in epoch 0: nothing of the nan was saved


def test_a_nan_every_rank_computes_is_one_error_of_the_run_and_caught_by_the_preflight():
    x, y = models.regression_data()
    nan_model = models.linear()
    torch.nn.init.constant_(nan_model.weight, float("nan"))
    kw = dict(model=nan_model, train_data=(x, y), loss=torch.nn.MSELoss(), batch_size=32, devices="cpu*2")
    with pytest.raises(WorkerFailedError) as e:
        ddp_notebook.fit(preflight=False, **kw)
    assert str(e.value).startswith("Every distributed data parallel worker (cpu:0, cpu:1) failed the same way: "
                                   "NonFiniteLossError: the loss is nan or inf at step 1 (epoch 1, batch 1 of 8)"), str(e.value)
    with pytest.raises(PreflightError, match="NonFiniteLossError: the loss of the first batch is nan, before any step"):
        ddp_notebook.fit(**kw)


def test_weights_that_overflow_on_a_finite_loss_and_a_nan_validation_loss_are_caught_before_any_checkpoint():
    x, y = models.regression_data(n=64)
    kw = dict(model=models.linear, train_data=(x, y), loss=torch.nn.MSELoss(), batch_size=32, devices="cpu*2")
    # one step an epoch: lr 3e38 turns the weights to inf while the first loss is finite
    with pytest.raises(WorkerFailedError) as e:
        ddp_notebook.fit(optimizer=models.sgd(3e38), epochs=2, **kw)
    assert "failed the same way: NonFiniteLossError: the weights hold nan or inf after epoch 1 (step 1)" in str(e.value)
    assert _checkpoints(e.value.run_dir) == []
    vx, vy = models.regression_data(n=32, seed=1)
    vy[5] = float("nan")
    with pytest.raises(WorkerFailedError, match="the validation loss is nan or inf after epoch 1"):
        ddp_notebook.fit(valid_data=(vx, vy), preflight=False, **kw)
    with pytest.raises(PreflightError, match="the validation loss of the first batch is nan"):
        ddp_notebook.fit(valid_data=(vx, vy), **kw)


def _checkpoints(run_dir):
    import os

    folder = os.path.join(run_dir, "checkpoints")
    return os.listdir(folder) if os.path.isdir(folder) else []


def test_empty_shard_is_refused_before_any_worker_starts(tmp_path):
    x, y = models.regression_data(n=100)
    before = started_processes()
    with pytest.raises(ddp_notebook.FitConfigError) as e:
        ddp_notebook.fit(model=models.linear, train_data=(x, y), loss=torch.nn.MSELoss(), batch_size=64,
                         drop_last=True, devices="cpu*2", run_root=str(tmp_path))
    assert str(e.value) == (  # a data problem, said once, not an invalid device list
        "Each of the 2 workers would get 0 batches of training data: 100 samples over 2 workers is 50 per "
        "worker, fewer than batch_size 64 with drop_last=True. Use batch_size <= 50, or drop_last=False, "
        "or fewer devices.")
    with pytest.raises(ddp_notebook.FitConfigError, match=r"^The training data is empty: give at least one sample\.$"):
        ddp_notebook.fit(model=models.linear, train_data=(x[:0], y[:0]), loss=torch.nn.MSELoss(), devices="cpu*2",
                         run_root=str(tmp_path))
    assert started_processes() == before and list(tmp_path.iterdir()) == []


def test_unpicklable_model_is_named_before_any_worker_starts(tmp_path):
    lock = threading.Lock()

    def make():
        model = models.linear()
        model.lock = lock
        return model

    with pytest.raises(NotPicklableError, match=r"^'lock', used by the function 'make', is a _thread.lock"):
        ddp_notebook.fit(model=make, train_data=models.regression_data(), loss=torch.nn.MSELoss(),
                         devices="cpu*2", run_root=str(tmp_path))
    model = models.linear()
    model.lock = lock
    with pytest.raises(NotPicklableError, match=r"^fit\(model=...\) is a torch.nn.modules.linear.Linear"):
        ddp_notebook.fit(model=model, train_data=models.regression_data(), loss=torch.nn.MSELoss(),
                         devices="cpu*2", run_root=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_preflight_failure_shows_the_plain_error_before_any_worker_starts(tmp_path):
    x, y = models.regression_data(d=8)
    with pytest.raises(PreflightError) as e:
        ddp_notebook.fit(model=lambda: torch.nn.Linear(6, 1), train_data=(x, y), loss=torch.nn.MSELoss(),
                         devices="cpu*2", run_root=str(tmp_path))
    assert str(e.value).startswith("The single-device preflight step on cpu:0 failed, so no DDP worker was started: "
                                   "RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert isinstance(e.value.__cause__, RuntimeError)
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_get_clear_errors():
    data = models.regression_data()
    with pytest.raises(ddp_notebook.FitConfigError, match="epochs must be a whole number >= 1, not 0"):
        ddp_notebook.fit(model=models.linear, train_data=data, loss=torch.nn.MSELoss(), epochs=0)
    with pytest.raises(ddp_notebook.FitConfigError, match="train_data must be a Dataset"):
        ddp_notebook.fit(model=models.linear, train_data=42, loss=torch.nn.MSELoss())
    with pytest.raises(ddp_notebook.FitConfigError, match="train_data must be a Dataset .*, not str 'data.csv'"):
        ddp_notebook.fit(model=models.linear, train_data="data.csv", loss=torch.nn.MSELoss())
    with pytest.raises(ddp_notebook.FitConfigError, match="monitor 'acc' is not recorded; choose one of train_loss"):
        ddp_notebook.fit(model=models.linear, train_data=data, loss=torch.nn.MSELoss(), monitor="acc")
    # A metric the record holds already would never be logged as itself (monitored, it reached no trial).
    with pytest.raises(ddp_notebook.FitConfigError, match=r"^metrics has the name 'seconds', which the record of an "
                                                          r"epoch holds already \(epoch, samples_per_s, seconds, "):
        ddp_notebook.fit(model=models.linear, train_data=data, loss=torch.nn.MSELoss(),
                         metrics={"seconds": lambda out, target: 0.0}, monitor="seconds")
    with pytest.raises(TypeError, match=r"fit\(\) got unexpected keyword argument\(s\) 'epoch'"):
        ddp_notebook.fit(model=models.linear, train_data=data, loss=torch.nn.MSELoss(), epoch=3)


def test_failed_fit_resumes_from_its_last_checkpoint_on_retry():
    x, y = models.regression_data()
    # 8 batches an epoch on each rank: rank 1 fails in epoch 2, after checkpoints of epochs 0 and 1
    run = ddp_notebook.fit(model=models.FailsOnRank1(fail_after=20), train_data=(x, y), loss=torch.nn.MSELoss(),
                           optimizer=models.sgd(0.05), epochs=4, batch_size=32, devices="cpu*2", wait=False)
    with pytest.raises(WorkerFailedError, match=r"worker 1 \(cpu:1\) failed: ValueError: bad batch 21 on rank 1"):
        run.wait(timeout=120)
    assert [e["epoch"] for e in run.events if e["kind"] == "checkpoint"] == [0, 1]
    again = run.retry(resume=True)
    assert [str(d) for d in again.devices] == ["cpu:0"]
    result = again.wait(timeout=120)
    assert isinstance(result, FitResult) and result.resumed_from_epoch == 1
    assert [h["epoch"] for h in result.history] == [0, 1, 2, 3]
    first_epoch = next(e["epoch"] for e in again.events if e["kind"] == "progress" and "epoch" in e)
    assert first_epoch == 2
    plain = ddp_notebook.launch(lambda ctx: None, devices="cpu:0")
    plain.wait(timeout=60)
    with pytest.raises(ddp_notebook.errors.NoCheckpointError, match="saved no checkpoint to resume from"):
        plain.retry(resume=True)


def test_a_long_fit_keeps_its_last_checkpoints_and_the_best_and_resumes_from_the_latest():
    x, y = models.regression_data()
    # lr 0: the validation loss never improves, so the best is the first epoch's (kept beside the last two)
    kw = dict(model=models.linear, train_data=(x[:256], y[:256]), valid_data=(x[256:], y[256:]),
              loss=torch.nn.MSELoss(), optimizer=models.sgd(0.0), batch_size=64, devices="cpu:0", preflight=False)
    result = ddp_notebook.fit(epochs=30, **kw)
    names = sorted(os.listdir(result.checkpoint_dir))
    assert [n for n in names if n.endswith(".pt")] == ["epoch-0000.pt", "epoch-0028.pt", "epoch-0029.pt"], names
    again = ddp_notebook.fit(epochs=31, resume_from=result, keep_checkpoints=1, **kw)
    assert again.resumed_from_epoch == 29 and len(again.history) == 31
    # epoch 30 is the only one of this run; none of its epochs beat the first run's best
    assert sorted(n for n in os.listdir(again.checkpoint_dir) if n.endswith(".pt")) == ["epoch-0030.pt"]
    with pytest.raises(ddp_notebook.FitConfigError, match=r"keep_checkpoints \(the last checkpoints kept; None: "
                                                          r"every one\) must be a whole number >= 1 or None, not 0"):
        ddp_notebook.fit(epochs=1, keep_checkpoints=0, **kw)
