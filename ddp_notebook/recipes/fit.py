"""The built-in DDP fit, in the spirit of burn's ``Learner::fit``.

>>> import torch, ddp_notebook
>>> x = torch.randn(256, 4); y = x.sum(1, keepdim=True)
>>> result = ddp_notebook.fit(model=torch.nn.Linear(4, 1), train_data=(x, y), loss=torch.nn.MSELoss(),
...                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1), epochs=3, batch_size=32,
...                           devices="cpu*2")
>>> result.history[-1]["train_loss"] < result.history[0]["train_loss"], result.ranks_in_sync
(True, True)
"""
from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..core.devices import Device, DeviceSpec
from ..core.errors import FitConfigError, PreflightError, WorkerFailedError
from ..core.experiment import bounded_config, code_fingerprint, summarize
from ..core.validation import InvalidDevicesError, shard_problem
from ..lifecycle.call import first_unpicklable
from ..lifecycle.launch import launch_with, validate_for, wait_showing
from ..lifecycle.live import trial_turn
from ..lifecycle.options import LaunchKwargs, LaunchOptions, RunSettings, Unpack, options_from, takes_launch_options
from ..lifecycle.reporting import check_trial, trial_config, trial_direction
from ..lifecycle.resume import checkpoint_to_resume
from ..lifecycle.run import Run
from .fit_loop import FitSpec, build_model, fit_worker, preflight_step

__all__ = ["fit", "FitResult"]

# What the record of an epoch holds of its own (``fit_loop``): a metric of one of these names would
# replace it, or never be logged (``monitor="seconds"`` was never reported to a trial).
_RECORD_KEYS = frozenset({"epoch", "seconds", "samples_per_s", "train_loss", "valid_loss"})


@dataclass
class FitResult:
    """What ``fit`` gives back: the trained model (main worker's weights), the per-epoch
    history, whether every rank ended with identical weights, and the run itself."""

    model: Any
    """The model given to ``fit``, now holding the main worker's trained weights (or the one a
    model function built)."""
    history: list[dict[str, Any]]
    """One dict per epoch: ``epoch``, ``train_loss`` (the mean over every rank's samples),
    ``seconds``, ``samples_per_s``, and with ``valid_data`` ``valid_loss`` and each metric.
    ``epoch`` counts from 0, as ``range(epochs)``, ``ctx.epoch`` and the checkpoint files
    (``epoch-0000.pt``) do; the panel, its table and messages say "epoch 1 of N", as Keras does."""
    run: Run
    """The run that trained it (its id, events, output, checkpoints; ``retry`` goes on from it)."""
    ranks_in_sync: bool
    """Whether every rank ended with bit-identical weights (as DDP keeps them)."""
    stopped_early: bool = False
    """Whether early stopping ended the fit before ``epochs``."""
    resumed_from_epoch: Optional[int] = None
    """The epoch of the checkpoint a resumed fit went on from (None: it started afresh)."""

    @property
    def checkpoint_dir(self) -> str:
        """The folder of the fit's checkpoints (in its run's directory)."""
        return self.run.checkpoint_dir

    def __repr__(self) -> str:
        last = self.history[-1] if self.history else {}
        losses = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if k.endswith("loss") and isinstance(v, float))
        return (f"FitResult(epochs={len(self.history)}, {losses}, ranks_in_sync={self.ranks_in_sync}, "
                f"stopped_early={self.stopped_early}, run={self.run.id!r})")


# ---- notebook side -------------------------------------------------------------------------

def _as_dataset(data: Any, name: str) -> Any:
    if data is None:
        return None
    if isinstance(data, (tuple, list)) and data and all(hasattr(t, "shape") for t in data):
        import torch
        from torch.utils.data import TensorDataset

        lengths = {len(t) for t in data}
        if len(lengths) != 1:
            raise FitConfigError(f"{name} is a tuple of tensors of different lengths {sorted(lengths)}; "
                                 "give (inputs, targets) with one row per sample.")
        return TensorDataset(*[t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in data])
    # Text and mappings index too, but they are no samples (a str would be "trained" on characters).
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, (str, bytes, dict)):
        return data
    raise FitConfigError(f"{name} must be a Dataset (with __len__ and __getitem__) or a tuple of tensors "
                         f"(inputs, targets), not {type(data).__name__} {reprlib.repr(data)}.")


