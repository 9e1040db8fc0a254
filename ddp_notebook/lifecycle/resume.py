"""What a run needs to start again later, even from another notebook process: its call kept in
its directory (``keep_call``/``read_call``), and the checkpoint a new run resumes from
(``checkpoint_to_resume``).

A run cut off by a kernel death can then go on where its last checkpoint left it::

    run = ddp_notebook.Run.load("20261129-174217-5266c4")      # after the restart
    run.retry(resume=True, devices=run.devices).wait()          # same call, from the checkpoint
    ddp_notebook.fit(..., resume_from="20261129-174217-5266c4")  # or a fit, from that run's checkpoint

The call is the packed function and arguments the workers unpickle, with the launch options and
the recipe's settings. It is kept owner-only in the run's directory (which must be private, see
``core.rundir``), and only up to ``KEEP_LIMIT`` bytes: a call that carries a large dataset is not
copied to disk a second time (``fit(resume_from=...)`` still resumes such a run).
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

from ..core.errors import NoCheckpointError
from ..core.rundir import RunDir, check_private_file, check_private_folder, default_run_root, latest_checkpoint
from ..transfer import pickling
from ..transfer.packing import Packed
from .options import CallMode, LaunchOptions, RunSettings

__all__ = ["KeptCall", "keep_call", "read_call", "checkpoint_to_resume", "KEEP_LIMIT"]

KEEP_LIMIT = 64 * 2**20
"""The largest packed call kept on disk for a later retry (bytes)."""


@dataclass(frozen=True)
class KeptCall:
    """A run's call as kept on disk: enough to start it again."""

    payload: bytes
    options: LaunchOptions  # without engines: a cluster's client does not outlive its notebook
    settings: RunSettings
    on_engines: bool


def keep_call(directory: RunDir, payload: Packed, options: LaunchOptions, settings: RunSettings) -> bool:
    """Keep the call of the run in ``directory`` for a retry after the notebook is gone, its tensors
    and arrays by value; False when it is larger than ``KEEP_LIMIT`` or cannot be kept (a recipe
    setting that does not pickle)."""
    if len(payload.data) + payload.shared_bytes > KEEP_LIMIT or settings.mode == CallMode.SESSION:
        return False  # (a session's run is formed by its session, never retried without it)
    try:
        # Neither a cluster's client, a tracker object nor an Optuna trial outlives the notebook.
        names = tuple(t for t in options.report_to or () if isinstance(t, str)) or None
        kept = KeptCall(payload.inline(), replace(options, engines=None, report_to=names), settings.kept(),
                        options.engines is not None)
        data = pickling.dumps(kept)
        directory.write_private(RunDir.CALL, data)
    except Exception:  # noqa: BLE001 - a postprocess that cannot be pickled, no descriptor left: the run just
        return False  # cannot be retried after a restart, which Run.load says
    return True


def read_call(directory: RunDir) -> Optional[KeptCall]:
    """The kept call of a run, from a directory only this user could have written (or None)."""
    check_private_folder(directory.path, "the run directory")
    data = directory.read_private(RunDir.CALL)
    if data is None:
        return None
    kept = pickling.loads(data)
    if not isinstance(kept, KeptCall):
        return None
    # A call kept by an earlier version lacks the fields added since: they take their defaults.
    return replace(kept, options=_with_defaults(kept.options), settings=_with_defaults(kept.settings))


def _with_defaults(obj: Any) -> Any:
    """The dataclass ``obj`` made anew, a field it lacks (pickled by an earlier version) at its default."""
    values = {f.name: getattr(obj, f.name) for f in fields(obj) if f.name in vars(obj)}
    return type(obj)(**values)


def checkpoint_to_resume(source: Any) -> str:
    """The checkpoint file a run resumes from, given a run (or anything with a ``checkpoint_dir``,
    such as a ``FitResult``), a run's id or directory, a checkpoint folder, or a checkpoint file.
    Raises ``NoCheckpointError`` naming what was looked at when there is none."""
    where = getattr(source, "checkpoint_dir", None)
    if where is None:
        if not isinstance(source, (str, os.PathLike)):
            raise NoCheckpointError(f"resume_from must be a run, a run's id or directory, or a checkpoint folder or "
                                    f"file, not {type(source).__name__}")
        where = os.path.expanduser(os.fspath(source))
        if not os.path.exists(where) and os.sep not in where:  # a run id, under the default runs folder
            where = os.path.join(default_run_root(), where)
        if os.path.isdir(os.path.join(where, RunDir.CHECKPOINTS)):
            where = os.path.join(where, RunDir.CHECKPOINTS)
    where = os.path.abspath(str(where))
    path = where if os.path.isfile(where) else latest_checkpoint(where)
    if path is None:
        raise NoCheckpointError(f"no checkpoint to resume from in {where!r}: give a run that saved one "
                                "(fit saves one per epoch unless checkpoint=False), its id or directory, or a "
                                "checkpoint file")
    # It is unpickled (torch.load) by the workers: only a file of this user's, in a folder no other
    # user can write to, links followed (the workers open the real file).
    real = check_private_file(path, "the checkpoint")
    if not zipfile.is_zipfile(real):
        raise NoCheckpointError(f"{path!r} is not a checkpoint (a file saved by torch.save, such as "
                                "ctx.save_checkpoint and fit write)")
    return real
