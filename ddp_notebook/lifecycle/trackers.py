"""The trackers a run reports to (``report_to=``), each behind one small surface: ``start`` with
what the run is, ``log`` rank 0's values at their steps, ``finish`` with its status and summary.

``report_to`` takes Hugging Face's names (accelerate says ``log_with``): ``"tensorboard"``,
``"mlflow"``, ``"wandb"``, a list of them, or a tracker object: a ``SummaryWriter`` (anything with
``add_scalar``) or anything with ``log(metrics, step)`` (a ``wandb`` run, accelerate's trackers).
Where each goes unless the user says:

- TensorBoard: event files in the run directory's ``tb/`` (``%tensorboard --logdir`` on the runs
  folder shows every run), the config as hparams at the end;
- MLflow: its current tracking URI and experiment (``mlflow.set_experiment``), a run named by the
  run's name (its id without one), the config as params, the tags as tags;
- W&B: the project ``$WANDB_PROJECT``, else ``ddp_notebook``, the config as config, the tags as
  ``key=value`` strings (``$WANDB_MODE=offline`` keeps it on disk).

The libraries are imported when a run starts its trackers, on the reporter's thread (never on
the launch path); a library that is missing or fails is said in one line and the run goes on.
The workers never see a tracker: the notebook forwards what rank 0 logs (``lifecycle.reporting``).
"""
from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ..core.errors import LaunchOptionError

__all__ = ["TRACKER_NAMES", "Tracker", "RunRecord", "Point", "check_report_to", "tracker_labels", "make_trackers",
           "TB_FOLDER"]

TRACKER_NAMES = ("tensorboard", "mlflow", "wandb")
TB_FOLDER = "tb"  # in the run directory

Point = tuple[int, float, dict[str, float]]
"""One ``ctx.log`` of rank 0: its step, its time (``time.time()``), its numbers by name."""


@dataclass(frozen=True)
class RunRecord:
    """What a tracker is told of the run it reports."""

    run_id: str
    run_dir: str
    name: Optional[str]
    tags: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        """The run's name, else its id."""
        return self.name or self.run_id


def _is_writer(obj: Any) -> bool:
    return callable(getattr(obj, "add_scalar", None))


def _is_logger(obj: Any) -> bool:
    return callable(getattr(obj, "log", None))


def check_report_to(value: Any) -> Optional[tuple[Any, ...]]:
    """``report_to`` as a tuple of tracker names and objects (None: none), or ``LaunchOptionError``
    naming what is not a tracker.

    >>> check_report_to("mlflow"), check_report_to(["tensorboard", "wandb"])
    (('mlflow',), ('tensorboard', 'wandb'))
    >>> check_report_to("tensorbord")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ddp_notebook.errors.LaunchOptionError: report_to names 'tensorbord', which is not a tracker: give 'tensorboard', ...
    """
    if value is None or isinstance(value, str) and value.strip().lower() == "none":  # (Hugging Face's "none")
        return None
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    valid = f"{', '.join(map(repr, TRACKER_NAMES[:-1]))} or {TRACKER_NAMES[-1]!r}"
    out: list[Any] = []
    for item in items:
        if isinstance(item, str):
            name = item.strip().lower()
            if name == "none":  # (Hugging Face's word for no tracker, in a list too)
                continue
            if name not in TRACKER_NAMES:
                raise LaunchOptionError(f"report_to names {item!r}, which is not a tracker: give {valid}, a list of "
                                        "them, or a tracker object (a SummaryWriter, or anything with "
                                        "log(metrics, step))")
            item = name
        elif not (_is_writer(item) or _is_logger(item)):
            raise LaunchOptionError(f"report_to has {type(item).__name__} {item!r:.80}, which is not a tracker: give "
                                    f"{valid}, a SummaryWriter, or an object with log(metrics, step)")
        if not any(item is seen or item == seen for seen in out if isinstance(seen, str) == isinstance(item, str)):
            out.append(item)
    return tuple(out) or None


def tracker_labels(report_to: Optional[Sequence[Any]]) -> list[str]:
    """How the trackers of ``report_to`` are named in the panel and the records: a tracker's name,
    or an object's type (``SummaryWriter``)."""
    return [t if isinstance(t, str) else type(t).__name__ for t in report_to or ()]


