#!/usr/bin/env bash
# Installs the build dependencies on Debian/Ubuntu when they are missing (meson, ninja, yaml-cpp,
# doctest, pkg-config); as root it uses apt-get, otherwise it names what to install and exits 1.
# The CUDA toolkit (nvcc 13, cuBLASLt) must already be in /usr/local/cuda.
set -euo pipefail
need=()
command -v meson >/dev/null 2>&1 || need+=(meson)
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
pkg-config --exists yaml-cpp 2>/dev/null || need+=(libyaml-cpp-dev)
[ -f /usr/include/doctest/doctest.h ] || [ -f /usr/local/include/doctest/doctest.h ] || need+=(doctest-dev)
if [ ${#need[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    echo "install_deps.sh: installing ${need[*]}"
    apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null || {
      echo "install_deps.sh: apt-get install ${need[*]} failed" >&2; exit 1; }
  else
    echo "install_deps.sh: missing ${need[*]}; install them (as root: apt-get install ${need[*]})" >&2
    exit 1
  fi
fi
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "install_deps.sh: nvcc not found; install the CUDA Toolkit 13 in /usr/local/cuda" >&2
  exit 1
fi
