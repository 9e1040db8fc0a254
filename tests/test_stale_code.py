"""A helper module next to the notebook, edited after the notebook imported it: the launch says
that the workers would run the new file while the notebook runs the old one, and how to fix it."""
import importlib
import os
import sys

import pytest

import ddp_notebook
from ddp_notebook.lifecycle.stale_code import changed_modules

HELPER = '''
VERSION = "{version}"

def train(ctx):
    return VERSION
'''


def write(path, version, mtime):
    path.write_text(HELPER.format(version=version))
    os.utime(path, (mtime, mtime))  # whole seconds apart: the bytecode cache records seconds


# Seen from the bytecode cache the import wrote, or (PYTHONDONTWRITEBYTECODE) from the note taken
# at the first launch.
@pytest.mark.processes
@pytest.mark.parametrize("writes_bytecode", [True, False])
def test_an_edited_helper_module_is_named_at_launch(tmp_path, monkeypatch, capfd, writes_bytecode):
    monkeypatch.setattr(sys, "dont_write_bytecode", not writes_bytecode)
    module = tmp_path / "edited_helper.py"
    write(module, "v1", 1_700_000_000)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    helper = importlib.import_module("edited_helper")
    try:
        assert ddp_notebook.launch(helper.train, devices="cpu*2").wait(timeout=120) == "v1"
        assert "changed on disk" not in capfd.readouterr().err

        write(module, "v2 (edited)", 1_700_000_100)
        assert changed_modules() == {"edited_helper": str(module)}
        for _ in range(2):  # said at every launch: the workers' imports do not hide the change
            assert ddp_notebook.launch(helper.train, devices="cpu*2").wait(timeout=120) == "v2 (edited)"
            err = capfd.readouterr().err
            assert ("ddp_notebook: edited_helper (edited_helper.py) changed on disk after the notebook imported it: "
                    "the workers import the file as it is now, while the notebook runs the version it imported"
                    ) in err, err
            assert "importlib.reload(edited_helper)" in err and helper.VERSION == "v1"

        importlib.reload(helper)  # the fix the notice gives
        assert changed_modules() == {} and helper.VERSION == "v2 (edited)"
        assert ddp_notebook.launch(helper.train, devices="cpu*2").wait(timeout=120) == "v2 (edited)"
        assert "changed on disk" not in capfd.readouterr().err
    finally:
        sys.modules.pop("edited_helper", None)


@pytest.mark.unit
def test_a_module_the_call_does_not_use_is_not_named(tmp_path, monkeypatch):
    from ddp_notebook.lifecycle.stale_code import stale_code_notice
    from ddp_notebook.transfer.pickling import dumps

    module = tmp_path / "unused_helper.py"
    write(module, "v1", 1_700_000_000)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("unused_helper")
    changed_modules()  # noted, as at a launch
    try:
        write(module, "v2", 1_700_000_100)
        assert "unused_helper" in changed_modules()
        assert stale_code_notice(dumps({"fn": len, "args": ([1],)})) is None
    finally:
        sys.modules.pop("unused_helper", None)
