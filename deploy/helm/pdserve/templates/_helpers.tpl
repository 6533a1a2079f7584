{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name every object is prefixed with; 63 characters minus room for "-autoscaler". */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select one component's pods; call with (dict "root" $ "component" "head"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* A NetworkPolicy peer: every pod of this release (any component), in its namespace. */}}
{{- define "pdserve.releasePeer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "pdserve.name" . }}
      app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Every object's labels; call with (dict "root" $ "component" "head"). */}}
{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ include "pdserve.chart" .root }}
{{- end }}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "pdserve.headService" -}}
{{ include "pdserve.fullname" . }}-head
{{- end }}

{{/* What Ray workers, the controller and the gateways pass to `ray start --address`. */}}
{{- define "pdserve.headAddress" -}}
{{ include "pdserve.headService" . }}:6379
{{- end }}

{{- define "pdserve.workerName" -}}
{{ include "pdserve.fullname" .root }}-{{ .role }}
{{- end }}

{{/* The roles of the worker Deployments, a JSON list: prefill and decode, or the one shared "worker" (workerPods). */}}
{{- define "pdserve.workerRoles" -}}
{{- if eq .Values.workerPods "shared" }}["worker"]{{ else }}["prefill", "decode"]{{ end }}
{{- end }}

{{/*
A worker Deployment's pool values, as JSON. "worker" (workerPods shared): the prefill pool's pod shape,
which the decode pool's must equal (any pod may serve either role), and the replicas of both.
Call with (dict "root" $ "role" "worker").
*/}}
{{- define "pdserve.workerPool" -}}
{{- $values := .root.Values }}
{{- if ne .role "worker" }}
{{- toJson (index $values .role) }}
{{- else }}
{{- range $key := list "instancesPerPod" "cpus" "gpu" "resources" "shmSize" "drainSeconds" "nodeSelector" "tolerations" "affinity" }}
{{- $a := toJson (index $values.prefill $key) }}
{{- $b := toJson (index $values.decode $key) }}
{{- if ne $a $b }}
{{- fail (printf "workerPods shared runs every instance on one pod shape: prefill.%s (%s) differs from decode.%s (%s)" $key $a $key $b) }}
{{- end }}
{{- end }}
{{- $tp := list (int ($values.spec.prefill_tp | default 1)) (int ($values.spec.decode_tp | default 1)) }}
{{- if ne (first $tp) (last $tp) }}
{{- fail (printf "workerPods shared flips instances between roles: spec.prefill_tp (%d) and spec.decode_tp (%d) must be equal" (first $tp) (last $tp)) }}
{{- end }}
{{- $pool := deepCopy $values.prefill }}
{{- $_ := set $pool "replicas" (add $values.prefill.replicas $values.decode.replicas) }}
{{- toJson $pool }}
{{- end }}
{{- end }}

{{- define "pdserve.rayAuthSecret" -}}
{{ .Values.ray.auth.existingSecret | default (printf "%s-ray-auth" (include "pdserve.fullname" .)) }}
{{- end }}

{{- define "pdserve.autoscalerServiceAccount" -}}
{{ include "pdserve.fullname" . }}-autoscaler
{{- end }}

{{/*
Env of every Ray pod: token authentication with the release's token, the KV transfer's cluster
secret (a key of the same Secret, optional: kvtransfer/wire.py falls back to the token), and the pod's own address
(PDSERVE_NODE_IP), which `ray start --node-ip-address=$(PDSERVE_NODE_IP)` and the ranks bind.
*/}}
{{- define "pdserve.rayEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.rayAuthSecret" . }}
      key: {{ .Values.ray.auth.existingSecretKey }}
- name: PDSERVE_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.rayAuthSecret" . }}
      key: {{ .Values.ray.auth.clusterSecretKey }}
      optional: true
- name: PDSERVE_NODE_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{/* Ray starts workers at nice 15; a rank at the spec's rank_niceness 0 needs no CAP_SYS_NICE then */}}
- name: RAY_worker_niceness
  value: "{{ max 0 (.Values.spec.rank_niceness | default 0) }}"
{{- end }}

{{/* Every `ray start` names its node by the pod's address (kubelet expands the variable). */}}
{{- define "pdserve.nodeIpFlag" -}}
--node-ip-address=$(PDSERVE_NODE_IP)
{{- end }}

