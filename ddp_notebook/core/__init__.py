"""The pure core: what a run is, told in plain Python.

Owns: device lists and their validation (``devices``, ``probes``, ``validation``), the exception
tree (``errors``), typed events and their frame codec (``events``), the run state as a fold of
events (``state``), the event stream that keeps, logs and fans out events (``stream``), failures as
data (``failures``), straggler detection from stack dumps (``stall``), every path of a run
directory (``rundir``), the pickling of calls (``pickling``) and tensors and arrays by reference:
packed, placed in shared memory or left in their file, mapped copy-on-write (``shared_data``).

May import: the standard library and cloudpickle. Never another part of ddp_notebook, never torch
or IPython at import time (``shared_data`` looks for tensors only where torch is already
imported); a ``SubprocessProbe`` asks a child process about GPUs.
"""
