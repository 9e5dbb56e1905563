#!/usr/bin/env bash
# Installs the system packages the code sandbox needs (kimi_jax/sandbox).
# Idempotent: does nothing when everything is already present, and only
# refreshes the apt index when a package is actually missing.
set -euo pipefail

# bubblewrap: namespace isolation for untrusted programs.
# g++ / nodejs: the C++ and JavaScript runtimes the sandbox executes.
# python3 (Debian's /usr/bin/python3): a system interpreter outside /root.
PACKAGES=(bubblewrap g++ nodejs python3)
# Tools whose presence means the package is effectively installed, even if it
# came from somewhere other than apt (e.g. a node from NodeSource).
declare -A PROVIDES=([bubblewrap]=bwrap [g++]=g++ [nodejs]=node [python3]=/usr/bin/python3)

missing=()
for pkg in "${PACKAGES[@]}"; do
  tool="${PROVIDES[$pkg]}"
  if [[ "$tool" == /* ]]; then
    [[ -x "$tool" ]] && continue
  elif command -v "$tool" >/dev/null 2>&1; then
    continue
  fi
  missing+=("$pkg")
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install_system_deps: all present (${PACKAGES[*]})"
  exit 0
fi

SUDO=""
if [[ "$(id -u)" -ne 0 ]]; then
  SUDO="sudo"
fi
echo "install_system_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
command -v bwrap >/dev/null && bwrap --version
