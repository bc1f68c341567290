#!/usr/bin/env bash
# Rebuild benchmarks/gpu/flashinfer/site: the flashinfer_python 0.7.4 wheel pruned to the MLA paged
# decode path (manifest_py.txt, manifest_data.txt), its stub __init__, and the runtime deps.
#   FI_SRC:  the wheel unzipped (default /tmp/fi/x; `unzip flashinfer_python-0.7.4-py3-none-any.whl`)
#   FI_DEPS: wheels from `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`:
#            apache-tvm-ffi (cp312), nvidia-ml-py, tqdm, requests, urllib3, idna, certifi,
#            charset-normalizer (py3-none-any), packaging, einops, tabulate, click
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=${FI_SRC:-/tmp/fi/x}
DEPS=${FI_DEPS:-/tmp/fi/deps}
SITE=$HERE/site
rm -rf "$SITE"
mkdir -p "$SITE"
(cd "$SRC" && cat "$HERE/manifest_py.txt" "$HERE/manifest_data.txt" | xargs cp --parents -t "$SITE")
cp "$HERE/stub_init.py" "$SITE/flashinfer/__init__.py"
for w in "$DEPS"/*.whl; do unzip -q -o "$w" -d "$SITE"; done
# The same tvm_ffi's cp311 extension too (FI_DEPS311: its cp311 wheel), so the bundle also imports
# on the CPU dev machine's Python 3.11; the two wheels differ only in this file.
for w in "${FI_DEPS311:-/tmp/fi/deps311}"/apache_tvm_ffi-*.whl; do
  unzip -q -o "$w" 'tvm_ffi/core.cpython-*' -d "$SITE"
done
# tvm_ffi: keep the extension, libtvm_ffi.so, headers (include/ has dlpack too) and Python;
# drop the C++ sources, cython sources and vendored 3rdparty sources (core.so links
# lib/libtvm_ffi_testing.so: keep it).
rm -rf "$SITE"/tvm_ffi/{src,cython,3rdparty}
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$SITE"
