#!/usr/bin/env bash
# Builds the chart tools the tests use, from the versions pinned in e2e/tools/go.mod:
# helm (lint, template, install) and kubeconform (schema checks of rendered manifests),
# into $FLAMEFLEET_CACHE/bin/<name>-<version> (skipped when cached).
#
#   scripts/tools.sh build
#   scripts/tools.sh paths    HELM=... KUBECONFORM=...
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
BIN="$FLAMEFLEET_CACHE/bin"
GOMOD="$REPO/e2e/tools/go.mod"
version() { awk -v m="$1" '($1 == m && $2 ~ /^v/) {print $2; exit} ($1 == "require" && $2 == m) {print $3; exit}' "$GOMOD"; }
HELM_VERSION="$(version helm.sh/helm/v3)"
KUBECONFORM_VERSION="$(version github.com/yannh/kubeconform)"
HELM="$BIN/helm-$HELM_VERSION"
KUBECONFORM="$BIN/kubeconform-$KUBECONFORM_VERSION"

cmd_build() {
  command -v go >/dev/null || { echo "tools.sh: Go is required; run scripts/setup.sh" >&2; exit 1; }
  mkdir -p "$BIN"
  cd "$REPO/e2e/tools"
  if [[ -x "$HELM" ]] && "$HELM" version --short 2>/dev/null | grep -q "$HELM_VERSION"; then
    echo "helm $HELM_VERSION: cached"
  else
    local t0=$SECONDS
    go build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
      -o "$HELM.tmp" helm.sh/helm/v3/cmd/helm
    mv "$HELM.tmp" "$HELM"
    echo "built helm $HELM_VERSION in $((SECONDS - t0))s"
  fi
  if [[ -x "$KUBECONFORM" ]]; then
    echo "kubeconform $KUBECONFORM_VERSION: cached"
  else
    local t0=$SECONDS
    go build -trimpath -ldflags "-s -w" -o "$KUBECONFORM.tmp" github.com/yannh/kubeconform/cmd/kubeconform
    mv "$KUBECONFORM.tmp" "$KUBECONFORM"
    echo "built kubeconform $KUBECONFORM_VERSION in $((SECONDS - t0))s"
  fi
}

case "${1:-}" in
  build) cmd_build ;;
  paths) printf 'HELM=%s\nKUBECONFORM=%s\n' "$HELM" "$KUBECONFORM" ;;
  *) sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
