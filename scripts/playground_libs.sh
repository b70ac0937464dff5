#!/usr/bin/env bash
# The playground's markdown renderer (marked) and HTML sanitizer (DOMPurify), fetched from npm at pinned versions
# and checked against their published integrity, into service/http/static/vendor (git-ignored, served by the app
# and packaged with it). Without them the playground shows replies as plain text.
set -euo pipefail
cd "$(dirname "$0")/.."
VENDOR=service/http/static/vendor
# name@version, npm's sha512 integrity, the browser build inside the package
LIBS=(
  "marked@18.3.0 sha512-ed8zmPXlBb3UfGXN5iHMQyMhFpdqLgoV5umUXx/Q1R+FW3q8VpqpyoKUwlENL9appo2UMvNLURDVaT3AMOryGA== lib/marked.umd.js"
  "dompurify@3.5.0 sha512-LYC0ZkE8P1V42JsRYTwMdme/2ET8SpOc5AA2eOFjP/IadvRd2fwiT4TVz5vkfy0XUx12aS2UaRkTnfVPNOv9vw== dist/purify.min.js"
)
if ! command -v npm >/dev/null; then
  echo "npm not found: the playground will show replies as plain text (install npm, then: make playground-libs)"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$VENDOR"
for lib in "${LIBS[@]}"; do
  read -r spec integrity file <<<"$lib"
  if ! tarball=$(cd "$work" && npm pack --silent "$spec"); then
    echo "npm could not fetch $spec (offline?): the playground will show replies as plain text" \
      "(later: make playground-libs)"
    exit 0
  fi
  actual="sha512-$(openssl dgst -sha512 -binary "$work/$tarball" | base64 -w0)"
  if [ "$actual" != "$integrity" ]; then
    echo "$spec: integrity $actual, expected $integrity" >&2
    exit 1
  fi
  tar -xzf "$work/$tarball" -C "$work" "package/$file" "package/LICENSE"
  cp "$work/package/$file" "$VENDOR/$(basename "$file")"
  cp "$work/package/LICENSE" "$VENDOR/LICENSE.${spec%@*}"
  echo "playground: $spec -> $VENDOR/$(basename "$file")"
done
