#!/usr/bin/env bash
# Idempotent set-up: Debian packages the project needs, a .venv in the repo with raycomp
# installed (editable) plus dev tools. Fast when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES=(dataset-fashion-mnist prometheus bible-kjv bible-kjv-text iproute2)
missing=()
for pkg in "${DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup: installing Debian packages: ${missing[*]}"
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || { echo "setup: need root or sudo to install ${missing[*]}" >&2; exit 1; }
        SUDO="sudo"
    fi
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PYTHON" -m venv .venv
fi
# This venv runs the torch the suite is run with in CI (the CPU build of 2.13.0, a local file
# on this kind of machine): pyproject's range admits newer ones, which a fresh venv would
# otherwise take (a CUDA build of several GB). The versions tested: docs/testing.md.
TORCH_PIN="torch==2.13.0"
stamp=.venv/.raycomp-installed
want=$( (cat pyproject.toml; echo "$TORCH_PIN") | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing raycomp and its dependencies into .venv"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q "$TORCH_PIN" -e ".[dev]"
    echo "$want" > "$stamp"
fi
