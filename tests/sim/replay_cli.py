"""``vla-runtime`` with the test-replay policy family registered, for tests that run the CLI as a subprocess.

    python tests/sim/replay_cli.py eval --checkpoint DEMOS ...   (DEMOS: a collect dataset holding a file REPLAY)
"""

import sys
from pathlib import Path

from vla_runtime import api
from vla_runtime.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from replay_policy import make_replay_policy  # noqa: E402


def _load(path: Path, **kwargs) -> api.Policy:
    return make_replay_policy(path)


if __name__ == "__main__":
    api.register_family("test-replay", lambda p: (Path(p) / "REPLAY").exists(), _load)
    sys.exit(main(sys.argv[1:]))
