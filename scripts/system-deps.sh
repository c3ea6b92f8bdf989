#!/usr/bin/env bash
# Install the Debian packages listed in requirements/apt.txt that are missing. Idempotent.
# As root it installs them; otherwise it prints the apt-get line to run and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t pkgs < <(grep -vE '^\s*(#|$)' requirements/apt.txt)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing Debian packages: ${missing[*]} (run: sudo apt-get install -y ${missing[*]})" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "installed: ${missing[*]}"
