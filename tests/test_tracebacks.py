"""The frames an error of this package shows: the user's, never the package's inner workings."""
import os
import traceback

import pytest

import ddp_notebook
from ddp_notebook.core.tracebacks import format_user_traceback, user_frames

pytestmark = pytest.mark.unit

# Code as if it were the package's (its file inside the package): a check that raises while a
# ``with`` block of its own is entered, through the standard library's contextlib.
_PACKAGE_CODE = '''
import contextlib

@contextlib.contextmanager
def claimed():
    raise RuntimeError("busy")
    yield

def request():
    with claimed():
        pass
'''


def _package_function():
    path = os.path.join(os.path.dirname(ddp_notebook.__file__), "_as_if_the_package.py")
    namespace: dict = {}
    exec(compile(_PACKAGE_CODE, path, "exec"), namespace)
    return namespace["request"]


def test_the_standard_librarys_frames_the_package_calls_are_left_out_with_its_own():
    request = _package_function()

    def users_code():
        request()

    with pytest.raises(RuntimeError) as e:
        users_code()
    shown = [frame.name for frame in traceback.extract_tb(user_frames(e.value.__traceback__))]
    assert shown == ["test_the_standard_librarys_frames_the_package_calls_are_left_out_with_its_own",
                     "users_code"], shown  # not contextlib's __enter__ between the package's frames
    text = format_user_traceback(e.value)
    assert "contextlib" not in text and "users_code" in text and text.endswith("RuntimeError: busy\n"), text


def test_the_standard_librarys_frames_the_user_calls_are_kept():
    def users_json():
        import json
        json.loads("{")

    with pytest.raises(ValueError) as e:
        users_json()
    assert "json/decoder.py" in format_user_traceback(e.value).replace(os.sep, "/")
