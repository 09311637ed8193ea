{{/*
Names, labels and the values checks shared by every template.
*/}}

{{/*
Stop the rendering with a message: include "opsd.refuse" "what is wrong". `fail` stops `helm template`, `install` and
`upgrade`; `helm lint` only logs it (its lint mode lets `fail` pass), so an include of a template that cannot exist,
named after the message, stops lint too.
*/}}
{{- define "opsd.refuse" -}}
{{- fail . }}
{{- include (printf "opsd refuses these values: %s" .) . }}
{{- end }}

{{/*
Whether the cluster serves an API version: include "opsd.served" (list $ "monitoring.coreos.com/v1") gives "true" or
"". What helm sees of the cluster (.Capabilities, or --api-versions of `helm template`), or the values' apiVersions:
`helm lint` has no --api-versions, and a render without a cluster (helm template, Argo CD) sees none.
*/}}
{{- define "opsd.served" -}}
{{- $root := index . 0 }}
{{- $api := index . 1 }}
{{- if or ($root.Capabilities.APIVersions.Has $api) (has $api $root.Values.apiVersions) }}true{{ end }}
{{- end }}

{{/* The chart name, or nameOverride. */}}
{{- define "opsd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: fullnameOverride, else "<release>-<name>", else the release name when it
already contains the name. 63 characters at most (DNS label); suffixes such as "-controller" are added on top, so
keep releases short.
*/}}
{{- define "opsd.fullname" -}}
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

