# The pruned FlashInfer bundle's environment, on the GPU machine, from the repo root. Either
#   . benchmarks/gpu/flashinfer/setup.sh                        (then run anything), or
#   bash benchmarks/gpu/flashinfer/setup.sh python benchmarks/gpu/flashinfer_mla.py --out $OUT/fi.json
# Puts site/ (flashinfer + tvm_ffi + pure-Python deps) first on PYTHONPATH and points FlashInfer's
# JIT (nvcc + ninja, sm_90a only) at a workspace under /tmp. See README.md.

FI_BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -d "$FI_BUNDLE/site/flashinfer" ]; then
  echo "setup.sh: no $FI_BUNDLE/site/flashinfer (build it: benchmarks/gpu/flashinfer/build_bundle.sh)" >&2
fi
export PYTHONPATH="$FI_BUNDLE/site${PYTHONPATH:+:$PYTHONPATH}"
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws # JIT: $it/.cache/flashinfer/0.7.4/90a/
export TVM_FFI_CACHE_DIR=/tmp/flashinfer-ws/tvm-ffi # used only if torch lacks the DLPack C API
export FLASHINFER_CUDA_ARCH_LIST="9.0"              # read by compilation_context.py: -> sm_90a only
export MAX_JOBS=16                                   # ninja -j (cpp_ext.run_ninja)
export FLASHINFER_NVCC_THREADS=4                     # nvcc --threads (cpp_ext)
mkdir -p "$FLASHINFER_WORKSPACE_BASE"

# nvcc: FlashInfer takes CUDA_HOME, else dirname(dirname(which nvcc)). On a machine whose nvcc is a
# wrapper script (/usr/local/bin/nvcc: exec /usr/local/cuda-13.0/bin/nvcc) that gives /usr/local,
# whose lib64 has no libcudart: ask nvcc for its real root (the TOP of its profile) instead.
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc > /dev/null; then
  CUDA_HOME="$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 |
    sed -n 's/^#\$ TOP=\(.*\)\/bin\/\.\.$/\1/p' | head -n 1)"
  [ -z "$CUDA_HOME" ] && CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
  export CUDA_HOME
fi
# ninja: the executable must be on PATH (subprocess "ninja"); the pip package keeps it in BIN_DIR.
if ! command -v ninja > /dev/null; then
  NINJA_BIN="$(${PYTHON:-python3} -c 'import ninja; print(ninja.BIN_DIR)' 2> /dev/null)"
  [ -n "$NINJA_BIN" ] && export PATH="$NINJA_BIN:$PATH"
fi
# The link step is `c++ ... -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda`. A CUDA
# assembled from pip wheels may lack lib64/libcudart.so and has no stubs/libcuda.so: give the
# linker a directory with both (the driver's libcuda.so.1, else a stub with that soname).
FI_LIB="$FLASHINFER_WORKSPACE_BASE/lib"
if [ -n "${CUDA_HOME:-}" ] && [ ! -e "$CUDA_HOME/lib64/libcudart.so" ]; then
  mkdir -p "$FI_LIB"
  CUDART="$(ls "$CUDA_HOME"/lib*/libcudart.so* 2> /dev/null | head -n 1)"
  [ -n "$CUDART" ] && ln -sf "$CUDART" "$FI_LIB/libcudart.so"
  export FLASHINFER_EXTRA_LDFLAGS="-L$FI_LIB"
fi
if [ -n "${CUDA_HOME:-}" ] && [ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then
  mkdir -p "$FI_LIB"
  LIBCUDA="$(ldconfig -p 2> /dev/null | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')"
  for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/lib/wsl/lib; do
    [ -z "$LIBCUDA" ] && [ -e "$d/libcuda.so.1" ] && LIBCUDA="$d/libcuda.so.1"
  done
  if [ -n "$LIBCUDA" ]; then
    ln -sf "$LIBCUDA" "$FI_LIB/libcuda.so"
  else  # link-time only: the module then needs libcuda.so.1, which torch has loaded
    echo 'void fi_stub(void) {}' | cc -shared -fPIC -x c - -Wl,-soname,libcuda.so.1 \
      -o "$FI_LIB/libcuda.so"
  fi
  export FLASHINFER_EXTRA_LDFLAGS="-L$FI_LIB"
fi

{
  echo "setup.sh: CUDA_HOME=${CUDA_HOME:-unset} nvcc=$(command -v nvcc || echo missing)" \
    "ninja=$(command -v ninja || echo missing) c++=$(command -v c++ || echo missing)" \
    "extra_ldflags=${FLASHINFER_EXTRA_LDFLAGS:-none}"
  [ -n "${CUDA_HOME:-}" ] && "$CUDA_HOME/bin/nvcc" --version | tail -n 2 | head -n 1
} >&2

if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "$#" -gt 0 ]; then
  exec "$@"
fi
