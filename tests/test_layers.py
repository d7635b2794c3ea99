"""The import contracts in pyproject.toml ([tool.importlinter]): one-way layers, no ROS in the runtime,
KV caches independent of the models, the shared Prismatic VLM independent of its families. ``lint-imports`` checks them; this test runs it on the source tree."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")


def lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_every_import_contract_holds():
    out = lint()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout, out.stdout


def test_a_broken_layer_is_reported(tmp_path):
    # the same analysis with the layers upside down must fail, naming an import that breaks them
    config = tmp_path / "contracts.ini"
    config.write_text(
        "[importlinter]\nroot_packages =\n    vla_runtime\nexclude_type_checking_imports = True\n\n"
        "[importlinter:contract:upside-down]\nname = kv above models\ntype = layers\nlayers =\n"
        "    vla_runtime.kv\n    vla_runtime.models\n"
    )
    out = lint("--config", str(config))
    assert out.returncode == 1, out.stdout
    assert "vla_runtime.models is not allowed to import vla_runtime.kv" in " ".join(out.stdout.split()), out.stdout


def test_a_fresh_process_knows_every_family_without_importing_model_code():
    code = (
        "import sys\nfrom vla_runtime.api import detect_family\n"
        "try:\n    detect_family(sys.argv[1])\nexcept ValueError as e:\n    print(e)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('vla_runtime.models.', 'vla_runtime.policies.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "tests")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    message, modules = out.stdout.strip().splitlines()
    assert message.endswith("known families: cogact, hybridvla, openvla, openvla-oft"), message
    # asking every family imports the detectors' small modules, no policy or modelling code
    imported = ast.literal_eval(modules)
    assert not [m for m in imported if "policies." in m and not m.endswith((".base", ".registry"))], imported
    assert not [m for m in imported if "modeling" in m], imported
