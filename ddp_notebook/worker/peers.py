"""Meeting the other ranks in Python, where an interrupt is still seen.

Used where a rank cannot be killed (an ipyparallel engine): torch's rendezvous waits in C++,
where an interrupt is not seen, so a rank whose peer failed before the rendezvous would
otherwise wait out the whole timeout; and a rank that returns first must not destroy the group
under a peer still in its last collective. Ranks meet through files in the run directory.
"""
from __future__ import annotations

import os
import time
from typing import Optional

from ..core.rundir import RunDir

__all__ = ["await_peers", "RunEndedError"]


class RunEndedError(RuntimeError):
    """The run ended (a peer failed) while this rank waited for its peers: a knock-on, never a cause."""


def await_peers(folder: str, directory: RunDir, rank: int, world_size: int, timeout: Optional[float] = None) -> None:
    """Say that ``rank`` got this far (a file in ``folder``) and wait until every rank did.

    Raises when the run ended meanwhile (a peer failed, or this call started after its run was
    over: ``directory.mark_ended()``) or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout if timeout else None
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, str(rank)), "w"):
        pass
    while len(os.listdir(folder)) < world_size:
        if directory.is_ended():
            raise RunEndedError("the run ended before every rank got this far")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"not every rank got this far within {timeout:.0f} s")
        time.sleep(0.01)
