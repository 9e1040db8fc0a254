"""The worker side: everything that runs inside a rank.

Owns: running the packed call for one rank (``execute``: set-up, process group, the call, the
result), the event a rank sends when it raised (``failure_event``, with what the user's variables
held, ``failed_locals``), the channel that carries its events out (``channel``: frames over a pipe,
or ipyparallel data messages), what ranks on engines share: the store they meet in (``meeting``),
the pulse that tells a host cut off (``pulse``) and the network: addresses, probes and keepalive,
IPv4 and IPv6 (``network``), the ``WorkerContext`` with its training helpers (``context``), a
function's own ``init_process_group`` joined to the run's group (``own_init``), gloo teardown
without torch's deadlock (``teardown``), what a rank changes in an engine and gives back
(``engine_state``), the first code a worker process runs (``boot``: it ties the process to the
notebook's before anything is imported), the frameworks' progress and device count (``frameworks``:
patched in as a worker imports them), and the entry points, which hold only their ``main``:
``process`` (run as ``__main__`` by ``boot``, or by the fork server in each worker it forks),
``zygote`` (the fork server, run by ``boot``) and ``engine`` (the functions an ipyparallel engine is
asked to run).

May import: ``ddp_notebook.transfer`` and ``ddp_notebook.core``. Never the lifecycle, the
executors or a front end: a worker process imports as little as it can (``boot`` runs the
package's ``__init__``, the API, only once something asks the package for a name), and nothing
here imports ``process`` or ``zygote`` (they run as ``__main__``).
"""
