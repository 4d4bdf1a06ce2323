#!/usr/bin/env bash
# mypy over the `joynexus` package, found from the repository root: the committed
# joynexus/ folder links the top-level folders (see pyproject.toml), so no
# generated tree is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/mypy -p joynexus "$@"
