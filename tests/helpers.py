import threading

# The codes of validation's findings (``core.validation.Finding``'s list, with ``empty_shard``,
# which that list leaves out); ``oversubscribed`` is the one warning.
FINDING_CODES = frozenset({"argument", "syntax", "empty", "duplicate", "missing", "memory", "mixed", "backend",
                           "oversubscribed", "too_many", "empty_shard"})
WARNING_CODES = frozenset({"oversubscribed"})
# The tests' ipyparallel controllers ping their engines every 0.5 s, not every 3 s: an engine's
# registration ends on the beat after its first pong (a cluster starts in 2.5 s, not 6.5 s). 66
# missed pings (not 10) before an engine is dropped keep that silence as long as by default (33 s).
CONTROLLER_ARGS = ["--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=66"]


def wait_for(run, predicate, timeout=60.0):
    """Block until ``predicate(run.state)`` holds, woken by the run's own events (no polling)."""
    cond = threading.Condition()

    def on_event(_event):
        with cond:
            cond.notify_all()

    run.subscribe(on_event)
    with cond:
        ok = cond.wait_for(lambda: predicate(run.state) or run.done, timeout)
    assert ok and predicate(run.state), f"condition not reached; run is {run.status}"


def wait_until(condition, timeout=60.0, every=0.05):
    """Wait for something outside any run (a file, another process) with a generous deadline."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(every)


def started_processes():
    """The pids of this process's children and theirs, less the process kept between runs (the
    fork server): what a test started."""
    import psutil

    from ddp_notebook.executors.local.executor import standing_processes

    standing = standing_processes()
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in standing and p.status() != psutil.STATUS_ZOMBIE:
                found.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def has_ended(pid):
    """Whether process ``pid`` has exited: gone, or a zombie waiting to be reaped. A zombie can be
    reaped between two looks, so a vanished pid counts as ended at any point of the check."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def mapping_at(address):
    """(name, inode) of this process's mapping that holds ``address`` (name "" when anonymous), or
    None when nothing is mapped there."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= address < hi:
                return (parts[5].strip() if len(parts) > 5 else ""), parts[4]
    return None



def started_kernel(**start):
    """A real Jupyter kernel of this environment (``start``: ``KernelManager.start_kernel``'s
    arguments, such as ``env``) and its client, ready: (manager, client).

    It is reached over Unix sockets (``transport="ipc"``), not TCP. Over TCP the manager picks
    ports, frees them, and the kernel binds them a second or two later: the other test worker's runs
    bind port 0 all the time (their stores, gloo's listeners) and can take one meanwhile, and the
    kernel dies before it replies (seen in CI: "Kernel died before replying to kernel_info")."""
    import atexit
    import shutil
    import tempfile
    import uuid

    from jupyter_client.manager import KernelManager

    global _kernel_sockets
    if _kernel_sockets is None:
        _kernel_sockets = tempfile.mkdtemp(prefix="ddp-notebook-kernels-")
        atexit.register(shutil.rmtree, _kernel_sockets, ignore_errors=True)
    km = KernelManager(kernel_name="python3", transport="ipc", ip=f"{_kernel_sockets}/{uuid.uuid4().hex[:12]}")
    km.start_kernel(**start)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
    except RuntimeError:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        raise
    return km, kc


_kernel_sockets = None  # this process's folder of kernels' sockets
