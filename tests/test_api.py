"""The public API: every name of ``__all__`` resolves; names of the first releases still resolve, for a
release, with one DeprecationWarning that says where they live now."""
import warnings

import pytest

import ddp_notebook

pytestmark = pytest.mark.unit


def test_every_public_name_resolves():
    for name in ddp_notebook.__all__:
        assert getattr(ddp_notebook, name) is not None, name


@pytest.mark.parametrize("line, words", [
    ("from ddp_notebook import StaticProbe", "import it from ddp_notebook.core.probes"),
    ("ddp_notebook.RunState", "import it from ddp_notebook.core.state"),
    ("ddp_notebook.forkserver", "switched off with DDP_NOTEBOOK_FORKSERVER=0 (ddp_notebook.executors.local.forkserver)"),
])
def test_a_name_that_moved_warns_once_and_says_where_it_lives(line, words):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(line, {"ddp_notebook": ddp_notebook})
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"ddp_notebook.{line.split()[-1].split('.')[-1]} is no longer part of the package's API: "
        + (words if words.startswith("import") else f"it is started by %load_ext ddp_notebook and {words}")]


def test_completion_offers_the_api_and_the_exceptions_a_notebook_catches():
    names = dir(ddp_notebook)
    assert set(ddp_notebook.__all__) <= set(names) and "errors" in names
    assert not {"Any", "sys", "warnings", "CellError", "QueueUseError", "core", "ui"} & set(names)
    assert len([n for n in names if not n.startswith("_")]) < 40


def test_an_exception_no_longer_at_the_top_level_still_resolves_with_a_warning():
    from ddp_notebook.errors import CellError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ddp_notebook.CellError is CellError
    assert [str(w.message) for w in caught] == [
        "ddp_notebook.CellError is no longer at the package's top level: import it from ddp_notebook.errors"]
