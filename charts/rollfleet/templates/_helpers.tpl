{{/*
Object names. The release `rollfleet` gives the names manifests/base gives (rollfleet-operator, ...);
another release gets its own cluster-wide names.
*/}}
{{- define "rollfleet.fullname" -}}
{{- $name := default "rollfleet" .Values.nameOverride -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Every object's labels: manifests/base's, and Helm's own. */}}
{{- define "rollfleet.labels" -}}
app.kubernetes.io/name: rollfleet
app.kubernetes.io/part-of: rollfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rollfleet.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
The objects of a file in files/ (a copy of the repository's source: rollfleet_dev.chart), one YAML document
each, with its comments.
*/}}
{{- define "rollfleet.documents" -}}
{{- $docs := list -}}
{{- range regexSplit "(?m)^---\\s*$" . -1 -}}
{{- $obj := fromYaml . -}}
{{- if $obj -}}{{- $docs = append $docs $obj -}}{{- end -}}
{{- end -}}
{{- toJson $docs -}}
{{- end -}}

{{/*
What the operator may do in the namespaces it serves, grouped by why it needs it (manifests/base/rbac.yaml
holds the same rules; a test compares them).
*/}}
{{- define "rollfleet.namespacedRules" -}}
# Its own kinds: watch them, consume one-shot annotations (rollfleet.dev/resume), write status.
- apiGroups: [rollfleet.dev]
  resources: [rolloutfleets, rolloutrequests]
  verbs: [get, list, watch, patch]
- apiGroups: [rollfleet.dev]
  resources: [rolloutfleets/status, rolloutrequests/status]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion on what a fleet owns.
- apiGroups: [rollfleet.dev]
  resources: [rolloutfleets/finalizers]
  verbs: [update]
# Finished RolloutRequests past their TTL.
- apiGroups: [rollfleet.dev]
  resources: [rolloutrequests]
  verbs: [delete]
# Engine pods: create, mark draining (annotations), delete; watch to observe.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, patch, delete]
# A multi-pod engine: its LeaderWorkerSet group, made and deleted whole (LWS makes its pods).
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [create, delete]
# The fleet's gateway and the identities it and the engines run as (server-side apply). What a fleet
# owns is watched too: the operator puts back what someone else changed or deleted.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [list, watch, create, patch]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [list, watch, create, patch]
# The fleet's gateway Service; a RolloutRequest's runner reads its ClusterIP (the operator grants that).
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch]
# Each running RolloutRequest's runner Job, watched for pods that cannot start or keep failing; spare
# runners, made ahead of the next request of a fleet and claim, found by label and given to a request.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, create, patch]
# A RolloutRequest's results claim, looked up before its runner is made (a missing one fails it).
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get]
# The gateway's, the trainers' and each request runner's Roles and RoleBindings.
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [list, watch, create, patch]
# The NetworkPolicy of a fleet's engines (server-side apply creates and converges it);
# deleted when the fleet's spec.networkPolicy.enabled turns false.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, create, patch, delete]
# The PodDisruptionBudget of a fleet's engines (server-side apply creates and converges it).
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, watch, create, patch]
# The fleet's admin token: created once. Never read back: the operator derives it from its key
# (the key's Role), so it can read no Secret but that one.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# RolloutRequest prompts and results, which request runners read and write (the operator grants
# them that, so it holds it); each fleet's weight-sync record <fleet>-weights (watched, reset
# when spec.model changes), which the fleet's trainers may patch (granted likewise).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, update, patch]
# Events for every transition (`kubectl describe rf`).
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}

{{- define "rollfleet.clusterRules" -}}
# Node loss: an engine on a node that is gone or not Ready is replaced.
- apiGroups: [""]
  resources: [nodes]
  verbs: [list]
# kopf discovers the custom resources it serves from their definitions, and (when told
# to serve some namespaces) which namespaces exist.
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- end -}}
