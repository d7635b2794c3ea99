"""Shared fixture for the tests of ``benchmarks/*.py``: a script loaded as a module by its file name."""

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def load_benchmark() -> Iterator[Callable[[str], ModuleType]]:
    """A function NAME -> ``benchmarks/NAME.py`` as module NAME, loaded once per session.

    While loaded the module is in ``sys.modules`` (a dataclass looks its module up there) and ``benchmarks/`` is on
    ``sys.path`` while it executes (a script imports its siblings, as when run as a script); both are undone at the end.
    """
    loaded: dict[str, ModuleType] = {}

    def load(name: str) -> ModuleType:
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            sys.path.insert(0, str(BENCHMARKS))
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name)
                raise
            finally:
                sys.path.remove(str(BENCHMARKS))
            loaded[name] = module
        return loaded[name]

    yield load
    for name in loaded:
        sys.modules.pop(name, None)
