{{/*
Names. fullname is "<release>-<chart>" unless the release name already contains the chart name;
every object is "<fullname>-<component>" (target, draft, router, redis).
*/}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specserve.fullname" -}}
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

{{/* "<fullname>-<component>"; the fullname is cut to leave room for the longest suffix ("-router"). */}}
{{- define "specserve.componentName" -}}
{{- $root := index . 0 }}
{{- printf "%s-%s" (include "specserve.fullname" $root | trunc 55 | trimSuffix "-") (index . 1) }}
{{- end }}

{{/* Fully qualified DNS name of a component's Service. Args: root, component. */}}
{{- define "specserve.serviceFQDN" -}}
{{- $root := index . 0 }}
{{- printf "%s.%s.svc.%s" (include "specserve.componentName" .) $root.Release.Namespace $root.Values.clusterDomain }}
{{- end }}

{{- define "specserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels. Args: root, component. */}}
{{- define "specserve.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "specserve.chart" $root }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: specserve
{{- end }}

{{/* Selector labels: stable for the life of a release (Deployment selectors are immutable). */}}
{{- define "specserve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "specserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* The three specserve roles, in a fixed order, with what differs between them. */}}
{{- define "specserve.roles" -}}
target:
  grpcService: specserve.v1.TargetService
  envPrefix: SPECSERVE_TARGET_
  usesModels: true
draft:
  grpcService: specserve.v1.DraftService
  envPrefix: SPECSERVE_DRAFT_
  usesModels: true
router:
  grpcService: specserve.v1.RouterService
  envPrefix: SPECSERVE_ROUTER_
  usesModels: false
{{- end }}

{{/* Image reference. Args: root, role values. */}}
{{- define "specserve.image" -}}
{{- $root := index . 0 }}
{{- $image := (index . 1).image }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}

{{/*
An env var value as the services parse it: lists comma-separated, whole numbers without a decimal point
or exponent (YAML numbers arrive as float64, and 16777216 would otherwise print as 1.6777216e+07).
*/}}
{{- define "specserve.envValue" -}}
{{- if kindIs "slice" . }}
{{- join "," . }}
{{- else if kindIs "float64" . }}
{{- if eq . (floor .) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else }}
{{- . }}
{{- end }}
{{- end }}

{{/*
One env var per non-null key of a settings map: <prefix><KEY in UPPER_SNAKE_CASE>.
Args: prefix, settings map.
*/}}
{{- define "specserve.settingsEnv" -}}
{{- $prefix := index . 0 }}
{{- $settings := index . 1 }}
{{- range $key := keys $settings | sortAlpha }}
{{- $value := index $settings $key }}
{{- if not (kindIs "invalid" $value) }}
- name: {{ printf "%s%s" $prefix ($key | snakecase | upper) }}
  value: {{ include "specserve.envValue" $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* terminationGracePeriodSeconds: the service's drain time (rounded up) plus a margin. Args: role values. */}}
{{- define "specserve.terminationGracePeriodSeconds" -}}
{{- add (ceil .settings.drainSeconds | int64) .drainMarginSeconds }}
{{- end }}

{{/* Bundled Redis URL; with auth, the password comes from the REDIS_PASSWORD env var (a Secret). */}}
{{- define "specserve.bundledRedisURL" -}}
{{- $redis := .Values.redis.bundled }}
{{- $userinfo := ternary ":$(REDIS_PASSWORD)@" "" $redis.auth.enabled }}
{{- printf "redis://%s%s:%d/%d" $userinfo (include "specserve.serviceFQDN" (list . "redis")) (int $redis.port) (int $redis.database) }}
{{- end }}

{{/* The Secret holding the bundled Redis's password. */}}
{{- define "specserve.redisSecretName" -}}
{{- .Values.redis.bundled.auth.existingSecret | default (include "specserve.componentName" (list . "redis")) }}
{{- end }}

{{/* The Secret holding the router's bearer tokens: yours, or the one the chart generates. */}}
{{- define "specserve.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "specserve.fullname" .)) }}
{{- end }}

{{/*
With tls.enabled: "true" when the chart issues the certificates itself, that is when tls.secrets names no
Secret. The router presents one certificate to its clients and to the target and draft, and each
service trusts one CA, so the three Secrets come from one CA: all three are yours, or none is.
*/}}
{{- define "specserve.tlsGenerated" -}}
{{- $given := list }}
{{- range $role := list "router" "target" "draft" }}
{{- if index $.Values.tls.secrets $role }}
{{- $given = append $given $role }}
{{- end }}
{{- end }}
{{- if and $given (lt (len $given) 3) }}
{{- fail (printf "tls.secrets names %s only: name the router's, target's and draft's Secrets (one CA signs all three), or none to have the chart generate them" (join ", " $given)) }}
{{- end }}
{{- if not $given }}true{{ end }}
{{- end }}

{{/* The Secret holding the generated CA and the three roles' certificates. */}}
{{- define "specserve.tlsSecretName" -}}
{{- printf "%s-tls" (include "specserve.fullname" .) }}
{{- end }}

{{/*
The DNS names a generated certificate covers, per role, as JSON: the role's Service under every name a
pod can resolve it by (<svc>, <svc>.<namespace>, <svc>.<namespace>.svc, <svc>.<namespace>.svc.<domain>);
the router's also localhost (kubectl port-forward) and tls.generated.routerDnsNames.
*/}}
{{- define "specserve.tlsDnsNames" -}}
{{- $names := dict }}
{{- range $role := list "router" "target" "draft" }}
{{- $service := include "specserve.componentName" (list $ $role) }}
{{- $namespaced := printf "%s.%s" $service $.Release.Namespace }}
{{- $list := list $service $namespaced (printf "%s.svc" $namespaced) (include "specserve.serviceFQDN" (list $ $role)) }}
{{- if eq $role "router" }}
{{- $list = concat $list (list "localhost") $.Values.tls.generated.routerDnsNames }}
{{- end }}
{{- $_ := set $names $role $list }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/*
A fingerprint of what the generated certificates are issued for (names and validity): recorded on the
Secret, to re-issue them when it changes, and on the pods, to restart them onto the new ones.
*/}}
{{- define "specserve.tlsIssuedFor" -}}
{{- printf "%s/%d" (include "specserve.tlsDnsNames" .) (int .Values.tls.generated.validityDays) | sha256sum }}
{{- end }}
