"""The run lifecycle: launching a run and seeing it through, wherever its ranks execute.

Owns: options (``options``: what users set, apart from internal run settings), the call and its
checks (``call``: packing the function and its arguments, naming what cannot travel), sending its
data to the ranks (``sending``), the supervision core (``supervisor``: events → state, failures
and their root cause, stop and kill deadlines), the stall watchdog and the stack parsing it
decides from (``watchdog``, ``stall``), the ``Run`` facade (``run``), what a run keeps on disk
(``resume``, ``stored``), the loopback store of ``env://`` code (``store``), what code written for
``torch.multiprocessing`` sees of a run (``torch_compat``) and ``launch`` with the kernel's
defaults (``launch``).

May import: ``ddp_notebook.core``, ``ddp_notebook.transfer`` and ``ddp_notebook.executors``.
Never a front end (the panel is registered as a ``Run``'s display by the UI) and never
``ddp_notebook.worker`` directly (an executor starts the workers).
"""
