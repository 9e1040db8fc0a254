"""What a session's rank shows the notebook besides its text: rich output, as in a notebook.

A rank has an IPython shell of its own (``InteractiveShell``, its history off) whose display
publisher hands each bundle (``display()``, ``IPython.display.HTML``, an image) to the session
loop, which sends it to the notebook; ``plt.show()`` and the figures a cell draws reach it
through matplotlib's inline backend (``matplotlib_inline``, the one Jupyter kernels use: set as
``MPLBACKEND`` unless the user chose a backend), flushed when a cell ends as IPython flushes
them (its ``post_execute`` event). A cell's value is formatted here too, by the shell's display
formatter: the notebook receives its text, or its bundle (a figure as an image), never the
object only to print it.

Without IPython (a bare engine), bundles are the value's text alone.

Bundles are bounded: each text cut at ``TEXT_CHARS``; past ``BUNDLE_CHARS`` in all, only the
text is kept.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["RankDisplay", "TEXT_CHARS", "BUNDLE_CHARS"]

#: Characters of a value's text the notebook is sent (a repr can be huge).
TEXT_CHARS = 20_000
#: Characters of one bundle (an image is base64 text): past them, the text alone.
BUNDLE_CHARS = 8 * 1024 * 1024
_INLINE = "module://matplotlib_inline.backend_inline"

Publish = Callable[[dict[str, Any], dict[str, Any]], None]


class RankDisplay:
    """The rank's display machinery; ``publish(data, metadata)`` receives each bundle shown."""

    def __init__(self, publish: Publish) -> None:
        self._publish = publish
        self.shell: Any = None
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
            def publish(self, data: dict[str, Any], metadata: Optional[dict[str, Any]] = None, *args: Any,
                        **kwargs: Any) -> None:
                owner._publish(bound_bundle(data), dict(metadata or {}))

            def clear_output(self, wait: bool = False) -> None:
                pass  # an output area of the rank's own has nothing to clear

        if InteractiveShell.initialized():  # a shell that is already there (an engine's kernel) keeps its ways
            self.shell, self.show = InteractiveShell.instance(), display
            return
        if "matplotlib" not in sys.modules and "MPLBACKEND" not in os.environ \
                and importlib.util.find_spec("matplotlib_inline") is not None:
            os.environ["MPLBACKEND"] = _INLINE  # read when a cell imports matplotlib
        config = Config()
        config.HistoryManager.enabled = False  # no history file: a rank runs the notebook's cells
        self.shell = InteractiveShell.instance(config=config, display_pub_class=_Publisher)
        self.show = display

    def bundle(self, value: Any) -> dict[str, Any]:
        """``value`` as the notebook shows a cell's value: its MIME bundle (text, and HTML or
        an image where it has one), bounded."""
        if self.shell is None:
            return {"text/plain": self.text(value)}
        data, _metadata = self.shell.display_formatter.format(value)
        return bound_bundle(data) if data else {"text/plain": self.text(value)}

    def text(self, value: Any) -> str:
        """``value``'s text, as IPython prints it (``repr`` without IPython), bounded."""
        try:
            text = self.shell.display_formatter.formatters["text/plain"](value) if self.shell is not None \
                else repr(value)
        except Exception as exc:  # noqa: BLE001 - a broken __repr__ is said, not raised
            text = f"<{type(value).__qualname__} object: its repr raised {type(exc).__name__}>"
        return _cut(str(text))

    def cell_ended(self) -> None:
        """Show the figures the cell drew (matplotlib's inline backend), as IPython does when a
        cell ends."""
        if self.shell is not None:
            self.shell.events.trigger("post_execute")


def bound_bundle(data: dict[str, Any]) -> dict[str, Any]:
    """The text parts of a bundle (an image is base64 text), each cut, the whole bounded: past
    ``BUNDLE_CHARS``, its plain text alone."""
    kept = {mime: _cut(v) if mime == "text/plain" else v for mime, v in data.items() if isinstance(v, str)}
    if sum(len(v) for v in kept.values()) > BUNDLE_CHARS:
        kept = {"text/plain": kept.get("text/plain", "<a display too large to send>")}
    return kept


def _cut(text: str) -> str:
    if len(text) <= TEXT_CHARS:
        return text
    return f"{text[:TEXT_CHARS]}… [cut at {TEXT_CHARS} characters]"
