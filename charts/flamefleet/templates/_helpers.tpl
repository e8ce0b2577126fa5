{{/* Names: every object is <release fullname>-<component>. */}}
{{- define "flamefleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object. */}}
{{- define "flamefleet.labels" -}}
{{ include "flamefleet.podLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of pod templates, beside their selector labels (which carry the instance). */}}
{{- define "flamefleet.podLabels" -}}
app.kubernetes.io/part-of: flamefleet
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The operator finds agents by this exact label: keep it. */}}
{{- define "flamefleet.agentSelector" -}}
app.kubernetes.io/name: flamefleet-agent
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "flamefleet.operatorSelector" -}}
app.kubernetes.io/name: flamefleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "flamefleet.storeSelector" -}}
app.kubernetes.io/name: flamefleet-store
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "flamefleet.image" -}}
{{- $tag := .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- if .root.Values.image.registry -}}
{{- printf "%s/%s:%s" .root.Values.image.registry .name $tag -}}
{{- else -}}
{{- printf "%s:%s" .name $tag -}}
{{- end -}}
{{- end -}}

{{- define "flamefleet.agentServiceAccount" -}}
{{ include "flamefleet.fullname" . }}-agent
{{- end -}}

{{- define "flamefleet.storeUrl" -}}
{{- printf "%s://%s-store.%s.svc:%v/" (ternary "https" "http" (.Values.store.tls.enabled | default false)) (include "flamefleet.fullname" .) .Release.Namespace .Values.store.service.port -}}
{{- end -}}

{{/* Pod security context shared by the operator and the store: non-root, no privileges. */}}
{{- define "flamefleet.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end -}}
