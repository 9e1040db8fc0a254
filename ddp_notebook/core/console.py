"""What a rank printed, as a terminal shows it: the panel's output tab and last-line column show
text, not the escape sequences and carriage returns of a progress bar or coloured log.

>>> shown("\\x1b[2KEpoch 1 \\x1b[35m━━━\\x1b[0m 10%\\rEpoch 1 \\x1b[35m━━━━━━\\x1b[0m 20%")
'Epoch 1 ━━━━━━ 20%'
>>> lines = ConsoleLines()
>>> lines.feed("stdout", "step 1/3\\r")
[('stdout', 'step 1/3', False)]
>>> lines.feed("stdout", "step 2/3\\r")  # written over the line before
[('stdout', 'step 2/3', True)]
>>> lines.feed("stdout", "step 3/3\\ndone\\n")
[('stdout', 'step 3/3', True), ('stdout', 'done', False)]
"""
from __future__ import annotations

import re

__all__ = ["shown", "one_line", "ConsoleLines"]

# CSI (colours, cursor moves, erase), OSC (titles, links) and the two-character escapes.
_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # what is left of control characters once escapes are gone
_OPEN_CHARS = 4096  # an unfinished line kept to be written over (a progress bar without a newline)


def shown(line: str) -> str:
    """One line as a terminal shows it: escape sequences removed, and the text after a carriage
    return written over the text before it."""
    text = _ESCAPE.sub("", line)
    if "\r" not in text:
        return text
    out = ""
    for part in text.split("\r"):
        out = part + out[len(part):]
    return out


def one_line(text: str) -> str:
    """A name or value from a run as one line of plain text, safe to print in a terminal: escape
    sequences removed (a worker must not clear the screen or retitle the window of the notebook's
    terminal), other control characters shown as ``?``.

    >>> one_line("\\x1b[2J\\x1b]0;title\\x07loss\\nx\\x08")
    'loss?x?'
    """
    return _CONTROL.sub("?", _ESCAPE.sub("", text))


class ConsoleLines:
    """Turns a rank's output, chunk by chunk, into the lines a terminal would show. A line not
    ended yet (a progress bar redrawn with ``\\r``) is shown, and replaced when more of it comes."""

    def __init__(self) -> None:
        # stream -> its unfinished line (from its last carriage return), and whether it is shown
        self._open: dict[str, tuple[str, bool]] = {}

    def feed(self, stream: str, text: str) -> list[tuple[str, str, bool]]:
        """``(stream, line, replaces)`` for each line of ``text``; ``replaces``: the line takes the
        place of this stream's unfinished line shown last."""
        before, was_shown = self._open.pop(stream, ("", False))
        parts = (before + text).split("\n")
        out = [(stream, shown(part.rstrip("\r")), i == 0 and was_shown) for i, part in enumerate(parts[:-1])]
        rest = parts[-1]
        if rest:
            # What a later chunk writes over: from the last carriage return (bounded).
            kept = (rest[rest.rfind("\r"):] if "\r" in rest else rest)[-_OPEN_CHARS:]
            line = shown(rest)
            if line:  # (an unfinished line of escape sequences only shows nothing yet)
                out.append((stream, line, not out and was_shown))
            self._open[stream] = (kept, bool(line) or (was_shown and not out))
        return out
