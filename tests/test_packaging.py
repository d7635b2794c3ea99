"""Every package directory is shipped by pyproject.toml (explicit list because of the kernels/vla_kernels/ -> vla_kernels map)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIRS = {"vla_runtime": "vla_runtime", "kernels/vla_kernels": "vla_kernels", "finetune": "vla_finetune"}


def test_every_package_directory_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for directory, name in DIRS.items():
        for init in (ROOT / directory).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / directory)
            found.add(".".join((name, *rel.parts)))
    assert found - listed == set(), f"add to pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed but missing on disk: {sorted(listed - found)}"


def test_the_root_holds_no_package_named_like_a_dependency():
    """With the repository root on sys.path (``python -m pytest``, ``python -m ...`` from the root) every folder there
    with an ``__init__.py`` is importable under its folder name. ``kernels`` is Hugging Face's package, which
    transformers >= 5.25 requires and imports: a ``kernels/__init__.py`` would answer that import and break every
    transformers model import. Only folders whose names are ours may be packages."""
    packages = {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file()}
    assert packages <= {"vla_runtime", "finetune"}, f"root folders importable under a name that is not ours: {packages}"
