"""The README, as a newcomer uses it: every ```python block, pasted in order into one new notebook,
runs top to bottom without an error (in a real kernel); and it stays a front door (<= 200 lines)."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def python_blocks():
    return re.findall(r"^```python\n(.*?)^```", open(README, encoding="utf-8").read(), re.S | re.M)


@pytest.mark.unit
def test_the_readme_is_a_front_door():
    text = open(README, encoding="utf-8").read()
    assert len(text.splitlines()) <= 200
    assert len(python_blocks()) >= 2
    for tutorial in sorted(os.listdir(os.path.join(os.path.dirname(README), "notebooks"))):
        if tutorial.endswith(".ipynb"):
            assert f"(notebooks/{tutorial})" in text, f"{tutorial} is not linked"
    for link in re.findall(r"\]\(((?!https?:)[^)#]+)\)", text):  # every local link leads somewhere
        assert os.path.exists(os.path.join(os.path.dirname(README), link)), link


@pytest.mark.kernel
def test_every_python_block_runs_in_order_in_a_new_notebook():
    from helpers import started_kernel

    km, kc = started_kernel()  # inherits DDP_NOTEBOOK_RUNS from conftest
    try:
        for block in python_blocks():
            errors = []

            def hook(msg, errors=errors):
                if msg["msg_type"] == "error":
                    errors.append("\n".join(msg["content"]["traceback"]))

            reply = kc.execute_interactive(block, timeout=300, output_hook=hook)
            assert reply["content"]["status"] == "ok" and not errors, (block, errors)
        # What the blocks started ended well: the last run waited for, and nothing still running.
        reply = kc.execute_interactive("import ddp_notebook\n"
                                       "assert all(r.wait(120) is not None or r.status == 'succeeded'\n"
                                       "           for r in ddp_notebook.runs())", timeout=300)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
