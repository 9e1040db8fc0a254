"""The engine: launching a run and seeing it through, whatever backend runs its ranks.

Owns: options (``options``: what users set, apart from internal run settings), packing the call
(``packing``), sending its data to the ranks (``sending``), the supervision core
(``supervisor``: events → state, failures and their root cause, stop and kill deadlines, the
stall watchdog, one ``Outcome``), the ``Run`` facade (``run``) and ``launch`` with the kernel's
defaults (``launch``).

May import: ``ddp_notebook.core`` and ``ddp_notebook.backends``. Never a front end (the panel is
registered as a ``Run``'s display by the UI) and never ``ddp_notebook.worker`` directly.
"""
