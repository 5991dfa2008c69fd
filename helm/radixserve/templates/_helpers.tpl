{{- define "radixserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "radixserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "radixserve.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "radixserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The operator's own slim CPU image (Dockerfile.operator); the services run radixserve.image. */}}
{{- define "radixserve.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (.Values.operator.image.tag | default .Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* podDefaults, with the chart's imagePullSecrets added unless it names its own (JSON). */}}
{{- define "radixserve.podDefaults" -}}
{{- $defaults := deepCopy .Values.podDefaults -}}
{{- if .Values.imagePullSecrets -}}
{{- $spec := $defaults.spec | default dict -}}
{{- if not (hasKey $spec "imagePullSecrets") -}}
{{- $_ := set $spec "imagePullSecrets" .Values.imagePullSecrets -}}
{{- end -}}
{{- $_ := set $defaults "spec" $spec -}}
{{- end -}}
{{- toJson $defaults -}}
{{- end -}}

{{- define "radixserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "radixserve.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "radixserve.redisHost" -}}
{{- printf "%s-redis.%s.svc" (include "radixserve.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "radixserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:6379/0" (include "radixserve.redisHost" .) -}}
{{- end -}}
{{- end -}}

{{- define "radixserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "radixserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The chart Redis's admin user (the operator's): its password is in this Secret's key. */}}
{{- define "radixserve.redisAdminUser" -}}
admin
{{- end -}}

{{- define "radixserve.redisAuthSecret" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis-auth" (include "radixserve.fullname" .)) -}}
{{- end -}}

{{- define "radixserve.redisAuthKey" -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- .Values.redis.auth.existingSecretKey | default "password" -}}
{{- else -}}
password
{{- end -}}
{{- end -}}

{{/* Pods of every InferenceService the operator runs (any namespace it watches). */}}
{{- define "radixserve.servicePodsPeer" -}}
{{- $namespaces := dict -}}
{{- with .Values.operator.watchNamespaces -}}
{{- $namespaces = dict "matchExpressions" (list (dict "key" "kubernetes.io/metadata.name" "operator" "In" "values" .)) -}}
{{- end -}}
{{- $pods := dict "app.kubernetes.io/name" "radixserve" "app.kubernetes.io/managed-by" "radixserve-operator" -}}
{{- toYaml (dict "namespaceSelector" $namespaces "podSelector" (dict "matchLabels" $pods)) -}}
{{- end -}}

{{/* The chart's Redis pod, as a NetworkPolicyPeer seen from any namespace. */}}
{{- define "radixserve.redisPeer" -}}
namespaceSelector:
  matchLabels:
    kubernetes.io/metadata.name: {{ .Release.Namespace }}
podSelector:
  matchLabels:
    {{- include "radixserve.selector" . | nindent 4 }}
    app.kubernetes.io/component: redis
{{- end -}}

{{/* The chart Redis's redis.conf (its ConfigMap; its hash rolls the pod). */}}
{{- define "radixserve.redisConf" -}}
port 6379
dir /data
# No persistence: a restarted Redis is empty (the schedulers republish, the operator sets the
# users again within a resync interval).
save ""
appendonly no
maxmemory {{ .Values.redis.maxMemory }}
# volatile-lru (redis.maxmemoryPolicy's default) evicts only keys with a TTL. Index entries
# carry one; liveness keys (heartbeats, the pod list) carry none, so they are never evicted:
# a full Redis forgets cached blocks (shorter matches), never a live pod.
maxmemory-policy {{ .Values.redis.maxmemoryPolicy }}
# Users (the admin, no default user) come from this file, written at start from the Secret;
# the operator adds one per InferenceService at run time (ACL SETUSER).
aclfile /data/users.acl
# Every user needs a password (the default user is off); NetworkPolicy limits who connects.
protected-mode no
{{- end -}}
