"""Sphinx configuration of ddp_notebook's documentation (``./scripts/docs.sh`` builds it).

Built offline, warnings as errors, nitpicky on this package's own names: a renamed function or
a broken cross-reference fails the build (tests/test_docs.py runs it).
"""
from __future__ import annotations

import importlib
import os
import sys
import textwrap
from typing import Any

from docutils import nodes
from sphinx.util.docutils import SphinxDirective

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's package, whatever is installed

import ddp_notebook  # noqa: E402

project = "ddp_notebook"
author = "ddp_notebook contributors"
copyright = "ddp_notebook contributors"
release = ddp_notebook.__version__
version = release

extensions = [
    "myst_nb",  # Markdown pages and the stored tutorials
    "sphinx.ext.autodoc",
    "numpydoc",  # the package's docstrings are numpydoc style
]
# No intersphinx: the build runs offline, and an inventory it cannot fetch is a warning.

exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}
root_doc = "index"

# The tutorials keep their stored outputs: nbval runs them in the test suite, the docs never do.
nb_execution_mode = "off"
# The tutorials keep no widget state: a page shows a panel's HTML form (what a notebook viewer
# shows), not an empty widget view.
nb_mime_priority_overrides = [(builder, "application/vnd.jupyter.widget-view+json", None)
                              for builder in ("html", "dirhtml", "singlehtml")]
nb_render_markdown_format = "myst"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: signatures with their type hints; members in the order of the source.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# ``core.errors`` names the report it holds by a protocol (errors must not import validation,
# which raises them): the signature names what it is.
autodoc_type_aliases = {"Report": "ddp_notebook.ValidationReport"}
autodoc_inherit_docstrings = False  # a framework base class's docstring is not ours to render
autodoc_default_options = {"members": True, "show-inheritance": True}
autoclass_content = "class"

# numpydoc renders Parameters / Returns / Raises; members are listed by autodoc itself.
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = False
numpydoc_xref_param_type = False

# Nitpicky on this package's own names (a broken reference to one of them fails the build);
# third-party and standard-library names in signatures (torch.nn.Module, typing.Optional,
# ipyparallel.Client...) are not documented here and are not checked.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!ddp_notebook\b).*")]
# The package's own internals that a signature shows but users never make or hold: the parts
# ``Run``'s constructor is built from (users get runs from launch/fit/spawn or Run.load), the
# ``**options`` typing and the enum base class.
nitpick_ignore = [("py:class", f"ddp_notebook.{name}") for name in (
    "core.rundir.RunDir", "core.stream.EventStream", "executors.base.Executor", "lifecycle.options.RunSettings",
    "lifecycle.options.LaunchKwargs", "core._text.TextEnum", "core.console.ConsoleLines")]

html_theme = "pydata_sphinx_theme"
html_title = f"ddp_notebook {release}"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
# Pages without sub-pages would show an empty navigation column: none on them.
html_sidebars = {"**": ["sidebar-nav-bs"],
                 **{page: [] for page in ("index", "getting-started", "benchmarks", "architecture", "reliability",
                                          "changelog")}}
html_copy_source = False


def _public_targets(target: str) -> list[str]:
    """Where users import the object ``target`` names from, when that is not where it is defined:
    type hints name ``ddp_notebook.lifecycle.run.Run``, the reference documents ``ddp_notebook.Run``
    (and the exceptions as ``ddp_notebook.errors.X``)."""
    if not target.startswith("ddp_notebook."):
        return []
    module_path, _, name = target.rpartition(".")
    try:
        defined = getattr(importlib.import_module(module_path), name)
    except (ImportError, AttributeError):
        return []
    homes = ("ddp_notebook.errors", "ddp_notebook")
    return [f"{home}.{name}" for home in homes if getattr(importlib.import_module(home), name, None) is defined]


def _resolve_to_public(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    for public in _public_targets(node.get("reftarget", "")):
        for role in ("class", "exc", "func", "obj"):
            found = domain.resolve_xref(env, node.get("refdoc", ""), app.builder, role, public, node, contnode)
            if found is not None:
                return found
    return None


class MagicsDirective(SphinxDirective):
    """``ddp-magics``: each ``%ddp_*`` magic's usage, read from the magic itself (as ``%ddp_fit?``
    shows it), so the page cannot drift from the code."""

    def run(self) -> list[nodes.Node]:
        from ddp_notebook.ui.magics import DDPMagics

        found: list[nodes.Node] = []
        for name in sorted(DDPMagics.magics["line"]):
            usage = textwrap.dedent((getattr(DDPMagics, name).__doc__ or "").replace("::\n", "", 1)).strip()
            found.append(nodes.rubric(text=f"%{name}"))
            found.append(nodes.literal_block(usage, usage))
        return found


def setup(app: Any) -> None:
    app.connect("missing-reference", _resolve_to_public)
    app.add_directive("ddp-magics", MagicsDirective)
