#!/usr/bin/env bash
# Runs a bundled binary on the GPU machine (bundle.sh copies this file into .gpu/):
#
#   bash .gpu/run.sh NAME [ARGS...]
#
# Unpacks .gpu/NAME.xz once (again when the bundle is newer), sets what the binary needs to find
# CUDA and NCCL, turns NVLink multicast off, and runs NAME with ARGS.
set -u
here=$(cd "$(dirname "$0")" && pwd)
name=${1:?usage: run.sh NAME [ARGS...]}; shift
bin="$here/.bin"
mkdir -p "$bin"
unxz() {  # FILE.xz OUT: xz where installed, else Python's lzma
  if command -v xz >/dev/null; then xz -dc "$1" >"$2"
  else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"
  fi
}
if [ ! -x "$bin/$name" ] || [ "$here/$name.xz" -nt "$bin/$name" ]; then
  if ! unxz "$here/$name.xz" "$bin/$name.part"; then
    echo "run.sh: cannot unpack $here/$name.xz" >&2
    exit 127
  fi
  chmod +x "$bin/$name.part" && mv "$bin/$name.part" "$bin/$name"
fi
# NVLink multicast off: on shared hosts it can take every GPU of the machine out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# NVRTC finds the CUDA headers through CUDA_PATH.
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
# cudarc loads NCCL as `libnccl.so`; the system has only its soname, libnccl.so.2: give it the name.
shim="$here/.shim"
mkdir -p "$shim"
for nccl in /usr/lib/x86_64-linux-gnu/libnccl.so.2 "$CUDA_PATH"/lib64/libnccl.so.2; do
  [ -e "$nccl" ] && { ln -sf "$nccl" "$shim/libnccl.so"; break; }
done
export LD_LIBRARY_PATH="$shim:$CUDA_PATH/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$bin/$name" "$@"
