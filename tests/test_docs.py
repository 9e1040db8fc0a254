"""The documentation site: it builds with zero warnings (nitpicky on the package's own names), its
API reference describes every public name, every ``ddp_notebook.x`` name written in the docs, the
README and the docstrings exists, and a real browser shows the built pages."""
import ast
import dataclasses
import html.parser
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ddp_notebook

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("DDP_NOTEBOOK_ARTIFACTS", ROOT / "artifacts"))
DOTTED = re.compile(r"(?<![\w./-])ddp_notebook(?:\.[A-Za-z_]\w*)+")
# The classes whose every public member must have an entry of its own in the reference.
CLASSES = (ddp_notebook.Run, ddp_notebook.WorkerContext, ddp_notebook.FitResult, ddp_notebook.WorkerFailure)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The site, built once for this module as ./scripts/docs.sh builds it (warnings as errors)."""
    out = tmp_path_factory.mktemp("docs")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-d", str(out / "doctrees"),
         str(DOCS), str(out / "html")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    return done, out / "html"


class _Entries(html.parser.HTMLParser):
    """Each ``<dt id=...>`` of the built reference and the text of the first paragraph of its
    ``<dd>`` (its description)."""

    def __init__(self):
        super().__init__()
        self.entries = {}
        self.depth = 0
        self.last_dt = None  # the id of the <dt> whose <dd> comes next
        self.open_dd = []  # (id, depth of its <dd>) of the <dd>s we are inside
        self.in_p = None  # (id, depth) of the first <p> being read

    def handle_starttag(self, tag, attrs):
        self.depth += 1
        attrs = dict(attrs)
        if tag == "dt" and attrs.get("id", "").startswith("ddp_notebook"):
            self.last_dt = attrs["id"]
            self.entries.setdefault(self.last_dt, "")
        elif tag == "dd" and self.last_dt is not None:
            self.open_dd.append((self.last_dt, self.depth))
            self.last_dt = None
        elif tag == "p" and self.open_dd and self.in_p is None:
            name, dd_depth = self.open_dd[-1]
            if self.depth == dd_depth + 1 and not self.entries[name]:
                self.in_p = (name, self.depth)

    def handle_endtag(self, tag):
        if self.in_p is not None and tag == "p" and self.depth == self.in_p[1]:
            name = self.in_p[0]
            if self.entries[name].strip().startswith("Bases:"):  # autodoc's line, not a description
                self.entries[name] = ""
            self.in_p = None
        if tag == "dd" and self.open_dd and self.open_dd[-1][1] == self.depth:
            self.open_dd.pop()
        self.depth -= 1

    def handle_startendtag(self, tag, attrs):
        pass  # <br/>, <img/>: no depth

    def handle_data(self, data):
        if self.in_p is not None:
            self.entries[self.in_p[0]] += data


def _entries(html_dir):
    found = {}
    for page in (html_dir / "api").glob("*.html"):
        parser = _Entries()
        parser.feed(page.read_text(encoding="utf-8"))
        found.update({name: " ".join(text.split()) for name, text in parser.entries.items()})
    return found


def _instance_attributes(cls):
    """The public attributes ``cls.__init__`` sets (``self.x = ...``)."""
    tree = ast.parse(inspect.getsource(cls.__init__).strip().replace("\n    ", "\n"))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            and not t.attr.startswith("_")}


def public_members(cls):
    names = {name for name, _ in inspect.getmembers(cls) if not name.startswith("_")}
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    elif "__init__" in vars(cls):
        names |= _instance_attributes(cls)
    return sorted(names)


def test_public_members_are_found():
    """The list the reference is checked against holds what users reach for (it can fail)."""
    assert {"wait", "retry", "load", "status", "id", "devices", "workers"} <= set(public_members(ddp_notebook.Run))
    assert {"rank", "device", "loader", "batches", "log", "epochs"} <= set(public_members(ddp_notebook.WorkerContext))
    assert {"model", "history", "ranks_in_sync", "run"} <= set(public_members(ddp_notebook.FitResult))
    assert {"rank", "kind", "message", "headline"} <= set(public_members(ddp_notebook.WorkerFailure))


@pytest.mark.processes
def test_the_site_builds_without_a_warning(built):
    done, html_dir = built
    assert done.returncode == 0, f"sphinx-build -W failed:\n{done.stdout}\n{done.stderr}"
    assert not done.stderr.strip(), f"warnings:\n{done.stderr}"
    for page in ("index", "getting-started", "api/running", "api/worker", "tutorials/02_when_a_worker_fails",
                 "benchmarks", "architecture", "reliability", "changelog"):
        assert (html_dir / f"{page}.html").is_file(), page
    # A tutorial's panel shows as its HTML form (the card, the rows in words), as its text says:
    # the tutorials keep no widget state, so a widget view would show nothing.
    failing = (html_dir / "tutorials/02_when_a_worker_fails.html").read_text()
    assert 'class="ddp-failure"' in failing and "ValueError: boom at step 5" in failing


@pytest.mark.processes
def test_every_public_name_has_a_described_entry(built):
    done, html_dir = built
    assert done.returncode == 0, done.stderr
    entries = _entries(html_dir)
    missing, empty = [], []
    expected = [name for name in ddp_notebook.__all__]
    for name in expected:
        homes = [f"ddp_notebook.{name}", f"ddp_notebook.errors.{name}"]
        found = [h for h in homes if h in entries]
        (missing if not found else empty if not any(entries[h] for h in found) else []).append(name)
    for cls in CLASSES:
        for member in public_members(cls):
            key = f"ddp_notebook.{cls.__name__}.{member}"
            (missing if key not in entries else empty if not entries[key] else []).append(key)
    for name, obj in vars(ddp_notebook.errors).items():
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__.startswith("ddp_notebook"):
            key = f"ddp_notebook.errors.{name}"
            (missing if key not in entries else empty if not entries[key] else []).append(key)
    assert not missing, f"no entry in the API reference: {missing}"
    assert not empty, f"an entry without a description: {empty}"


def _docstrings(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc
        # attribute docstrings (a string under a field) and #: comments are documentation too
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.value.value
    yield from (line for line in path.read_text(encoding="utf-8").splitlines() if line.strip().startswith("#:"))


def _texts():
    for page in sorted(DOCS.rglob("*.md")):
        if "_build" not in page.parts:
            yield page.relative_to(ROOT), page.read_text(encoding="utf-8")
    yield Path("README.md"), (ROOT / "README.md").read_text(encoding="utf-8")
    for source in sorted((ROOT / "ddp_notebook").rglob("*.py")):
        for doc in _docstrings(source):
            yield source.relative_to(ROOT), doc


def resolves(dotted):
    """Whether ``ddp_notebook.a.b.c`` names a module, or an attribute along the path of one."""
    try:  # a module is found without being run (importing the Lightning integration takes 3 s)
        if importlib.util.find_spec(dotted) is not None:
            return True
    except ModuleNotFoundError:  # a name along the path is no package: an attribute, looked up below
        pass
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # a name moved, still found
                for part in parts[cut:]:
                    # a dataclass's field with a default factory is no class attribute, but a name all the same
                    fields = getattr(obj, "__dataclass_fields__", {})
                    obj = fields[part] if part in fields and not hasattr(obj, part) else getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def test_resolves_tells_names_apart():
    assert resolves("ddp_notebook.launch") and resolves("ddp_notebook.errors.WorkerFailedError")
    assert resolves("ddp_notebook.Run.retry") and resolves("ddp_notebook.executors.local.forkserver.status")
    assert not resolves("ddp_notebook.training") and not resolves("ddp_notebook.probes")
    assert not resolves("ddp_notebook.Run.no_such_method")
    assert resolves("ddp_notebook.WorkerFailure.locals") and not resolves("ddp_notebook.WorkerFailure.globals")
    assert resolves("ddp_notebook.integrations.lightning") and not resolves("ddp_notebook.integrations.keras")
    assert not resolves("ddp_notebook.lifecycle.launch.no_such_name")


def test_every_dotted_name_in_the_docs_and_docstrings_exists():
    wrong = {}
    for where, text in _texts():
        for name in set(DOTTED.findall(text)):
            if not resolves(name):
                wrong.setdefault(name, set()).add(str(where))
    assert not wrong, "names that do not exist:\n" + "\n".join(f"  {n}: {sorted(w)}" for n, w in sorted(wrong.items()))


@pytest.mark.browser
def test_a_browser_shows_the_index_and_an_api_page(built):
    if not os.path.exists(CHROMIUM):
        pytest.skip("no /usr/bin/chromium here (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    done, html_dir = built
    assert done.returncode == 0, done.stderr
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto((html_dir / "index.html").as_uri())
            assert page.locator("h1").first.inner_text().strip().startswith("ddp_notebook")
            assert page.locator("nav").get_by_text("API reference").first.is_visible()
            page.screenshot(path=str(ARTIFACTS / "docs-index.png"), full_page=False)

            page.goto((html_dir / "api" / "running.html").as_uri() + "#ddp_notebook.launch")
            entry = page.locator("dt#ddp_notebook\\.launch")
            assert entry.is_visible() and "launch" in entry.inner_text()
            body = page.locator("dt#ddp_notebook\\.launch + dd").inner_text()
            assert "Parameters" in body and "Returns" in body and "Raises" in body
            page.screenshot(path=str(ARTIFACTS / "docs-api-launch.png"), full_page=False)
        finally:
            browser.close()
