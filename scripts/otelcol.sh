#!/usr/bin/env bash
# Builds the OpenTelemetry Collector the export tests send profiles to: the core Collector
# with the OTLP receiver and the contrib file exporter (e2e/otelcol/main.go), at the versions
# pinned in e2e/otelcol/go.mod, into $FLAMEFLEET_CACHE/bin/otelcol-<version> (skipped when
# cached). The tests find it through FLAMEFLEET_OTELCOL or that path.
#
#   scripts/otelcol.sh build
#   scripts/otelcol.sh path     prints the binary's path
# scripts/setup.sh runs the build (cold: about 2 to 5 minutes, most of it downloading 183
# modules through the module proxy; cached afterwards).
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
BIN="$FLAMEFLEET_CACHE/bin"
GOMOD="$REPO/e2e/otelcol/go.mod"
VERSION="$(awk '$1 == "go.opentelemetry.io/collector/otelcol" && $2 ~ /^v/ {print $2; exit}' "$GOMOD")"
[[ -n "$VERSION" ]] || die "cannot read the pinned go.opentelemetry.io/collector/otelcol version from $GOMOD"
# The source's hash is in the name too, so a change to main.go or go.mod rebuilds.
HASH="$(cat "$REPO/e2e/otelcol/main.go" "$GOMOD" | sha256sum | cut -c1-12)"
OTELCOL="$BIN/otelcol-$VERSION-$HASH"

cmd_build() {
  command -v go >/dev/null || die "Go is required to build the Collector; run scripts/setup.sh"
  if [[ -x "$OTELCOL" ]] && "$OTELCOL" --version 2>/dev/null | grep -q "${VERSION#v}"; then
    echo "otelcol $VERSION: cached at $OTELCOL"
    return
  fi
  mkdir -p "$BIN"
  local t0=$SECONDS
  (cd "$REPO/e2e/otelcol" && go build -trimpath -ldflags "-s -w" -o "$OTELCOL.tmp" .)
  mv "$OTELCOL.tmp" "$OTELCOL"
  echo "built otelcol $VERSION in $((SECONDS - t0))s at $OTELCOL"
}

case "${1:-}" in
  build) cmd_build ;;
  path) echo "$OTELCOL" ;;
  *) sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
