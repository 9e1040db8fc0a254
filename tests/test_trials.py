"""trial= with real runs and a real Optuna study: the monitored value reported at each epoch, a
weak trial pruned (its run stopped, its checkpoint kept), trials of study.optimize(n_jobs=2) taking
the devices one after the other."""
import contextlib
import os
import threading
import time

import pytest
import torch

import ddp_notebook

import models

pytestmark = pytest.mark.trackers

optuna = pytest.importorskip("optuna")
optuna.logging.set_verbosity(optuna.logging.WARNING)

def prunes_at_the_second_epoch():
    """Prunes any trial whose value is above 0 from its second report on (epoch 1)."""
    return optuna.pruners.ThresholdPruner(upper=0.0, n_warmup_steps=1)


def valid_loss_loop(ctx, epochs, value, seconds=0.02):
    """A loop of the user's: one valid_loss an epoch, an epoch taking 20 ms."""
    for _epoch in ctx.epochs(epochs):
        time.sleep(seconds)
        ctx.log(valid_loss=value)
    return value


def test_a_weak_fit_is_pruned_at_its_second_epoch(tmp_path):
    x, y = models.regression_data(n=256)
    runs = []

    def objective(trial):
        lr = trial.suggest_categorical("lr", [0.0])  # lr 0: the loss never falls
        try:
            ddp_notebook.fit(model=models.linear, train_data=(x[:192], y[:192]), valid_data=(x[192:], y[192:]),
                             loss=torch.nn.MSELoss(), optimizer=models.sgd(lr), epochs=2000, batch_size=32,
                             devices="cpu*2", run_root=str(tmp_path), trial=trial)
        finally:
            runs.append(ddp_notebook.last_run())
        return 0.0

    study = optuna.create_study(study_name="weak", pruner=prunes_at_the_second_epoch())
    study.optimize(objective, n_trials=4)  # (an epoch here takes milliseconds: each trial is a try of the race)
    for trial, run in zip(study.trials, runs):
        assert trial.state == optuna.trial.TrialState.PRUNED
        assert sorted(trial.intermediate_values) == [0, 1]  # epochs from 0; nothing reported after the pruning
        assert [r["valid_loss"] for r in run.history] == pytest.approx([trial.intermediate_values[e] for e in (0, 1)])
        # The run records the epochs the trial was told and no more: an epoch waits for the verdict
        # on the one before (a few more ended before the stop came, when it did not), and a stop
        # never leaves an epoch cut short in the record.
        assert [r["epoch"] for r in run.history] == [0, 1], run.history
        assert run.status == "stopped" and run.state.pruned
        assert f"pruned by Optuna (trial {trial.number}, at epoch 2: valid_loss" in run.state.stop_reason
        assert run.config["study"] == "weak" and run.config["trial"] == trial.number and run.config["trial.lr"] == 0.0
        last = run.state.checkpoints[-1]  # the last checkpoint kept: a retry(resume=True) goes on from it
        assert last["epoch"] == 1 and os.path.exists(last["path"]), run.state.checkpoints


def test_a_loop_of_the_users_is_pruned_and_wait_raises_trial_pruned(tmp_path):
    study = optuna.create_study(pruner=prunes_at_the_second_epoch())
    trial = study.ask({"value": optuna.distributions.FloatDistribution(1.0, 2.0)})
    run = ddp_notebook.launch(valid_loss_loop, devices="cpu*2", args=(500, trial.params["value"]),
                              run_root=str(tmp_path), trial=trial, monitor="valid_loss")
    with pytest.raises(optuna.TrialPruned, match="pruned by Optuna"):
        run.wait(timeout=60)
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    [frozen] = study.trials
    assert frozen.intermediate_values == {0: trial.params["value"], 1: trial.params["value"]}
    assert run.status == "stopped" and run.state.pruned and run.state.workers[0].epoch < 250
    assert run.config["trial.value"] == trial.params["value"]


def test_trials_of_a_parallel_study_take_the_devices_one_after_the_other(tmp_path):
    runs = []

    def objective(trial):
        value = trial.suggest_float("value", 1.0, 2.0)
        run = ddp_notebook.launch(valid_loss_loop, devices="cpu*2", args=(3, value), run_root=str(tmp_path),
                                  trial=trial, monitor="valid_loss")
        runs.append(run)
        return run.wait(timeout=60)

    study = optuna.create_study(study_name="parallel")
    study.optimize(objective, n_trials=4, n_jobs=2)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 4
    assert len(runs) == 4 and all(run.status == "succeeded" for run in runs)
    spans = sorted((run.state.started_at, run.state.ended_at) for run in runs)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans
    by_trial = {run.config["trial"]: run for run in runs}
    assert sorted(by_trial) == [0, 1, 2, 3]
    for t in study.trials:
        run = by_trial[t.number]
        assert run.config["study"] == "parallel" and run.config["trial.value"] == pytest.approx(t.params["value"])
        assert t.value == pytest.approx(t.params["value"])
        assert t.intermediate_values == {0: t.value, 1: t.value, 2: t.value}


