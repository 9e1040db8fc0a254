"""The pure core: what a run is, told in plain Python.

Owns: device lists and their validation (``devices``, ``probes``, ``validation``), the exception
tree (``errors``), typed events and their frame codec (``events``), the run state as a fold of
events (``state``), the event stream that keeps, logs and fans out events (``stream``), failures as
data (``failures``), the bounds on what a run may hold (``bounds``), every path of a run directory
(``rundir``) and the settings read from the environment (``switches``).

May import: the standard library, and nothing of it that reaches outside plain Python data
(``tests/test_quality.py`` refuses ``ctypes``, ``mmap``, ``socket``, ``subprocess``, ``signal`` and
``fcntl`` here). Never another part of ddp_notebook, never torch or IPython.
"""
