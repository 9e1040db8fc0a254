"""A benchmark's temporary files in one folder of its own, removed when the benchmark exits: its
``tempfile.mkdtemp()`` folders (rendezvous files, runs folders) and those of the interpreters it
starts (``TMPDIR``), torch's error files among them, instead of dozens left in /tmp by each run."""
import atexit
import os
import shutil
import tempfile


def use() -> str:
    """Make a new folder this process's (and its children's) temporary folder; the folder."""
    folder = tempfile.mkdtemp(prefix="ddp-notebook-bench-")
    os.environ["TMPDIR"] = tempfile.tempdir = folder
    atexit.register(shutil.rmtree, folder, True)
    return folder