def _check_args(*, epochs: Any, batch_size: Any, grad_accum: Any, valid_batch_size: Any, loss: Any, optimizer: Any,
                metrics: Any, early_stopping: Any, monitor: Any, mode: Any, min_delta: Any, seed: Any,
                flags: dict[str, Any], keep_checkpoints: Any = None) -> None:
    """Every plain argument of ``fit`` checked in the notebook, before anything starts (a bool is
    not a number here, nor a number a bool)."""
    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("grad_accum", grad_accum),
                        ("valid_batch_size", valid_batch_size), ("early_stopping", early_stopping),
                        ("keep_checkpoints", keep_checkpoints)):
        if (value is not None or name in ("epochs", "batch_size", "grad_accum")) and not (whole(value) and value >= 1):
            also = {"early_stopping": " (the patience in epochs)",
                    "keep_checkpoints": " (the last checkpoints kept; None: every one)"}.get(name, "")
            none = " or None" if name in ("valid_batch_size", "early_stopping", "keep_checkpoints") else ""
            raise FitConfigError(f"{name}{also} must be a whole number >= 1{none}, not {value!r}.")
    if not (whole(seed) and 0 <= seed < 2**63):
        raise FitConfigError(f"seed must be a whole number from 0 to 2**63 - 1, not {seed!r}.")
    if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not 0 <= min_delta < float("inf"):
        raise FitConfigError(f"min_delta must be a number >= 0 (the least change that counts as better), "
                             f"not {min_delta!r}.")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise FitConfigError(f"{name} must be True or False, not {value!r}.")
    if not callable(loss):
        raise FitConfigError(f"loss must be a function loss(prediction, target), such as torch.nn.MSELoss(); "
                             f"not {reprlib.repr(loss)}.")
    if optimizer is not None and not callable(optimizer):
        raise FitConfigError(f"optimizer must be an optimizer class or a function params -> optimizer (or None "
                             f"for Adam), not {reprlib.repr(optimizer)}.")
    if metrics is not None and (not isinstance(metrics, Mapping)
                                or not all(isinstance(k, str) and callable(f) for k, f in metrics.items())):
        raise FitConfigError(f"metrics must be a dict of name -> function(prediction, target), "
                             f"not {reprlib.repr(metrics)}.")
    taken = sorted(set(metrics or ()) & _RECORD_KEYS)
    if taken:
        raise FitConfigError(f"metrics has the name {', '.join(map(repr, taken))}, which the record of an epoch "
                             f"holds already ({', '.join(sorted(_RECORD_KEYS))}): name the metric otherwise.")
    if monitor is not None and (not isinstance(monitor, str) or not monitor):
        raise FitConfigError(f"monitor must be the name of a recorded value, such as 'valid_loss', or None, "
                             f"not {monitor!r}.")
    if not isinstance(mode, str) or mode not in ("min", "max"):
        raise FitConfigError(f"mode must be 'min' or 'max', not {mode!r}.")


def _preflight(spec: FitSpec, device: Device, options: LaunchOptions, resume: Optional[str] = None) -> None:
    """One forward/backward step on the main device before any DDP worker starts."""
    if device.kind != "cpu":
        # Never touch CUDA in the notebook process: run the step in a one-worker run (which names
        # the checkpoint the fit resumes from, so the runs folder's pruning keeps its run).
        run = launch_with(preflight_step, [device], (spec,), {}, options,
                          RunSettings(resume_from=resume, origin="preflight"))
        try:
            run.wait()
        except WorkerFailedError as e:
            raise PreflightError(f"The single-device preflight step on {device} failed, so no DDP worker was "
                                 f"started: {e.failure.summary()}") from e
        return
    try:
        preflight_step(None, spec)
    except FitConfigError:
        raise
    except Exception as e:
        raise PreflightError(f"The single-device preflight step on {device} failed, so no DDP worker was "
                             f"started: {type(e).__name__}: {e}") from e


