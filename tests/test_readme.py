"""The README's example runs as written."""
import os
import re

import pytest

pytestmark = pytest.mark.processes

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_example_runs():
    text = open(README).read()
    code = re.search(r"## Example\n\n```python\n(.*?)```", text, re.S).group(1)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "README.md", "exec"), namespace)
    assert sorted(namespace["weights"]) == ["bias", "weight"]
    assert namespace["run"].status == "succeeded"
