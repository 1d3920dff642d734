#!/usr/bin/env bash
# The import contracts of DESIGN §2 (import-linter; contracts in pyproject.toml).
# The top-level folders are mapped into one import package, which import-linter
# cannot follow (nor links), so check a copy of the sources in that shape.
# JAXPOD_SOURCE_ROOT: check another tree of sources (the tests plant violations).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
root=${JAXPOD_SOURCE_ROOT:-$here}
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/jaxpod"
cp -r "$root"/jaxpod/. "$tree/jaxpod/"
for part in worker service client proto; do cp -r "$root/$part" "$tree/jaxpod/$part"; done
cd "$tree"
PYTHONPATH="$tree" "${LINT_IMPORTS:-lint-imports}" --config "$here/pyproject.toml" --no-cache