{{- define "pdserve.redisAuthSecret" -}}
{{ .Values.redis.auth.existingSecret | default (printf "%s-redis-auth" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* The ACL user the release's Redis admits: the only one (its `default` user is off). */}}
{{- define "pdserve.redisUser" -}}
pdserve
{{- end }}

{{/*
The release's Redis ACL file for a password (the argument): `default` off, and the one user with
the password's SHA-256 (so the plaintext is in no Redis config), all keys and commands but
@dangerous (CONFIG, MODULE, DEBUG, SHUTDOWN, ...: what a stolen password could take a host with),
except ACL LOG (read-only: the refused logins, with the user names tried, never a password).
*/}}
{{- define "pdserve.redisAcl" -}}
user default off
user {{ include "pdserve.redisUser" nil }} on #{{ sha256sum . }} ~* &* +@all -@dangerous +acl|log
{{ end }}

{{/* Where the controller and the gateways find an external Redis' CA bundle. */}}
{{- define "pdserve.redisCaDir" -}}
/etc/pdserve-redis-ca
{{- end }}

{{/*
Redis env of the controller and the gateways: PDSERVE_REDIS_URL, and the credentials and TLS CA
cluster/redis_client.py reads. The release's Redis (its Secret's password, user pdserve) or the
external one's Secrets. They meet only in Redis, so one of the two is required.
*/}}
{{- define "pdserve.redisEnv" -}}
{{- $external := .Values.redis.external }}
{{- if and .Values.redis.enabled $external.existingSecret }}
{{- fail "set either redis.enabled or redis.external.existingSecret, not both (redis.enabled=false to use an external Redis)" }}
{{- else if and .Values.redis.enabled (or $external.auth.existingSecret $external.auth.username $external.tls.caSecret) }}
{{- fail "redis.external.auth and redis.external.tls apply to an external Redis: set redis.enabled=false and redis.external.existingSecret" }}
{{- else if and (not .Values.redis.enabled) .Values.redis.auth.existingSecret }}
{{- fail "redis.auth.existingSecret is the release's Redis' own: for an external Redis use redis.external.auth" }}
{{- else if .Values.redis.enabled }}
- name: PDSERVE_REDIS_URL
  value: redis://{{ include "pdserve.fullname" . }}-redis:6379/0
- name: PDSERVE_REDIS_USERNAME
  value: {{ include "pdserve.redisUser" . }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisAuthSecret" . }}
      key: password
{{- else if $external.existingSecret }}
- name: PDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $external.existingSecret }}
      key: {{ $external.key }}
{{- if $external.auth.existingSecret }}
- name: PDSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $external.auth.existingSecret }}
      key: {{ $external.auth.key }}
{{- else if $external.auth.username }}
{{- fail "redis.external.auth.username needs its password: set redis.external.auth.existingSecret" }}
{{- end }}
{{- with $external.auth.username }}
- name: PDSERVE_REDIS_USERNAME
  value: {{ . | quote }}
{{- end }}
{{- with $external.tls.caSecret }}
- name: PDSERVE_REDIS_CA_FILE
  value: {{ include "pdserve.redisCaDir" $ }}/{{ $external.tls.caKey }}
{{- end }}
{{- else }}
{{- fail "the controller and the gateways meet in Redis: set redis.enabled=true or redis.external.existingSecret" }}
{{- end }}
{{- end }}

{{/*
The command of a Ray driver pod (controller, gateway): join Ray as a node without CPUs, then run
`pdserve <command>` on the mounted spec; the Redis URL comes from PDSERVE_REDIS_URL (never on the
command line: an external one may carry a password). Call with (dict "root" $ "command" "gateway").
*/}}
{{- define "pdserve.driverCommand" -}}
- sh
- -c
- >-
  ray start --address={{ include "pdserve.headAddress" .root }} --num-cpus=0 {{ include "pdserve.nodeIpFlag" .root }} &&
  exec pdserve {{ .command }} --config /etc/pdserve/spec.yaml --host 0.0.0.0 --port 8000
  --ray-address auto{{ with .args }} {{ . }}{{ end }}
{{- end }}

{{/* The gateways' named API keys: whether any are configured, and the Secret holding their file. */}}
{{- define "pdserve.apiKeysOn" -}}
{{- if or .Values.gateway.apiKeys.keys .Values.gateway.apiKeys.existingSecret }}true{{ end }}
{{- end }}
{{- define "pdserve.apiKeysSecret" -}}
{{- .Values.gateway.apiKeys.existingSecret | default (printf "%s-api-keys" (include "pdserve.fullname" .)) }}
{{- end }}
{{- define "pdserve.apiKeysDir" -}}/etc/pdserve-api-keys{{- end }}

{{/*
A gateway pod's grace period: the preStop sleep, the drain bound (spec.drain_timeout_s, 30 s by
default: cluster/spec.py) and 15 s for the streams' last chunks, the uvicorn shutdown and `ray stop`.
*/}}
{{- define "pdserve.gatewayGraceSeconds" -}}
{{- $drain := 30 }}
{{- if hasKey .Values.spec "drain_timeout_s" }}{{ $drain = .Values.spec.drain_timeout_s }}{{ end }}
{{- add .Values.gateway.preStopSeconds (ceil $drain | int) 15 }}
{{- end }}