def make_trackers(report_to: Optional[Sequence[Any]]) -> list[Tracker]:
    """One tracker per entry of ``report_to`` (checked by ``check_report_to``), not started."""
    made: list[Tracker] = []
    for item in report_to or ():
        if item == "tensorboard":
            made.append(TensorBoardTracker())
        elif item == "mlflow":
            made.append(MLflowTracker())
        elif item == "wandb":
            made.append(WandbTracker())
        elif _is_writer(item):
            made.append(TensorBoardTracker(writer=item))
        else:
            made.append(ObjectTracker(item))
    return made


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _folder_name(name: str) -> str:
    """A run's name as a folder's: what a path cannot hold as ``_``.

    >>> _folder_name("lr=0.1 / adam")
    'lr=0.1_adam'
    """
    return re.sub(r"[^\w.=+,-]+", "_", name).strip("._")[:80] or "run"


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    """A config as trackers take parameters: text, numbers, True/False; the rest as text."""
    return {k: v if isinstance(v, (str, int, float, bool)) and not (isinstance(v, float) and not math.isfinite(v))
            else str(v) for k, v in config.items()}


class Tracker:
    """Where a run's values go. Called from the run's reporter thread only, one call at a time."""

    label = "tracker"
    #: What to install when the library is missing.
    needs = ""

    def start(self, record: RunRecord) -> None:
        """Open the tracker's run: the run's name, tags and config."""

    def log(self, points: Sequence[Point]) -> None:
        """Rank 0's values, at their steps, in the order logged."""

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        """Close the tracker's run: the run's status (``succeeded``, ``failed``, ``stopped``) and its
        final metrics (``Run.metrics``)."""


class TensorBoardTracker(Tracker):
    """TensorBoard event files: a writer of the run's own in ``<run dir>/tb`` (``tb/<name>`` for a
    named run: TensorBoard names runs by their folders), closed at the end with the name, tags and
    config as hparams; or the user's ``SummaryWriter`` (scalars only; flushed, never closed).

    torch's ``SummaryWriter`` is imported when the tracker is made, on the thread that launches
    (once per kernel: a tenth of a second with torch imported): torch imported from a second
    thread while the notebook's own thread imports it can abort the notebook process."""

    label = "tensorboard"
    needs = "pip install tensorboard"

    def __init__(self, writer: Any = None) -> None:
        self.writer = writer
        self.owned = writer is None
        self.missing: Optional[ImportError] = None
        if writer is not None:
            self.label = type(writer).__name__
        else:
            try:
                from torch.utils.tensorboard import SummaryWriter
                from torch.utils.tensorboard.summary import hparams
            except ImportError as e:  # said by start(), on the reporter's thread, as any tracker's trouble
                self.missing = e
            else:
                self.make, self.summaries = SummaryWriter, hparams
        self.hparams: dict[str, Any] = {}
        self.logged: set[str] = set()  # the series written
        self.last_step = 0

    def start(self, record: RunRecord) -> None:
        if self.missing is not None:
            raise self.missing
        if self.owned:
            folder = os.path.join(record.run_dir, TB_FOLDER)
            if record.name:  # TensorBoard names a run by its folder: a named run's name shows there
                folder = os.path.join(folder, _folder_name(record.name))
            # Written in large blocks, a few a minute: the writer's own thread wakes rarely (flush() at the end).
            self.writer = self.make(log_dir=folder, max_queue=1000, flush_secs=10)
        self.hparams = {"name": record.title, **{f"tag.{k}": v for k, v in _plain(record.tags).items()},
                        **_plain(record.config)}

    def log(self, points: Sequence[Point]) -> None:
        for step, t, values in points:
            for name, value in values.items():
                self.writer.add_scalar(name, value, global_step=step, walltime=t)
            self.logged.update(values)
            self.last_step = max(self.last_step, step)

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        if self.owned:
            # The HParams dashboard's metrics: each series (its chart's tag: the dashboard reads its last
            # value) and the monitored value's best, written at the last step; in the run's own folder
            # (add_hparams would write them again, into a folder of their own).
            final = {k: v for k, v in _numbers(summary).items() if k in self.logged or k.endswith((".min", ".max"))}
            for name, value in final.items():
                if name not in self.logged:
                    self.writer.add_scalar(name, value, global_step=self.last_step)
            for proto in self.summaries(self.hparams, final):
                self.writer.file_writer.add_summary(proto, self.last_step)
            self.writer.close()
        elif callable(getattr(self.writer, "flush", None)):
            self.writer.flush()


