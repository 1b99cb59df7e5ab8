{{/* Chart name, overridable. */}}
{{- define "specula.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource-name prefix: <release>-<chart name>, or the release name when it already
contains the chart name; 63 characters at most (a DNS label).
*/}}
{{- define "specula.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of the operator's Deployment, ClusterRole/Role and bindings. */}}
{{- define "specula.operatorName" -}}
{{- printf "%s-operator" (include "specula.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* helm.sh/chart label value. */}}
{{- define "specula.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: stable across chart versions, because a Deployment's selector is
immutable; so no chart or app version here.
*/}}
{{- define "specula.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specula.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every object of the chart. */}}
{{- define "specula.labels" -}}
helm.sh/chart: {{ include "specula.chart" . }}
{{ include "specula.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specula
{{- end }}

{{/* Selector labels of the operator pod. */}}
{{- define "specula.operatorSelectorLabels" -}}
{{ include "specula.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
The operator pod's selector labels as `k=v,k=v` (SPECULA_OPERATOR_POD_LABELS): the peer
the runtime pods' NetworkPolicies admit to their admin and metrics ports.
*/}}
{{- define "specula.operatorSelectorString" -}}
{{- $pairs := list }}
{{- range $k, $v := (include "specula.operatorSelectorLabels" . | fromYaml) }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* Labels of the operator's objects. */}}
{{- define "specula.operatorLabels" -}}
{{ include "specula.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Labels the operator puts on every runtime Service and pod it creates
(specula/operator/builders.py: labels()); monitors select on them.  Not the chart's
labels: runtime objects belong to their SpeculativeModel, not to this release.
*/}}
{{- define "specula.runtimeSelectorLabels" -}}
app.kubernetes.io/name: specula
app.kubernetes.io/component: runtime
app.kubernetes.io/managed-by: specula-operator
{{- end }}

{{/* Namespace selector of the monitors: the watched namespaces, or all. */}}
{{- define "specula.monitorNamespaceSelector" -}}
{{- if .Values.watchNamespaces -}}
matchNames:
{{- range .Values.watchNamespaces }}
  - {{ . | quote }}
{{- end }}
{{- else -}}
any: true
{{- end }}
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "specula.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specula.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Operator image reference. */}}
{{- define "specula.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{/* Default runtime image reference, handed to the operator. */}}
{{- define "specula.runtimeImage" -}}
{{- printf "%s:%s" .Values.runtime.image.repository (default .Chart.AppVersion .Values.runtime.image.tag) }}
{{- end }}

{{/*
API access of the operator within the namespaces it watches: exactly the calls of
specula/operator (kube.py, kopf's watches and patches) and nothing more.
*/}}
{{- define "specula.operatorRules" -}}
# kopf watches SpeculativeModels and patches its bookkeeping annotations and
# finalizer onto them; the tuner reads them fresh before writing status.
- apiGroups: ["specula.dev"]
  resources: ["speculativemodels"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["specula.dev"]
  resources: ["speculativemodels/status"]
  verbs: ["patch"]
# Children carry blockOwnerDeletion owner references; where the
# OwnerReferencesPermissionEnforcement admission plugin runs, setting one needs this.
- apiGroups: ["specula.dev"]
  resources: ["speculativemodels/finalizers"]
  verbs: ["update"]
# Children, written by server-side apply (patch; create when absent) and watched.
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Autoscaling children (KEDA ScaledObject or HPA); deleted when the provider changes.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Pod addresses for the tuner's scrapes.
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["list", "watch"]
# Runtime pods' container states: a failed container (a model download) is reported
# in the resource's Degraded condition.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# The admin-token Secret of each resource: read by the tuner, created once (never
# listed, watched, updated or deleted: the garbage collector removes it with its owner).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
{{- if .Values.networkPolicy.enabled }}
# Each resource's NetworkPolicy, written by server-side apply.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
{{- end }}
# Tuning decisions are recorded as Events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
