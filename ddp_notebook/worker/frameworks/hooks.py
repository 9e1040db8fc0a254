"""Patch a framework's class the moment its module is loaded in a worker (or at once, when the
worker already has it): a finder at the front of ``sys.meta_path`` that wraps the loader of a
few named modules and patches each once it has run.

Example (what a worker does before it unpickles the call)::

    watch_imports()
    import lightning          # lightning.pytorch.Trainer now reports to the rank's context
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Optional

from . import launchers, lightning, steps, transformers
from .reporting import guarded

__all__ = ["PATCHES", "watch_imports"]

# The module that defines each class, and how it is patched.
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "lightning.pytorch.trainer.trainer": lightning.patch_trainer,
    "pytorch_lightning.trainer.trainer": lightning.patch_trainer,
    "lightning.fabric.fabric": steps.patch_fabric,
    "lightning_fabric.fabric": steps.patch_fabric,
    "transformers.trainer": transformers.patch_trainer,
    "accelerate.accelerator": steps.patch_accelerator,
    "accelerate.launchers": launchers.patch_notebook_launcher,
}


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, and the patch once the module has run."""

    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        guarded(self._patch, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename...: the module's own loader's
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]],
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


_finder = _Finder()


def watch_imports() -> None:
    """Patch the frameworks this worker has loaded, and those it loads from now on (their
    progress is reported unless the user turned it off)."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            guarded(patch, sys.modules[name])
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
