"""The pure core: what a run is, told in plain Python.

Owns: device lists and their validation (``devices``, ``probes``, ``validation``), the exception
tree (``errors``), typed events and their frame codec (``events``), the run state as a fold of
events (``state``), the event stream that keeps, logs and fans out events (``stream``), failures as
data (``failures``), straggler detection from stack dumps (``stall``), every path of a run
directory (``rundir``) and the pickling of calls (``pickling``).

May import: the standard library and cloudpickle. Never another part of ddp_notebook, never torch
or IPython at import time; a ``SubprocessProbe`` asks a child process about GPUs.
"""
