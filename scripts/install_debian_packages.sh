#!/usr/bin/env bash
# Installs the Debian packages listed in scripts/debian-packages.txt that are missing. Needs apt-get and
# root; elsewhere it says what is missing and leaves the tests that need it to skip.
set -euo pipefail
list="$(dirname "$0")/debian-packages.txt"
missing=()
while read -r name _; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  dpkg-query -W -f='${Status}' "$name" 2>/dev/null | grep -q "install ok installed" || missing+=("$name")
done <"$list"
[[ ${#missing[@]} -eq 0 ]] && exit 0
if ! command -v apt-get >/dev/null || [[ $(id -u) -ne 0 ]]; then
  echo "not installed (tests that need them will skip): ${missing[*]}" >&2
  exit 0
fi
echo "installing Debian packages: ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
