"""Front ends: they render a run's state and call the Python API, nothing more.

Owns: the text view (``text``) and HTML (``html``) of a run, a validation report and a failure
card, as plain strings; the live widget views (``run_view``: one run; ``panel``: device picker,
Validate, Launch, and a run with its retries); what shows where (``display``: the panel in a
notebook, text elsewhere, registered as the display of a ``Run``); and the ``%ddp_*`` magics
with the extension's load and unload (``magics``).

May import: ``ddp_notebook.recipes``, ``ddp_notebook.lifecycle`` and ``ddp_notebook.core``;
IPython and ipywidgets. Nothing below imports a front end.
"""
