"""What a session's rank shows the notebook besides its text: rich output, as in a notebook.

A rank has an IPython shell of its own (``InteractiveShell``, its history off) whose display
publisher hands each bundle (``display()``, ``IPython.display.HTML``, an image) to the session
loop, which sends it to the notebook; ``plt.show()`` and the figures a cell draws reach it
through matplotlib's inline backend (``matplotlib_inline``, the one Jupyter kernels use: set as
``MPLBACKEND`` unless the user chose a backend), flushed when a cell ends as IPython flushes
them (its ``post_execute`` event). A cell's value is formatted here too, by the shell's display
formatter: the notebook receives its text, or its bundle (a figure as an image), never the
object only to print it.

On an ipyparallel engine, whose kernel is an IPython shell already, that shell is used, its
display publisher lent to the session while its loop runs. Without IPython, bundles are the
value's text alone.

Bundles are bounded: each text cut at ``TEXT_CHARS``; past ``BUNDLE_CHARS`` in all, only the
text is kept.
"""
from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Optional

from ..core.bounds import cut
from ..core.events import DISPLAY_ID

__all__ = ["RankDisplay", "TEXT_CHARS", "BUNDLE_CHARS", "bound_bundle"]

#: Characters of a value's text the notebook is sent (a repr can be huge).
TEXT_CHARS = 20_000
#: Characters of one bundle (an image is base64 text): past them, the text alone.
BUNDLE_CHARS = 8 * 1024 * 1024
METADATA_CHARS = 64 * 1024
_INLINE = "module://matplotlib_inline.backend_inline"

Publish = Callable[[dict[str, Any], dict[str, Any]], None]


class RankDisplay:
    """The rank's display machinery; ``publish(data, metadata)`` receives each bundle shown."""

    def __init__(self, publish: Publish) -> None:
        self._publish = publish
        self.shell: Any = None
        self._lent: Any = None  # the display publisher of a shell that was there, while borrowed
        #: ``display`` for the ranks' namespaces (IPython's), or None without IPython.
        self.show: Optional[Callable[..., Any]] = None
        try:
            self._make_shell()
        except Exception:  # noqa: BLE001 - without a shell, a rank still runs cells and sends text
            self.shell = None

    def _make_shell(self) -> None:
        from IPython.core.displaypub import DisplayPublisher
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.display import display
        from traitlets.config import Config

        owner = self

        class _Publisher(DisplayPublisher):
            def publish(self, data: dict[str, Any], metadata: Optional[dict[str, Any]] = None, source: Any = None,
                        *, transient: Optional[dict[str, Any]] = None, update: bool = False, **kwargs: Any) -> None:
                shown = dict(bound_metadata(metadata or {}))
                display_id = (transient or {}).get("display_id")
                if isinstance(display_id, str):  # display(..., display_id=True) and its handle's update()
                    shown[DISPLAY_ID] = {"id": display_id[:100], "update": bool(update)}
                owner._publish(bound_bundle(data), shown)

            def clear_output(self, wait: bool = False) -> None:
                pass  # an output area of the rank's own has nothing to clear

        if InteractiveShell.initialized():
            # A shell that is already there (an engine's kernel) keeps its ways, but what the
            # session's cells display goes to the notebook's cell: its publisher is borrowed
            # (a public trait) until the session's loop ends (``close``).
            shell = InteractiveShell.instance()
            self.shell, self.show = shell, display
            self._lent = shell.display_pub
            shell.display_pub = _Publisher(shell=shell)
            return
        if "matplotlib" not in sys.modules and "MPLBACKEND" not in os.environ \
                and importlib.util.find_spec("matplotlib_inline") is not None:
            os.environ["MPLBACKEND"] = _INLINE  # read when a cell imports matplotlib
        config = Config()
        config.HistoryManager.enabled = False  # no history file: a rank runs the notebook's cells
        self.shell = InteractiveShell.instance(config=config, display_pub_class=_Publisher)
        self.show = display

    def bundle(self, value: Any) -> Optional[dict[str, Any]]:
        """``value`` as the notebook shows a cell's value: its MIME bundle (text, and HTML or
        an image where it has one), bounded; None when the value displayed itself
        (``_ipython_display_``), as IPython then shows no ``Out``."""
        if self.shell is None:
            return {"text/plain": self.text(value)}
        if callable(getattr(type(value), "_ipython_display_", None)):
            # As IPython shows it: what it prints and displays is the cell's (a traceback if it raises).
            self.shell.display_formatter.ipython_display_formatter(value)
            return None
        with _quiet():  # a formatter that raises prints its traceback: the text below says it once
            try:
                data, _metadata = self.shell.display_formatter.format(value, exclude={"text/plain"})
            except Exception:  # noqa: BLE001 - no rich form: the text alone
                data = {}
        return bound_bundle({**data, "text/plain": self.text(value)})

    def text(self, value: Any) -> str:
        """``value``'s text, as IPython prints it (``repr`` without IPython), bounded; a repr that
        raises is said, never raised."""
        failed = f"<{type(value).__qualname__} object: its repr raised"
        try:
            with _quiet():
                text = self.shell.display_formatter.formatters["text/plain"](value) if self.shell is not None \
                    else repr(value)
        except BaseException as exc:  # noqa: BLE001 - a broken __repr__ (even SystemExit) is said, not raised
            return f"{failed} {type(exc).__name__}>"
        if not isinstance(text, str):  # IPython's formatter caught the repr's error and gave None
            return f"{failed} an error>"
        return cut(text, TEXT_CHARS)

    def close(self) -> None:
        """Give a borrowed shell its own display publisher back."""
        if self._lent is not None:
            self.shell.display_pub, self._lent = self._lent, None

    def cell_ended(self) -> None:
        """Show the figures the cell drew (matplotlib's inline backend), as IPython does when a
        cell ends."""
        if self.shell is not None:
            self.shell.events.trigger("post_execute")


def bound_bundle(data: dict[str, Any]) -> dict[str, Any]:
    """A bundle as it can travel, bounded: text as it is (plain text cut), bytes (an image from
    ``_repr_png_``) as base64 text, JSON types (``application/json``, Vega-Lite) as JSON;
    past ``BUNDLE_CHARS`` in all, its plain text alone, saying so."""
    kept: dict[str, Any] = {}
    for mime, v in data.items():
        if isinstance(v, bytes):
            v = base64.b64encode(v).decode("ascii")
        if isinstance(v, str):
            kept[mime] = cut(v, TEXT_CHARS) if mime == "text/plain" else v
        elif mime.endswith("json") and isinstance(v, (dict, list)):
            kept[mime] = v
    size = sum(len(v) if isinstance(v, str) else len(json.dumps(v, default=str)) for v in kept.values())
    if size > BUNDLE_CHARS:
        text = kept.get("text/plain", "<a display>")
        kept = {"text/plain": f"{text} [{size / 2**20:.0f} MB to display: over the "
                              f"{BUNDLE_CHARS // 2**20} MB a rank sends, its text alone is shown]"}
    return kept


def bound_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """A display's metadata, or none when it is larger than a display's metadata should be."""
    try:
        return metadata if len(json.dumps(metadata, default=str)) <= METADATA_CHARS else {}
    except (TypeError, ValueError):
        return {}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield
