"""Import a script of scripts/ or a benchmark of benchmarks/ as a module, the way ``python PATH`` runs
it: its own folder on sys.path (the benchmarks import their neighbour timing.py)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
BENCHMARKS = REPO / "benchmarks"


def _load(folder: Path, name: str) -> ModuleType:
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while a class is built
        try:
            spec.loader.exec_module(module)
        finally:
            del sys.modules[name]
    finally:
        sys.path.remove(str(folder))
    return module


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py."""
    return _load(SCRIPTS, name)


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py."""
    return _load(BENCHMARKS, name)
