"""Which benchmarks ``vla-runtime bench NAME`` can run, and running one.

Two kinds:

- built in: modules of this package (``BUILTIN``), installed with it, so they run from a wheel too;
- scripts: every ``bench_<name>.py`` in a source checkout's ``benchmarks/`` folder (not a package, not
  installed), loaded by path. A script runs as ``python benchmarks/bench_<name>.py`` would run it: its folder
  comes first on ``sys.path`` while it runs (scripts import their neighbours), and ``main(argv)`` is called.

A name of both kinds is the built-in one (``benchmarks/bench_kv.py`` only forwards to ``vla_runtime.bench.kv``).
A benchmark's one-line description is the first paragraph of its module docstring, read without importing it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

# benchmark name -> module (in this package) with main(argv) -> int
BUILTIN: dict[str, str] = {
    "kv": "vla_runtime.bench.kv",
}
SCRIPT_PREFIX = "bench_"


def default_dir() -> Path:
    """``benchmarks/`` beside this package in a source checkout (absent where the package came from a wheel)."""
    return Path(__file__).resolve().parents[2] / "benchmarks"


def summary(path: Path) -> str:
    """The first paragraph of the module docstring of ``path``, on one line, without its ``code`` quotes."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "")


@dataclass(frozen=True)
class Benchmark:
    """One runnable benchmark: ``source`` is its file; ``module`` its import name when it is built in."""

    name: str
    source: Path
    module: str | None = None

    @property
    def summary(self) -> str:
        return summary(self.source)

    def run(self, argv: list[str]) -> int:
        """Call the benchmark's ``main(argv)``; returns its exit status."""
        if self.module is not None:
            return int(importlib.import_module(self.module).main(argv) or 0)
        folder = str(self.source.parent)
        sys.path.insert(0, folder)
        try:
            return int(self.load_script().main(argv) or 0)
        finally:
            sys.path.remove(folder)

    def load_script(self) -> ModuleType:
        """The benchmark file imported as a module (its functions, for tests and notebooks)."""
        spec = importlib.util.spec_from_file_location(self.source.stem, self.source)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
        return module


def find_benchmarks(folder: Path | None = None) -> dict[str, Benchmark]:
    """Built-in benchmarks and the ``bench_*.py`` scripts in ``folder`` (default ``default_dir()``; a missing
    folder adds none), by name, sorted."""
    folder = default_dir() if folder is None else Path(folder)
    found = {}
    for path in sorted(folder.glob(f"{SCRIPT_PREFIX}*.py")) if folder.is_dir() else []:
        name = path.stem.removeprefix(SCRIPT_PREFIX)
        found[name] = Benchmark(name, path.resolve())
    for name, module in BUILTIN.items():
        spec = importlib.util.find_spec(module)
        found[name] = Benchmark(name, Path(spec.origin), module)
    return dict(sorted(found.items()))


def get_benchmark(name: str, folder: Path | None = None) -> Benchmark:
    """The benchmark called ``name``. Raises ``FileNotFoundError`` when it is not built in and there is no
    benchmarks folder (a wheel install), ``KeyError`` listing the known names otherwise."""
    folder = default_dir() if folder is None else Path(folder)
    found = find_benchmarks(folder)
    if name in found:
        return found[name]
    if not folder.is_dir():
        raise FileNotFoundError(
            f"benchmark {name!r} is a script in a source checkout's benchmarks/ folder, and there is none at {folder} "
            f"(an installed wheel ships only {', '.join(sorted(BUILTIN))}); run from a checkout or pass --dir"
        )
    raise KeyError(f"unknown benchmark {name!r}; available: {', '.join(found)}")