_MLFLOW_KEY = re.compile(r"[^\w\-./ ]")
MLFLOW_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


class MLflowTracker(Tracker):
    """An MLflow run opened with ``mlflow.start_run`` on the reporter's thread, so MLflow's own
    rules choose where it goes (the tracking URI and experiment set, ``$MLFLOW_RUN_ID`` resumed as
    Hugging Face's MLflow callback does) while the notebook's own active run, which MLflow keeps
    per thread, is left alone; values through ``MlflowClient.log_batch``."""

    label = "mlflow"
    needs = "pip install mlflow"

    def start(self, record: RunRecord) -> None:
        import mlflow

        self.mlflow = mlflow
        tags = {_MLFLOW_KEY.sub("_", k): str(v) for k, v in record.tags.items()}
        tags["ddp_notebook.run_id"] = record.run_id
        self.run_id = mlflow.start_run(run_name=record.title, tags=tags).info.run_id
        self.client = mlflow.MlflowClient()
        params = [(_MLFLOW_KEY.sub("_", k)[:250], str(v)[:6000]) for k, v in _plain(record.config).items()]
        for i in range(0, len(params), 100):  # MLflow takes 100 params a call
            mlflow.log_params(dict(params[i:i + 100]))
        self.logged: set[str] = set()  # the metrics logged as series
        self.last = (0, 0.0)  # the last step and time logged

    def log(self, points: Sequence[Point]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(_MLFLOW_KEY.sub("_", name)[:250], value, int(t * 1000), step)
                   for step, t, values in points for name, value in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
        self.logged.update(m.key for m in metrics)
        if points:
            self.last = (max(self.last[0], points[-1][0]), points[-1][1])

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        # What the run adds at its end (the best of the monitored value, peak memory) at its last step;
        # a series' last value is in it already (logged again, it would be a point at a step of its own).
        step, t = self.last
        final = [Metric(key, value, int(max(t, time.time()) * 1000), step)
                 for key, value in ((_MLFLOW_KEY.sub("_", k)[:250], v) for k, v in _numbers(summary).items())
                 if key not in self.logged]
        if final:
            self.client.log_batch(self.run_id, metrics=final[:1000])
        self.mlflow.end_run(status=MLFLOW_STATUS.get(status, "FINISHED"))


class WandbTracker(Tracker):
    """A W&B run in ``$WANDB_PROJECT`` (else ``ddp_notebook``); ``$WANDB_MODE`` and W&B's own
    settings as the user has them."""

    label = "wandb"
    needs = "pip install wandb"

    def start(self, record: RunRecord) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "ddp_notebook", name=record.title,
                              tags=[f"{k}={v}"[:64] for k, v in record.tags.items()], config=_plain(record.config),
                              reinit="create_new")
        self.last_step = -1

    def log(self, points: Sequence[Point]) -> None:
        for step, _t, values in points:
            step = max(step, self.last_step)  # W&B takes steps that never go back
            self.run.log(dict(values), step=step)
            self.last_step = step

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        self.run.summary.update(_numbers(summary))
        self.run.finish(exit_code=0 if status == "succeeded" else 1)


class ObjectTracker(Tracker):
    """Anything with ``log(metrics, step)``: called once per step with that step's values; its
    ``flush()``, where it has one, at the end (it is the user's: never closed)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.label = type(target).__name__

    def log(self, points: Sequence[Point]) -> None:
        merged: list[tuple[int, dict[str, float]]] = []
        for step, _t, values in points:  # one call per step, with every value logged at it
            if merged and merged[-1][0] == step:
                merged[-1][1].update(values)
            else:
                merged.append((step, dict(values)))
        for step, values in merged:
            self.target.log(values, step)

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        if callable(getattr(self.target, "flush", None)):
            self.target.flush()