{{- define "opsd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels every object carries. */}}
{{- define "opsd.labels" -}}
helm.sh/chart: {{ include "opsd.chart" . }}
{{ include "opsd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: opsd
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "opsd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "opsd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: include "opsd.componentLabels" (list $ "controller") */}}
{{- define "opsd.componentLabels" -}}
{{ include "opsd.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "opsd.componentSelectorLabels" -}}
{{ include "opsd.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "opsd.controllerName" -}}
{{ include "opsd.fullname" . }}-controller
{{- end }}

{{- define "opsd.agentName" -}}
{{ include "opsd.fullname" . }}-agent
{{- end }}

{{- define "opsd.lighthouseName" -}}
{{ include "opsd.fullname" . }}-lighthouse
{{- end }}

{{- define "opsd.configName" -}}
{{ include "opsd.fullname" . }}-config
{{- end }}

{{- define "opsd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "opsd.controllerName" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "opsd.agentServiceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (include "opsd.agentName" .) .Values.agent.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "opsd.leaseName" -}}
{{- default (printf "%s-leader" (include "opsd.fullname" .)) .Values.controller.leaderElection.leaseName }}
{{- end }}

{{- define "opsd.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* The Lighthouse's image (lighthouse.image: one with torchft), its tag defaulting to the chart's appVersion. */}}
{{- define "opsd.lighthouseImage" -}}
{{- $image := .Values.lighthouse.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository ($image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{- define "opsd.imagePullSecrets" -}}
{{- with .Values.image.pullSecrets -}}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The credentials: "existing" (auth.existingSecret), "values" (auth.tokens) or "generated" (the hook makes the Secret).
*/}}
{{- define "opsd.credentials.mode" -}}
{{- if .Values.auth.existingSecret }}existing
{{- else if or .Values.auth.tokens.operator .Values.auth.tokens.reader .Values.auth.tokens.agent .Values.auth.tokens.metrics }}values
{{- else }}generated
{{- end }}
{{- end }}

{{/*
"true" when the agents ask the ranks for their run's key (agent.rankAuth "optional" or "required") and the ranks'
secret is there to give the agents and the controller (which makes each run's key's Secret where the runs are).
"optional" asks nothing of an install whose tokens are values without auth.tokens.ranks (nothing to derive keys
from; an upgrade from a chart without it renders as before); "required" fails there.
*/}}
{{- define "opsd.rankAuth" -}}
{{- $mode := .Values.agent.rankAuth | default "off" }}
{{- $missing := and (eq (include "opsd.credentials.mode" .) "values") (not .Values.auth.tokens.ranks) }}
{{- if and (eq $mode "required") $missing }}
{{- fail "agent.rankAuth required needs auth.tokens.ranks beside the other tokens" }}
{{- end }}
{{- if and (ne $mode "off") (not $missing) }}true{{ end }}
{{- end }}

{{/* The env entry of the ranks' secret: optional where the agents' rankAuth is (an existing Secret without the key) */}}
{{- define "opsd.rankSecretEnv" -}}
{{- $root := index . 0 }}
{{- include "opsd.credentials.env" . }}
{{- if ne $root.Values.agent.rankAuth "required" }}
      optional: true
{{- end }}
{{- end }}

{{/*
The credentials' Secret: auth.existingSecret; "<fullname>-tokens" rendered from auth.tokens; "<fullname>-credentials"
made by the hook. Two names, so that switching between values and the hook on an upgrade neither meets a Secret helm
does not own nor deletes the one the hook made.
*/}}
{{- define "opsd.credentials.secretName" -}}
{{- $mode := include "opsd.credentials.mode" . }}
{{- if eq $mode "existing" }}{{ .Values.auth.existingSecret }}
{{- else if eq $mode "values" }}{{ printf "%s-tokens" (include "opsd.fullname" .) }}
{{- else }}{{ printf "%s-credentials" (include "opsd.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Secret's key of a role's token: include "opsd.credentials.key" (list $ "reader") */}}
{{- define "opsd.credentials.key" -}}
{{- $root := index . 0 }}
{{- $role := index . 1 }}
{{- if $root.Values.auth.existingSecret }}{{ index $root.Values.auth.existingSecretKeys $role }}{{ else }}{{ $role }}{{ end }}
{{- end }}

{{/* An env entry of a role's token: include "opsd.credentials.env" (list $ "OPSD_TOKEN" "operator") */}}
{{- define "opsd.credentials.env" -}}
{{- $root := index . 0 }}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "opsd.credentials.secretName" $root }}
      key: {{ include "opsd.credentials.key" (list $root (index . 2)) }}
{{- end }}

{{/*
An env entry of a role's previous token (the Secret's "<key>-previous", kept there by a rotation; absent: none):
include "opsd.credentials.previousEnv" (list $ "OPSD_CONTROLLER_PREVIOUS_READER_TOKEN" "reader")
*/}}
{{- define "opsd.credentials.previousEnv" -}}
{{- $root := index . 0 }}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "opsd.credentials.secretName" $root }}
      key: {{ printf "%s-previous" (include "opsd.credentials.key" (list $root (index . 2))) }}
      optional: true
{{- end }}

{{/*
What rolls the pods when the credentials change: the tokens given as values, or the Secret's name and keys with
auth.generation (an existing or generated Secret is not in the manifests: raise the generation after rotating it).
*/}}
{{- define "opsd.credentials.checksum" -}}
{{- $mode := include "opsd.credentials.mode" . }}
{{- if eq $mode "values" }}
{{- toJson .Values.auth.tokens | sha256sum }}
{{- else }}
{{- printf "%s/%s/%s/%d" $mode (include "opsd.credentials.secretName" .) (toJson .Values.auth.existingSecretKeys) (int .Values.auth.generation) | sha256sum }}
{{- end }}
{{- end }}

{{/*
The agent container's securityContext: agent.securityContext, as user 10001 (root with transport "hostPath", whose
host directory is root's; a runAsUser given wins), made privileged for gpuAccess "privileged" and
"hostDriver". The API server refuses privileged: true beside allowPrivilegeEscalation: false, and a privileged
container holds every capability: both keys go.
*/}}
{{- define "opsd.agentSecurityContext" -}}
{{- $user := ternary (dict "runAsUser" 0) (dict "runAsUser" 10001 "runAsGroup" 10001 "runAsNonRoot" true) (eq .Values.agent.transport "hostPath") }}
{{- $security := deepCopy (.Values.agent.securityContext | default dict) }}
{{- if hasKey $security "runAsUser" }}{{ $user = dict "runAsUser" (get $security "runAsUser") }}{{ end }}
{{- $security = mustMergeOverwrite $security $user }}
{{- if eq (int (get $security "runAsUser")) 0 }}{{ $security = omit $security "runAsNonRoot" "runAsGroup" }}{{ end }}
{{- if ne .Values.agent.gpuAccess "runtime" }}
{{- $security = merge (dict "privileged" true) (omit $security "allowPrivilegeEscalation" "capabilities") }}
{{- end }}
{{- with $security }}{{ toYaml . }}{{ end }}
{{- end }}

{{/*
The agent's ports in its container: 9464 (HTTP) and 9465 (UDP), which hostPort maps to agent.hostPorts; with
hostNetwork the container's ports are the node's, agent.hostPorts themselves.
*/}}
{{- define "opsd.agentHttpPort" -}}
{{- if eq .Values.agent.transport "hostNetwork" }}{{ .Values.agent.hostPorts.http }}{{ else }}9464{{ end }}
{{- end }}

{{- define "opsd.agentDatagramPort" -}}
{{- if eq .Values.agent.transport "hostNetwork" }}{{ .Values.agent.hostPorts.datagrams }}{{ else }}9465{{ end }}
{{- end }}

{{/*
Where the runs' JobSets are, as the controller's watch_namespace: runNamespaces joined with "," (none: the release
namespace); "" (every namespace) with rbac.clusterWide.
*/}}
{{- define "opsd.watchNamespace" -}}
{{- if .Values.rbac.clusterWide }}{{ else }}{{ join "," (.Values.runNamespaces | default (list .Release.Namespace) | uniq) }}{{ end }}
{{- end }}

{{/* gpuNodeSelector without the keys set to null. */}}
{{- define "opsd.gpuNodeLabels" -}}
{{- $labels := dict }}
{{- range $key, $value := .Values.gpuNodeSelector }}
{{- if not (kindIs "invalid" $value) }}{{ $_ := set $labels $key (toString $value) }}{{ end }}
{{- end }}
{{- toJson $labels }}
{{- end }}

{{/*
The GPU nodes as the controller's node_selector (opsd.backends.kubernetes.selectors): each of gpuNodeTerms as a
label selector, with gpuNodeSelector's labels, the terms ORed (";"); "" for every node.
*/}}
{{- define "opsd.gpuNodeSelector" -}}
{{- $labels := list }}
{{- range $key, $value := include "opsd.gpuNodeLabels" . | fromJson }}
{{- $labels = append $labels (printf "%s=%s" $key $value) }}
{{- end }}
{{- $terms := list }}
{{- range $term := .Values.gpuNodeTerms }}
{{- $requirements := list }}
{{- range $e := $term.matchExpressions }}
{{- $values := $e.values | default list }}
{{- if and (eq $e.operator "In") (eq (len $values) 1) }}{{ $requirements = append $requirements (printf "%s=%s" $e.key (first $values)) }}
{{- else if eq $e.operator "In" }}{{ $requirements = append $requirements (printf "%s in (%s)" $e.key (join "," $values)) }}
{{- else if eq $e.operator "NotIn" }}{{ $requirements = append $requirements (printf "%s notin (%s)" $e.key (join "," $values)) }}
{{- else if eq $e.operator "Exists" }}{{ $requirements = append $requirements $e.key }}
{{- else if eq $e.operator "DoesNotExist" }}{{ $requirements = append $requirements (printf "!%s" $e.key) }}
{{- else }}{{ include "opsd.refuse" (printf "gpuNodeTerms: operator %s of %s is not a label selector's (In, NotIn, Exists, DoesNotExist)" $e.operator $e.key) }}
{{- end }}
{{- end }}
{{- if $term.matchFields }}{{ include "opsd.refuse" "gpuNodeTerms: matchFields is not a label selector's: use matchExpressions" }}{{ end }}
{{- $terms = append $terms (join "," (concat $requirements $labels)) }}
{{- end }}
{{- if $terms }}{{ join "; " $terms }}{{ else }}{{ join "," $labels }}{{ end }}
{{- end }}

{{/* The agents' affinity: agent.affinity, with the GPU nodes (gpuNodeTerms) as the required node affinity. */}}
{{- define "opsd.agent.affinity" -}}
{{- $affinity := deepCopy (.Values.agent.affinity | default dict) }}
{{- if .Values.gpuNodeTerms }}
{{- $required := dict "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" .Values.gpuNodeTerms) }}
{{- $_ := set $affinity "nodeAffinity" (merge (get $affinity "nodeAffinity" | default dict) $required) }}
{{- end }}
{{- if $affinity }}{{ toYaml $affinity }}{{ end }}
{{- end }}

{{/* The controller's URL inside the cluster: https with controller.tls. */}}
{{- define "opsd.controllerUrl" -}}
{{- printf "%s://%s:%v" (ternary "https" "http" .Values.controller.tls.enabled) (include "opsd.controllerName" .) .Values.controller.service.port }}
{{- end }}

{{/* A probe of the controller's API: include "opsd.controllerProbe" (list $ probe), its httpGet over HTTPS with TLS. */}}
{{- define "opsd.controllerProbe" -}}
{{- $root := index . 0 }}
{{- $probe := deepCopy (index . 1) }}
{{- if and $root.Values.controller.tls.enabled $probe.httpGet }}
{{- $_ := set $probe.httpGet "scheme" "HTTPS" }}
{{- end }}
{{- toYaml $probe }}
{{- end }}

{{/* "true" when the controller keeps its state in PostgreSQL. */}}
{{- define "opsd.postgresql.enabled" -}}
{{- if or .Values.postgresql.url .Values.postgresql.existingSecret }}true{{ end }}
{{- end }}

{{- define "opsd.postgresql.secretName" -}}
{{- default (printf "%s-postgresql" (include "opsd.fullname" .)) .Values.postgresql.existingSecret }}
{{- end }}

{{- define "opsd.postgresql.secretKey" -}}
{{- if .Values.postgresql.existingSecret }}{{ .Values.postgresql.existingSecretKey }}{{ else }}url{{ end }}
{{- end }}

{{/* "true" when the controller gets S3 credentials. */}}
{{- define "opsd.s3.enabled" -}}
{{- if or .Values.s3.existingSecret .Values.s3.accessKeyId .Values.s3.secretAccessKey .Values.s3.endpointUrl }}true{{ end }}
{{- end }}

{{- define "opsd.s3.secretName" -}}
{{- default (printf "%s-s3" (include "opsd.fullname" .)) .Values.s3.existingSecret }}
{{- end }}

{{/*
Whether a Prometheus Operator object is rendered: include "opsd.monitoring.enabled" (list $ "serviceMonitor")
gives "true" or "". `enabled` is "auto" (render when the API is served), true (render; fail without the API) or
false.
*/}}
{{- define "opsd.monitoring.enabled" -}}
{{- $root := index . 0 }}
{{- $key := index . 1 }}
{{- $mode := index $root.Values.monitoring $key "enabled" }}
{{- $served := include "opsd.served" (list $root "monitoring.coreos.com/v1") }}
{{- if kindIs "bool" $mode }}
{{- if and $mode (not $served) }}
{{- include "opsd.refuse" (printf "monitoring.%s.enabled is true, but this cluster does not serve the API monitoring.coreos.com/v1 (install the Prometheus Operator CRDs; where helm sees no cluster, list it in apiVersions or pass --api-versions monitoring.coreos.com/v1 to helm template; or set monitoring.%s.enabled to \"auto\" or false)" $key $key) }}
{{- end }}
{{- if $mode }}true{{ end }}
{{- else if $served }}true
{{- end }}
{{- end }}

{{/* Labels of a monitor or rule: the component's, monitoring.additionalLabels, then its own additionalLabels. */}}
{{- define "opsd.monitoring.labels" -}}
{{- $root := index . 0 }}
{{- $key := index . 1 }}
{{- $component := index . 2 }}
{{- $labels := include "opsd.componentLabels" (list $root $component) | fromYaml }}
{{- $labels = mustMergeOverwrite $labels (deepCopy $root.Values.monitoring.additionalLabels) (deepCopy (index $root.Values.monitoring $key "additionalLabels")) }}
{{- toYaml $labels }}
{{- end }}

{{/*
Checks across values that the schema cannot express. Included by the controller Deployment, so that every
render runs them once.
*/}}
{{- define "opsd.validate" -}}
{{- $replicas := int .Values.controller.replicas }}
{{- if and (gt $replicas 1) (not (include "opsd.postgresql.enabled" .)) }}
{{- include "opsd.refuse" (printf "controller.replicas is %d, but the controller keeps its state in SQLite on one volume without PostgreSQL: set postgresql.url or postgresql.existingSecret to run more than 1 replica" $replicas) }}
{{- end }}
{{- if and (gt $replicas 1) (not .Values.controller.leaderElection.enabled) }}
{{- include "opsd.refuse" (printf "controller.replicas is %d with controller.leaderElection.enabled false: several controllers would act on the same runs; enable leader election or run 1 replica" $replicas) }}
{{- end }}
{{- if hasKey (.Values.controller.config.kubernetes | default dict) "watch_namespace" }}
{{- include "opsd.refuse" "controller.config.kubernetes.watch_namespace is set: the runs' namespaces are runNamespaces (or every namespace with rbac.clusterWide), which the chart gives both to the controller and to its RBAC" }}
{{- end }}
{{- if hasKey (.Values.controller.config.kubernetes | default dict) "node_selector" }}
{{- include "opsd.refuse" "controller.config.kubernetes.node_selector is set: the GPU nodes are gpuNodeTerms and gpuNodeSelector, which the chart gives both to the agents and to the controller" }}
{{- end }}
{{- if and .Values.controller.tls.enabled (not .Values.controller.tls.secretName) }}
{{- include "opsd.refuse" "controller.tls.enabled needs controller.tls.secretName: a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt" }}
{{- end }}
{{- if hasKey (.Values.agent.securityContext | default dict) "privileged" }}
{{- include "opsd.refuse" "agent.securityContext.privileged is set: set agent.gpuAccess to \"privileged\" (or \"hostDriver\"), which renders a privileged container the API server accepts" }}
{{- end }}
{{- $tokens := .Values.auth.tokens }}
{{- $given := list }}
{{- range $role := list "operator" "reader" "agent" "metrics" }}{{ with index $tokens $role }}{{ $given = append $given . }}{{ end }}{{ end }}
{{- if and .Values.auth.existingSecret $given }}
{{- include "opsd.refuse" "auth.tokens and auth.existingSecret are both set: set one" }}
{{- end }}
{{- if and $given (ne (len $given) 4) }}
{{- include "opsd.refuse" "auth.tokens: give all four tokens (operator, reader, agent, metrics), or none (the chart's hook makes them)" }}
{{- end }}
{{- if ne (len $given) (len (uniq $given)) }}
{{- include "opsd.refuse" "auth.tokens: each role needs a token of its own (two are the same)" }}
{{- end }}
{{- if and .Values.postgresql.existingSecret .Values.postgresql.url }}
{{- include "opsd.refuse" "postgresql.url and postgresql.existingSecret are both set: set one" }}
{{- end }}
{{- if and .Values.s3.existingSecret (or .Values.s3.accessKeyId .Values.s3.secretAccessKey .Values.s3.endpointUrl) }}
{{- include "opsd.refuse" "s3.existingSecret is set together with s3.accessKeyId, s3.secretAccessKey or s3.endpointUrl: set one or the other" }}
{{- end }}
{{- if and (not .Values.s3.existingSecret) (or .Values.s3.accessKeyId .Values.s3.secretAccessKey) (not (and .Values.s3.accessKeyId .Values.s3.secretAccessKey)) }}
{{- include "opsd.refuse" "s3.accessKeyId and s3.secretAccessKey go together: set both or neither" }}
{{- end }}
{{- end }}

{{/*
The settings file /etc/opsd/opsd.yaml: the values' config maps with what the chart decides laid over. The
controller's section (what `opsd serve --config` reads): its checksum is the controller's, so that a change of the
agents' settings alone does not restart the controller.
*/}}
{{- define "opsd.settings.controller" -}}
{{- $tls := dict }}
{{- if .Values.controller.tls.enabled }}
{{- $tls = dict "tls_certfile" "/etc/opsd/tls/tls.crt" "tls_keyfile" "/etc/opsd/tls/tls.key" }}
{{- end }}
{{- $controller := mustMergeOverwrite (deepCopy .Values.controller.config) $tls (dict
  "host" "0.0.0.0"
  "port" 8470
  "liveness_port" 8470
  "heartbeat_port" 8471
  "kubernetes" (dict
    "namespace" .Release.Namespace
    "node_selector" (include "opsd.gpuNodeSelector" .)
    "watch_namespace" (include "opsd.watchNamespace" .)
    "lease_name" (include "opsd.leaseName" .)
    "leader_election" .Values.controller.leaderElection.enabled)) }}
{{- toYaml $controller }}
{{- end }}

{{/*
The agent's section of the settings (what `opsd agent --config` reads): its checksum is the agent DaemonSet's, so
that a change of the controller's settings alone does not roll the agents.
*/}}
{{- define "opsd.settings.agent" -}}
{{- $agent := dict }}
{{- if eq .Values.agent.transport "hostPath" }}
{{- $agent = dict
  "socket" "/run/opsd/agent.sock"
  "metrics_host" "0.0.0.0"
  "metrics_port" 9464
  "policy_file" "/run/opsd/policy.json"
  "flight_dir" "/run/opsd/flight" }}
{{- else }}
{{- $agent = dict
  "socket" "/tmp/opsd-agent.sock"
  "metrics_host" "0.0.0.0"
  "metrics_port" (include "opsd.agentHttpPort" . | int)
  "datagram_host" "0.0.0.0"
  "datagram_port" (include "opsd.agentDatagramPort" . | int)
  "flight_dir" "/var/spool/opsd/flight" }}
{{- end }}
{{- $agent = mustMergeOverwrite (deepCopy .Values.agent.config) $agent }}
{{- toYaml $agent }}
{{- end }}

{{/*
The settings file both read: the controller's section and the agent's.
*/}}
{{- define "opsd.settings" -}}
{{- toYaml (dict "controller" (include "opsd.settings.controller" . | fromYaml) "agent" (include "opsd.settings.agent" . | fromYaml)) }}
{{- end }}
