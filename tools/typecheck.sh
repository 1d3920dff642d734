#!/usr/bin/env bash
# mypy over the jaxpod package, then over examples/ (programs users copy). The top-level folders are mapped into one import
# package (DESIGN §2), which mypy cannot follow, so check a tree of links in that shape.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/jaxpod"
for f in "$root"/jaxpod/*; do ln -s "$f" "$tree/jaxpod/"; done
for part in worker service client proto; do ln -s "$root/$part" "$tree/jaxpod/$part"; done
cd "$tree"
"${MYPY:-mypy}" --config-file "$root/pyproject.toml" -p jaxpod "$@"
"${MYPY:-mypy}" --config-file "$root/pyproject.toml" "$root/examples" "$@"
