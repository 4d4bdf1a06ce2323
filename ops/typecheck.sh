#!/usr/bin/env bash
# mypy over the `joynexus` package. The import root maps onto top-level
# folders through setuptools' editable finder, which mypy cannot follow, so
# this builds the same tree from symlinks under .venv and checks that.
set -euo pipefail
cd "$(dirname "$0")/.."
root=.venv/typecheck/joynexus
rm -rf .venv/typecheck && mkdir -p "$root"
ln -s "$PWD/ops/_root/__init__.py" "$root/__init__.py"
for d in agents schemas broker sdk ops; do ln -s "$PWD/$d" "$root/$d"; done
MYPYPATH=.venv/typecheck exec .venv/bin/mypy -p joynexus "$@"
