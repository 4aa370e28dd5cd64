"""A script of the repository (examples/, bench/) imported as a module by the tests that exercise it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """`relative` (e.g. "bench/showcase_best.py") as a module named after its file, registered in sys.modules
    (dataclasses in it resolve their module)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