def test_a_tracker_that_hangs_does_not_hold_the_pruning_back(tmp_path, monkeypatch):
    from ddp_notebook.lifecycle import reporting

    class Hangs:
        release = threading.Event()

        def log(self, metrics, step):
            self.release.wait(30)

    monkeypatch.setattr(reporting, "FINISH_WAIT", 1.0)
    study = optuna.create_study(pruner=prunes_at_the_second_epoch())
    trial = study.ask()
    hangs = Hangs()
    try:
        run = ddp_notebook.launch(valid_loss_loop, devices="cpu*2", args=(500, 1.0), run_root=str(tmp_path),
                                  trial=trial, monitor="valid_loss", report_to=hangs)
        with contextlib.suppress(optuna.TrialPruned):  # (raised: the test above)
            run.wait(timeout=60)
    finally:
        hangs.release.set()
    assert run.state.pruned and run.state.workers[0].epoch < 250
    assert run.state.tracker_notes == ["Hangs still busy 1 s after the run ended: it goes on in the background"]


def test_a_monitored_value_never_logged_is_said(tmp_path):
    study = optuna.create_study()
    trial = study.ask()
    run = ddp_notebook.launch(valid_loss_loop, devices="cpu*2", args=(2, 1.0), run_root=str(tmp_path),
                              trial=trial, monitor="val_loss")
    assert run.wait(timeout=60) == 1.0
    assert run.state.tracker_notes == ["the Optuna trial was told nothing: rank 0 never logged a finite number as "
                                       "'val_loss' (it logged valid_loss)"]


def test_a_trial_that_diverges_is_pruned_and_the_study_goes_on(tmp_path):
    x, y = models.regression_data(n=256)

    def objective(trial):
        lr = trial.suggest_categorical("lr", [1e30])  # the loss is inf within a few steps
        result = ddp_notebook.fit(model=models.linear, train_data=(x[:192], y[:192]), valid_data=(x[192:], y[192:]),
                                  loss=torch.nn.MSELoss(), optimizer=models.sgd(lr), epochs=3, batch_size=32,
                                  devices="cpu*2", run_root=str(tmp_path), trial=trial)
        return result.history[-1]["valid_loss"]

    study = optuna.create_study()
    study.optimize(objective, n_trials=1)  # no catch= needed: the study goes on
    [trial] = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED
    assert ddp_notebook.last_run().root_failure.exc_type == "NonFiniteLossError"


def test_a_fit_pruned_at_its_last_epoch_raises_trial_pruned_and_a_failing_storage_holds_no_epoch_back(tmp_path):
    x, y = models.regression_data(n=256)
    fit_args = dict(model=models.linear, train_data=(x[:192], y[:192]), valid_data=(x[192:], y[192:]),
                    loss=torch.nn.MSELoss(), optimizer=models.sgd(0.0), batch_size=64, devices="cpu*2",
                    run_root=str(tmp_path))
    # The pruner says so at the last epoch, once the ranks have left: the trial is pruned all the same
    # (the run succeeded and wait() returned, 2 times in 10 for a loop faster than the pruner).
    study = optuna.create_study(pruner=prunes_at_the_second_epoch())
    for _ in range(3):
        trial = study.ask()
        with pytest.raises(optuna.TrialPruned, match=r"pruned by Optuna \(trial \d+, at epoch 2: valid_loss "):
            ddp_notebook.fit(epochs=2, trial=trial, **fit_args)
        assert [r["epoch"] for r in ddp_notebook.last_run().history] == [0, 1]

    for _ in range(5):  # a loop of the user's, faster than the pruner: it has ended when it says so
        trial = study.ask()
        run = ddp_notebook.launch(valid_loss_loop, devices="cpu*2", args=(3, 1.0, 0.0), run_root=str(tmp_path),
                                  trial=trial, monitor="valid_loss")
        with pytest.raises(optuna.TrialPruned, match=r"pruned by Optuna \(trial \d+, at epoch 2: valid_loss "):
            run.wait(timeout=60)

    class Down(optuna.storages.InMemoryStorage):
        def set_trial_intermediate_value(self, trial_id, step, value):
            raise RuntimeError("storage down")

    # A trial whose storage fails: the run goes on, each epoch still told to the ranks (they waited a
    # minute for each verdict, which never came).
    started = time.monotonic()
    result = ddp_notebook.fit(epochs=4, trial=optuna.create_study(storage=Down()).ask(), **fit_args)
    assert time.monotonic() - started < 50 and len(result.history) == 4
    assert result.run.state.tracker_notes == ["reporting to the Optuna trial failed: RuntimeError: storage down"]
