//go:build tools

// Package tools pins the command-line tools the tests and scripts build from source:
// helm (chart lint and template) and kubeconform (schema checks of rendered manifests).
// Built by scripts/tools.sh into $FLAMEFLEET_CACHE/bin; kept apart from
// e2e/controlplane/go.mod so the two dependency graphs never constrain each other.
package tools

import (
	_ "github.com/yannh/kubeconform/cmd/kubeconform"
	_ "helm.sh/helm/v3/cmd/helm"
)