def _fit_result(value: dict[str, Any], run: Run, model: Any) -> FitResult:
    import torch

    target = model if isinstance(model, torch.nn.Module) else build_model(model)
    target.load_state_dict(value["state_dict"])
    return FitResult(model=target, history=value["history"], run=run, ranks_in_sync=value["ranks_in_sync"],
                     stopped_early=value["stopped_early"], resumed_from_epoch=value["resumed_from_epoch"])


@takes_launch_options
def fit(
    model: Any,
    train_data: Any,
    loss: Callable,
    optimizer: Any = None,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    devices: Optional[DeviceSpec] = None,
    valid_data: Any = None,
    metrics: Optional[dict[str, Callable[..., Any]]] = None,
    valid_batch_size: Optional[int] = None,
    shuffle: bool = True,
    drop_last: bool = False,
    grad_accum: int = 1,
    early_stopping: Optional[int] = None,
    monitor: Optional[str] = None,
    mode: str = "min",
    min_delta: float = 0.0,
    checkpoint: bool = True,
    keep_checkpoints: Optional[int] = 2,
    preflight: bool = True,
    seed: int = 0,
    resume_from: Any = None,
    wait: bool = True,
    trial: Any = None,
    **launch_options: Unpack[LaunchKwargs],
) -> Union[FitResult, Run]:
    """Train ``model`` with DistributedDataParallel on ``devices``; return the trained model.

    Per epoch every rank trains on its shard of ``train_data``; the main worker validates on the
    whole of ``valid_data`` and saves a checkpoint; all ranks stop together on early stopping.
    Before anything starts, the device list and every rank's shard are validated, and (with
    ``preflight``) one forward/backward step runs on the main device, so plain bugs surface at
    once with a normal traceback.

    Parameters
    ----------
    model : torch.nn.Module or callable
        The model, trained in place (the main worker's weights are loaded back into it), or a
        function without arguments that builds one.
    train_data : Dataset or tuple of tensors
        A ``Dataset`` whose samples are ``(inputs..., target)``, or ``(inputs, targets)`` tensors
        with one row per sample.
    loss : callable
        ``loss(outputs, targets)`` returning a scalar tensor, such as ``torch.nn.MSELoss()``.
    optimizer : type or callable, optional
        An optimizer class (``torch.optim.SGD``) or a function of the parameters
        (``lambda params: torch.optim.SGD(params, lr=0.1)``). Default: Adam with lr 1e-3.
    epochs : int, default 1
        Epochs in all (a resumed fit goes on up to this number).
    batch_size : int, default 32
        Samples per batch **per worker**: the global batch is ``batch_size * len(devices)``.
    devices : str or list, optional
        The device list (see :func:`ddp_notebook.parse_devices`); default
        :func:`ddp_notebook.default_devices`.
    valid_data : Dataset or tuple of tensors, optional
        Validation data, evaluated whole on the main worker after each epoch (``valid_loss``).
    metrics : dict of str to callable, optional
        ``{"mae": fn}`` with ``fn(outputs, targets)`` returning a number per batch; each is
        averaged over the validation samples, every batch weighted by its size (needs
        ``valid_data``).
    valid_batch_size : int, optional
        Batch size of validation (default ``batch_size``).
    shuffle : bool, default True
        Shuffle each rank's shard anew every epoch (``DistributedSampler``: the same order on
        every rank for a given ``seed``, each rank taking its positions of it).
    drop_last : bool, default False
        Drop each rank's last incomplete batch.
    grad_accum : int, default 1
        Accumulate gradients over this many batches per optimizer step (DDP's all-reduce is
        skipped in between).
    early_stopping : int, optional
        Patience in epochs: stop (every rank together) after this many epochs without an
        improvement of ``monitor`` by more than ``min_delta``. None: never.
    monitor : str, optional
        The recorded value early stopping and the best checkpoint watch: ``"valid_loss"`` (the
        default with ``valid_data``), ``"train_loss"`` (the default without), or a metric's name.
    mode : {"min", "max"}, default "min"
        Whether a lower or a higher ``monitor`` is better.
    min_delta : float, default 0.0
        The least change of ``monitor`` that counts as an improvement.
    checkpoint : bool, default True
        Save a checkpoint every epoch (weights, optimizer, history, early-stopping state and
        every rank's random state), which ``resume_from`` and ``Run.retry(resume=True)`` go on from.
    keep_checkpoints : int or None, default 2
        How many of the latest checkpoints the run keeps (None: every one); with ``valid_data``
        the best by ``monitor`` is kept too.
    preflight : bool, default True
        Run one forward/backward step on the main device before any worker starts (on a GPU in
        a one-worker run, never in the notebook process).
    seed : int, default 0
        Seeds torch's random numbers on every rank (a model a function builds, dropout) and the
        shuffle.
    resume_from : Run, FitResult, str or path, optional
        Go on from a checkpoint: a run or ``FitResult``, a run's id or directory (its latest
        checkpoint; runs cut off by a kernel restart are found too), or a checkpoint file.
    wait : bool, default True
        Block until the fit ends (showing its progress) and return the ``FitResult``; False
        returns the ``Run`` at once, whose ``wait()`` then returns the ``FitResult``.
    trial : optuna.trial.Trial, optional
        Report ``monitor`` to this Optuna trial each epoch (``trial.report(value, epoch)``, epochs
        from 0), each epoch beginning once the trial has judged the one before; when
        ``trial.should_prune()``, every rank stops there (the run's record and last checkpoint end
        at the epoch the trial was pruned at), and ``optuna.TrialPruned`` is raised here. The run
        records the trial's
        parameters in its config. Trials run at once (``study.optimize(n_jobs=...)``) wait for
        the devices: one run per device.
    **launch_options
        The launch options below, as for :func:`ddp_notebook.launch`.

    Returns
    -------
    FitResult or Run
        The :class:`~ddp_notebook.FitResult` (``model``, per-epoch ``history``,
        ``ranks_in_sync``, ``run``), or with ``wait=False`` the :class:`~ddp_notebook.Run`.

    Raises
    ------
    FitConfigError
        An argument cannot work (``epochs=True``, a shard without a single batch, an unknown
        ``monitor``...); nothing was started.
    InvalidDevicesError
        The device list failed validation; nothing was started.
    NotPicklableError
        The model, data, loss, optimizer or a metric cannot be sent to the workers.
    PreflightError
        The preflight step raised (the original exception is its cause); nothing was launched.
    optuna.TrialPruned
        ``trial``'s pruner stopped the fit (``wait=True``; with ``wait=False``, ``Run.wait()``
        raises it).
    WorkerFailedError
        A worker failed (``wait=True``); a loss that became nan or inf fails its rank with
        ``NonFiniteLossError``.
    LaunchOptionError
        A launch option cannot work.

    Examples
    --------
    >>> import torch, ddp_notebook
    >>> x = torch.randn(256, 4); y = x.sum(dim=1, keepdim=True)
    >>> result = ddp_notebook.fit(torch.nn.Linear(4, 1), (x, y), loss=torch.nn.MSELoss(),
    ...                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1), epochs=3,
    ...                           batch_size=32, devices="cpu*2")
    >>> len(result.history), result.ranks_in_sync
    (3, True)
    """
    import torch

    _check_args(epochs=epochs, batch_size=batch_size, grad_accum=grad_accum, valid_batch_size=valid_batch_size,
                loss=loss, optimizer=optimizer, metrics=metrics, early_stopping=early_stopping, monitor=monitor,
                mode=mode, min_delta=min_delta, seed=seed, flags={"shuffle": shuffle, "drop_last": drop_last,
                                                                   "checkpoint": checkpoint, "preflight": preflight,
                                                                   "wait": wait}, keep_checkpoints=keep_checkpoints)
    check_trial(trial, "fit")
    metrics = dict(metrics or {})
    train = _as_dataset(train_data, "train_data")
    valid = _as_dataset(valid_data, "valid_data")
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise FitConfigError("model must be a torch.nn.Module or a function returning one, "
                             f"not {type(model).__name__}.")
    options = options_from("fit", dict(launch_options))
    resume = checkpoint_to_resume(resume_from) if resume_from is not None else None
    monitor = monitor or ("valid_loss" if valid is not None else "train_loss")
    direction = trial_direction(trial)
    if direction is not None and direction != mode:
        raise FitConfigError(f"the trial's study is to {direction}imize, but fit's mode is {mode!r} (monitor "
                             f"{monitor!r}): give mode={direction!r} with a monitor that is better "
                             f"{'higher' if direction == 'max' else 'lower'}, or a study of that direction.")
    config = {"function": "fit", "model": model, "train_data": train_data, "loss": loss, "optimizer": optimizer,
              "epochs": epochs, "batch_size": batch_size, "valid_data": valid_data, "metrics": sorted(metrics),
              "valid_batch_size": valid_batch_size, "shuffle": shuffle, "drop_last": drop_last,
              "grad_accum": grad_accum, "early_stopping": early_stopping, "monitor": monitor, "mode": mode,
              "min_delta": min_delta, "checkpoint": checkpoint, "keep_checkpoints": keep_checkpoints, "seed": seed,
              "resume_from": resume}
    with trial_turn(devices, trial):
        report = validate_for(devices, options)
        if not report.ok:
            raise InvalidDevicesError(report)
        # Data problems are named as such, once (every rank's shard has the same size).
        empty = shard_problem(len(report.devices), len(train), batch_size, drop_last)
        if empty is not None:
            raise FitConfigError(empty)
        if valid is not None and len(valid) == 0:
            raise FitConfigError("valid_data is empty: give at least one sample, or valid_data=None.")
        allowed = {"train_loss"} | ({"valid_loss", *metrics} if valid is not None else set())
        if monitor not in allowed:
            raise FitConfigError(f"monitor {monitor!r} is not recorded; choose one of {', '.join(sorted(allowed))}.")
        spec = FitSpec(model=model, train_data=train, valid_data=valid, loss=loss, optimizer=optimizer, epochs=epochs,
                       batch_size=batch_size, valid_batch_size=valid_batch_size or batch_size, metrics=metrics,
                       shuffle=shuffle, drop_last=drop_last, grad_accum=grad_accum, early_stopping=early_stopping,
                       monitor=monitor, mode=mode, min_delta=min_delta, checkpoint=checkpoint, seed=seed,
                       keep_checkpoints=keep_checkpoints)
        unpicklable = first_unpicklable([(f"fit({name}=...)", getattr(spec, name)) for name in
                                         ("model", "train_data", "valid_data", "loss", "optimizer", "metrics")])
        if unpicklable is not None:
            raise unpicklable
        if preflight:
            _preflight(spec, report.devices[0], options, resume)
        settings = RunSettings(postprocess=lambda value, run: _fit_result(value, run, model), resume_from=resume,
                               origin="fit", config={**bounded_config({k: summarize(v) for k, v in config.items()}),
                                                   **trial_config(trial)},
                               code=code_fingerprint([model, loss, optimizer, *metrics.values()]), monitor=monitor,
                               monitor_mode=mode, trial=trial)
        run = launch_with(fit_worker, list(report.devices), (spec,), {}, options, settings, report=report)
    return wait_showing(run) if wait else run