{{/* The spec volume of the controller and gateways, their /dev/shm and the user's extras. */}}
{{- define "pdserve.driverVolumes" -}}
- name: spec
  configMap:
    name: {{ include "pdserve.fullname" .root }}-spec
{{ include "pdserve.shmVolume" .shmSize }}
{{- with .root.Values.redis.external.tls }}
{{- if .caSecret }}
- name: redis-ca
  secret:
    secretName: {{ .caSecret }}
    items:
      - key: {{ .caKey }}
        path: {{ .caKey }}
{{- end }}
{{- end }}
{{- with .root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.driverVolumeMounts" -}}
- name: spec
  mountPath: /etc/pdserve
  readOnly: true
{{ include "pdserve.shmMount" . }}
{{- if .Values.redis.external.tls.caSecret }}
- name: redis-ca
  mountPath: {{ include "pdserve.redisCaDir" . }}
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod-level fields shared by all pdserve pods. */}}
{{- define "pdserve.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* nodeSelector, tolerations and affinity of one component's values. */}}
{{- define "pdserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Ray keeps its object store in /dev/shm; the container default (64 MiB) is far too small. */}}
{{- define "pdserve.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ . }}
{{- end }}

{{- define "pdserve.shmMount" -}}
- name: dshm
  mountPath: /dev/shm
{{- end }}

{{/*
Pods in a pool: replicas x instancesPerPod. Fails when the spec asks for more instances than
that, since the extra instances would wait for a Ray resource no pod carries.
Call with (dict "root" $ "role" "prefill").
*/}}
{{- define "pdserve.poolInstances" -}}
{{- $pool := index .root.Values .role }}
{{- $capacity := mul $pool.replicas $pool.instancesPerPod }}
{{- $key := printf "num_%s" .role }}
{{- $asked := index .root.Values.spec $key | default $capacity }}
{{- if gt (int $asked) (int $capacity) }}
{{- fail (printf "spec.%s=%d exceeds %s.replicas x %s.instancesPerPod = %d: the extra instances would find no pod" $key (int $asked) .role .role (int $capacity)) }}
{{- end }}
{{- int $asked }}
{{- end }}

{{/* The cluster spec the controller and gateways run: values.spec plus the keys the chart owns. */}}
{{- define "pdserve.spec" -}}
{{- $spec := deepCopy .Values.spec }}
{{- $_ := set $spec "num_prefill" (include "pdserve.poolInstances" (dict "root" . "role" "prefill") | int) }}
{{- $_ = set $spec "num_decode" (include "pdserve.poolInstances" (dict "root" . "role" "decode") | int) }}
{{- $_ = set $spec "ray_resources" true }}
{{- /* The Ray namespace of the instances and their Redis key prefix: one per release, so two
releases may share an external Redis. */}}
{{- if not (hasKey $spec "cluster_name") }}
{{- $_ = set $spec "cluster_name" (include "pdserve.fullname" .) }}
{{- end }}
{{- $_ = set $spec "k8s_namespace" .Release.Namespace }}
{{- /* The KV disk tier lives on the worker pods' kvDiskTier volume. */}}
{{- if gt (float64 (default 0 $spec.kv_disk_tier_gib)) 0.0 }}
{{- $_ = set $spec "kv_disk_tier_dir" .Values.kvDiskTier.mountPath }}
{{- end }}
{{- if eq .Values.workerPods "shared" }}
{{- $_ = set $spec "worker_pods" "shared" }}
{{- $_ = set $spec "k8s_worker_deployment" (include "pdserve.workerName" (dict "root" . "role" "worker")) }}
{{- else }}
{{- $_ = set $spec "worker_pods" "per_role" }}
{{- $_ = set $spec "k8s_prefill_deployment" (include "pdserve.workerName" (dict "root" . "role" "prefill")) }}
{{- $_ = set $spec "k8s_decode_deployment" (include "pdserve.workerName" (dict "root" . "role" "decode")) }}
{{- end }}
{{- with .Values.autoscaler }}
{{- if .enabled }}
{{- /* The Kubernetes actuator sets replicas to the number of instances it wants. */}}
{{- if or (ne (int $.Values.prefill.instancesPerPod) 1) (ne (int $.Values.decode.instancesPerPod) 1) }}
{{- fail "autoscaler.enabled scales pods one instance at a time: set prefill.instancesPerPod and decode.instancesPerPod to 1" }}
{{- end }}
{{- if gt (int .minPrefill) (int .maxPrefill) }}
{{- fail (printf "autoscaler.minPrefill (%d) > autoscaler.maxPrefill (%d)" (int .minPrefill) (int .maxPrefill)) }}
{{- end }}
{{- if gt (int .minDecode) (int .maxDecode) }}
{{- fail (printf "autoscaler.minDecode (%d) > autoscaler.maxDecode (%d)" (int .minDecode) (int .maxDecode)) }}
{{- end }}
{{- $_ = set $spec "autoscale" true }}
{{- $_ = set $spec "autoscale_actuator" "kubernetes" }}
{{- $_ = set $spec "autoscale_policy" .policy }}
{{- $_ = set $spec "ttft_slo_s" .ttftSloS }}
{{- $_ = set $spec "tbt_slo_s" .tbtSloS }}
{{- $_ = set $spec "min_prefill" .minPrefill }}
{{- $_ = set $spec "max_prefill" .maxPrefill }}
{{- $_ = set $spec "min_decode" .minDecode }}
{{- $_ = set $spec "max_decode" .maxDecode }}
{{- end }}
{{- end }}
{{- toYaml $spec }}
{{- end }}
