"""The README's example runs as written."""
import os
import re

import pytest

import ddp_notebook

pytestmark = pytest.mark.processes

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_example_runs():
    text = open(README).read()
    code = re.search(r"## Example\n\n```python\n(.*?)```", text, re.S).group(1)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "README.md", "exec"), namespace)
    assert sorted(namespace["weights"]) == ["bias", "weight"]
    assert namespace["run"].status == "succeeded"


@pytest.mark.kernel
def test_readme_notebook_block_runs_verbatim_in_ipython(ipython_shell):
    from IPython.utils.capture import capture_output

    text = open(README).read()
    block = re.search(r"## In a notebook\n\n```python\n(.*?)```", text, re.S).group(1)
    ip = ipython_shell
    assert ip.run_cell("import time\n"
                       "def train(ctx, steps):\n"
                       "    for epoch in range(steps):\n"
                       "        if ctx.should_stop:\n"
                       "            return 'stopped'\n"
                       "        ctx.log(step=epoch + 1, total=steps, epoch=epoch, loss=1.0 / (epoch + 1))\n"
                       "        time.sleep(0.2)\n"
                       "    return 'done'\n").success
    try:
        with capture_output() as out:
            for line in block.strip().splitlines():  # each line as its own cell, as a user would run them
                result = ip.run_cell(line)
                assert result.success, (line, out.stdout, out.stderr, result.error_in_exec)
        assert "Device list 'cpu*2': OK" in out.stdout and "Stopping run" in out.stdout
        retry = ip.user_ns["_ddp_run"]
        assert [str(d) for d in retry.devices] == ["cpu:0"] and retry.parent is not None
        assert retry.wait(timeout=60) == "done"
    finally:
        ddp_notebook.set_default_devices(None)
