#!/usr/bin/env bash
# One-time setup so that `cargo build --features cuda` works on a machine that reaches the package
# registries but not the rest of the internet. Safe to run again; run as root (it may apt-get).
#
#   scripts/setup-cuda-build.sh
#
# Why: cubecl-cuda always depends on cubecl-llvm, whose build script (the tracel-llvm-bundler
# crate) downloads a prebuilt LLVM bundle from GitHub into
#   ${XDG_DATA_HOME:-~/.local/share}/tracel/tracel-llvm-<bundler version>/
# unless that folder already holds the file `.tracel-llvm-installed`. Where that download is
# blocked, the build fails. This script installs Debian's LLVM 22 instead and puts a small
# `llvm-config` in that folder that answers for it, then marks the folder installed, so the
# bundler builds against LLVM 22 without downloading anything.
#
# Builds without the `cuda` feature (CI, the CPU tests) need none of this.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

# 1. Debian's LLVM 22 with the libraries the bundler links (Polly, zstd, zlib).
packages=(llvm-22-dev libpolly-22-dev libzstd-dev zlib1g-dev)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq "${packages[@]}" >/dev/null
fi

# 2. The folder the bundler looks in: its version comes from Cargo.lock.
version=$(awk '/^name = "tracel-llvm-bundler"$/ {getline; gsub(/[^0-9.-]/, "", $0); print; exit}' "$root/Cargo.lock")
[ -n "$version" ] || { echo "tracel-llvm-bundler is not in Cargo.lock: nothing to set up" >&2; exit 0; }
prefix="${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-$version"
mkdir -p "$prefix/bin"

# 3. An llvm-config that forwards to LLVM 22's. Its one change: the system libraries leave out
#    libz3 (printed as a full path, which the bundler's parsing of library names mistakes) and
#    libxml2 (which nothing here uses).
cat >"$prefix/bin/llvm-config" <<'EOF'
#!/bin/sh
# Answers for the LLVM bundle tracel-llvm-bundler would download: Debian's LLVM 22
# (written by scripts/setup-cuda-build.sh).
real=/usr/lib/llvm-22/bin/llvm-config
case " $* " in
  *" --system-libs "*)
    "$real" "$@" | tr ' ' '\n' | grep -v -e libz3 -e '^-lxml2$' -e '^$' | tr '\n' ' ' | sed 's/ $//'
    echo ;;
  *) exec "$real" "$@" ;;
esac
EOF
chmod +x "$prefix/bin/llvm-config"

# 4. Mark it installed: the bundler then skips its download.
touch "$prefix/.tracel-llvm-installed"
echo "LLVM 22 answers for tracel-llvm $version at $prefix"
