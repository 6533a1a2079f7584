"""The Helm chart's pods on the multi-host test bed: render deploy/helm/pdserve with real Helm,
then run every Deployment's pods as a kubelet would, one bed host ("pod" role) per replica.

    bed = Bed([]).up()                                     # or a bed shared with other tests
    pods = ChartPods(bed, BED_VALUES, release="pd").up(timeout=300)
    pods.pods                      # {"redis1": "redis", "head1": "ray-head", ..., "gw2": "gateway"}
    pods.url("gw1")                # http://POD_IP:8000 (its container port named "http")
    pods.probe("gw1", "readinessProbe")
    pods.kill_pod("pf1"); pods.restart_pod("pf1")
    pods.terminate_pod("gw1")      # preStop, SIGTERM, SIGKILL past the grace period
    name = pods.start_pod("gateway"); pods.wait_ready(name, 120); pods.delete_pod(name)
    pods.down(); bed.down()

What a kubelet would do, and what happens here:
- Start-up: Deployments in the order redis, Ray head, workers, controller, gateways (others last),
  each group started at once and waited for (startup, then readiness probe) before the next.
- Pod = bed host: its own address, PID and mount namespaces; one container (no sidecars or init
  containers: ValueError). Nothing restarts a pod that exits or fails its liveness probe.
- Command: `command` + `args` exactly as rendered, `$(VAR)` expanded from the container's env
  (`$$` escapes), as kubelet does. The image is this checkout: `pdserve` and `ray` on PATH (the
  venv's bin), working dir the repo. A redis image's container without `command` runs what the
  official image's docker-entrypoint.sh runs: `redis-server` + args, in its WORKDIR /data.
- Env: the container's env only (plus PATH and HOME): `value` ($(VAR) of earlier entries),
  `secretKeyRef` / `configMapKeyRef` from the rendered objects (the chart's generated ray-auth
  Secret included: one render, one token), `fieldRef` status.podIP, metadata.name/namespace.
  Not emulated: envFrom, resourceFieldRef, Service link variables (FOO_SERVICE_HOST).
- Volumes: configMap and secret volumes are files under the bed dir, bind-mounted (read-only if
  the mount says so); emptyDir is a dir under the bed dir, or a tmpfs (sizeLimit) for medium
  Memory; missing mount points are created on the shared filesystem and removed at `down()`.
  /tmp is a per-pod dir (the container's own filesystem; Ray nodes need their own), fresh on restart;
  a checkout or venv that lives under /tmp is bind-mounted into it at its own path (the image's files).
- Services: each Service name (also NAME.NS, NAME.NS.svc, NAME.NS.svc.cluster.local) resolves to
  the first running pod it selects, through a hosts file per pod (/etc/netns/NETNS/hosts,
  bind-mounted onto /etc/hosts) rewritten as pods come and go. No virtual IP, so a Service port
  must equal its target port (ValueError otherwise).
- Probes: httpGet (path, port by number or name, scheme, headers), tcpSocket (both from the root
  namespace against the pod's address) and exec (inside the pod, with its env), each with its
  timeoutSeconds; success as kubelet counts it (HTTP 200-399).
- Service accounts: with a `kube_api` (bench/bed_kube_api.py), a pod that mounts its token gets it as
  kubelet mounts it, and the API's address; else no token.
- Runs as root: securityContext, resources, scheduling, postStart hooks and imagePullPolicy are
  ignored; preStop and the grace period only through `terminate_pod`. Needs root, as the bed does.
"""
from __future__ import annotations

import base64
import hashlib
import logging
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench.multihost import BIN, Bed, HostSpec

logger = logging.getLogger(__name__)

CHART = Path(__file__).resolve().parents[1] / "deploy" / "helm" / "pdserve"
REPO = CHART.parents[2]
# The bed's API keys (test keys, no secret): "bed" unlimited, which every bed client sends, and
# "tight", one request per 20 s, which a test exceeds.
BED_API_KEY, BED_TIGHT_KEY = "pdserve-bed-key", "pdserve-bed-tight-key"
BED_MAX_REQUEST_BYTES = 64 * 1024
# SmolLM2 in fp32 on CPU, 1 prefill + 1 decode instance, the release's Redis, 2 gateways.
BED_VALUES = {
    "spec": {"model": "smollm2", "dtype": "float32", "device": "cpu", "num_kv_blocks": 256, "num_threads": 1,
             "heartbeat_ttl_s": 3, "max_request_bytes": BED_MAX_REQUEST_BYTES,
             "drain_timeout_s": 8},  # a rollout (bench/chaos.py) lets some streams finish and ends others
    "redis": {"enabled": True},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
    "extraEnv": [{"name": "PDSERVE_FAILPOINTS", "value": "sigusr2"}],  # the chaos run's router_fault
    "gateway": {"replicas": 2, "preStopSeconds": 2, "apiKeys": {"keys": [
        {"name": "bed", "sha256": hashlib.sha256(BED_API_KEY.encode()).hexdigest()},
        {"name": "tight", "sha256": hashlib.sha256(BED_TIGHT_KEY.encode()).hexdigest(),
         "requests_per_second": 0.05, "burst": 1}]}},
}
BED_AUTH = {"Authorization": f"Bearer {BED_API_KEY}"}
STAGES = (("redis", "ray-head"), ("prefill", "decode", "worker"), ("controller",), ("gateway",))
SHORT = {"ray-head": "head", "controller": "ctl", "gateway": "gw", "prefill": "pf", "decode": "dc", "worker": "wk"}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
_VAR = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def _under_tmp(*paths: Path) -> list[Path]:
    """Of `paths`, those inside /tmp, relative to it, outermost only."""
    rel = sorted({p.resolve().relative_to("/tmp") for p in paths if p.resolve().is_relative_to("/tmp")})
    return [r for r in rel if not any(r != o and r.is_relative_to(o) for o in rel)]


def render_chart(values: dict | None, release: str, namespace: str, chart: Path = CHART) -> list[dict]:
    """Every object `helm template` renders (NOTES.txt and empty documents left out)."""
    import helm_python as helm
    with helm.Chart.load(chart) as loaded:
        texts = loaded.render(values, name=release, namespace=namespace)
    return [doc for path, text in texts.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def expand(text: str, env: dict[str, str]) -> str:
    """kubelet's `$(VAR)` expansion: defined variables replaced, others kept, `$$` -> `$`."""
    return _VAR.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def quantity_bytes(quantity) -> int:
    """A Kubernetes quantity ("1Gi", "512M", 1024) in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i|[kMGT])?", str(quantity))
    if m is None:
        raise ValueError(f"cannot read quantity {quantity!r}")
    return int(float(m[1]) * _UNITS.get(m[2], 1))


@dataclass
class Pod:
    name: str
    component: str
    template: dict  # the Deployment's pod template
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def container(self) -> dict:
        spec = self.template["spec"]
        if len(spec["containers"]) != 1 or spec.get("initContainers"):
            raise ValueError(f"pod {self.name}: one container and no init containers supported")
        return spec["containers"][0]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ChartPods:
    """The chart's pods on `bed` (see the module docstring). `down()` undoes everything this
    started or created and may be called any number of times; the bed itself stays."""

    def __init__(self, bed: Bed, values: dict | None = None, release: str = "pd", namespace: str = "default",
                 chart: Path = CHART):
        self.bed, self.release, self.namespace = bed, release, namespace
        self.objects = render_chart(values, release, namespace, chart)
        self._pods: dict[str, Pod] = {}
        self._made: list[Path] = []  # created on the shared filesystem: removed at down()
        self.kube_api = None  # a bench.bed_kube_api.BedKubeAPI: pods with a service account mount its token

    # -- the API ----------------------------------------------------------------------------------
    @property
    def pods(self) -> dict[str, str]:
        """Pod name -> component (`app.kubernetes.io/component`), in start order."""
        return {name: pod.component for name, pod in self._pods.items()}

    def address(self, name: str) -> str:
        return self.bed.address(name)

    def running(self, name: str) -> bool:
        """Whether the pod's container is running (not exited, not killed)."""
        return self._pods[name].running

    def url(self, name: str, port: str = "http") -> str:
        return f"http://{self.address(name)}:{self._port(self._pods[name], port)}"

    def up(self, timeout: float = 300.0) -> ChartPods:
        """Starts every Deployment's replicas stage by stage (STAGES), each stage's pods waited
        for before the next starts. Tears down and raises on failure or past `timeout`."""
        deadline = time.monotonic() + timeout
        try:
            for stage in self._stages():
                names = [self._create(d) for d in stage for _ in range(d["spec"].get("replicas", 1))]
                for name in names:
                    self.wait_ready(name, deadline - time.monotonic())
        except BaseException:
            self.down()
            raise
        return self

    def start_pod(self, component: str) -> str:
        """One more pod of the component's Deployment (a new name and address); returns its name."""
        (deployment,) = [d for d in self._deployments() if self._component(d["spec"]["template"]) == component]
        return self._create(deployment)

    def kill_pod(self, name: str) -> None:
        """SIGKILLs every process of the pod (its node died); Services stop resolving to it."""
        self.bed.kill_host(name)
        self._pods[name].proc = None
        self._write_hosts()

    def delete_pod(self, name: str) -> None:
        """The pod is gone (scaled down, evicted): killed, its host and hosts file removed."""
        hosts_dir = self._hosts_file(name).parent
        try:
            self.bed.remove_host(name)
        finally:
            shutil.rmtree(hosts_dir, ignore_errors=True)
            del self._pods[name]
            self._write_hosts()

    def terminate_pod(self, name: str) -> bool:
        """The end a rollout (or a scale-down) gives a pod, as kubelet does it: the container's
        preStop hook (exec) runs in the pod, then SIGTERM to the container's process, then SIGKILL
        of everything once terminationGracePeriodSeconds (counted from the start, the hook's time
        included) ran out. Returns whether the container exited within the grace period; if it
        did not, the caller kills the pod (`kill_pod`: kubelet's SIGKILL). Either way the pod is
        left exited, for a kubelet to start again (a new pod, in a rollout)."""
        pod = self._pods[name]
        grace = float(pod.template["spec"].get("terminationGracePeriodSeconds", 30))
        deadline = time.monotonic() + grace
        hook = pod.container.get("lifecycle", {}).get("preStop", {})
        if "exec" in hook:
            try:
                self.bed.run(name, hook["exec"]["command"], timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("pod %s: its preStop hook outlived the grace period", name)
        self.signal_pod(name, signal.SIGTERM)
        try:
            pod.proc.wait(max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            return False

    def signal_pod(self, name: str, sig: int) -> None:
        """Sends `sig` to the pod's container process (its command, not nsenter)."""
        self._pods[name].proc.send_signal(sig)

    def restart_pod(self, name: str) -> None:
        """The container starts again in the same pod: same address and volumes (but a Memory
        emptyDir, a tmpfs of the pod's mount namespace, starts empty), a fresh /tmp."""
        self.kill_pod(name)
        self.bed.restart_host(name)
        self._start(self._pods[name])

    def wait_ready(self, name: str, timeout: float) -> None:
        """Until the startup probe, then the readiness probe pass (those the pod declares);
        RuntimeError with the log's tail if the container exits, TimeoutError past `timeout`."""
        pod, deadline = self._pods[name], time.monotonic() + timeout
        pending = [k for k in ("startupProbe", "readinessProbe") if k in pod.container]
        while True:
            if not pod.running:
                raise RuntimeError(f"pod {name} exited ({pod.proc and pod.proc.poll()}):\n{self.bed.log_tail(name)}")
            if not pending:
                return
            if self.probe(name, pending[0]):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"pod {name}: {pending[0]} not passing:\n{self.bed.log_tail(name)}")
            time.sleep(min(1.0, pod.container[pending[0]].get("periodSeconds", 10)))

    def probes(self, name: str) -> list[str]:
        """The probes the pod's container declares."""
        return [k for k in PROBES if k in self._pods[name].container]

    def probe(self, name: str, kind: str) -> bool:
        """Runs the pod's `kind` probe once, as declared; whether it succeeded."""
        pod = self._pods[name]
        spec = pod.container[kind]
        timeout = spec.get("timeoutSeconds", 1)
        if "exec" in spec:
            argv = [expand(a, pod.env) for a in spec["exec"]["command"]]
            try:
                return self.bed.run(name, argv, timeout=timeout, env=pod.env, inherit_env=False).returncode == 0
            except (subprocess.TimeoutExpired, RuntimeError):
                return False
        check = spec.get("httpGet") or spec.get("tcpSocket")
        if check is None:
            raise NotImplementedError(f"{name} {kind}: only httpGet, tcpSocket and exec probes")
        host, port = check.get("host") or self.address(name), self._port(pod, check["port"])
        if "tcpSocket" in spec:
            try:
                socket.create_connection((host, port), timeout=timeout).close()
                return True
            except OSError:
                return False
        import httpx
        url = f"{check.get('scheme', 'HTTP').lower()}://{host}:{port}{check.get('path', '/')}"
        headers = {h["name"]: h["value"] for h in check.get("httpHeaders", [])}
        try:
            return 200 <= httpx.get(url, headers=headers, timeout=timeout, verify=False).status_code < 400
        except httpx.HTTPError:
            return False

    def down(self) -> None:
        """Removes every pod (its host included), hosts files and created mount points."""
        for name in reversed(list(self._pods)):
            try:
                self.delete_pod(name)
            except Exception:
                logger.exception("chart pods: removing %s", name)
        for path in reversed(self._made):
            try:
                path.rmdir()
            except OSError:
                logger.warning("chart pods: %s not empty, left in place", path)
        self._made.clear()

    # -- objects ----------------------------------------------------------------------------------
    def _deployments(self) -> list[dict]:
        return [o for o in self.objects if o["kind"] == "Deployment"]

    @staticmethod
    def _component(template: dict) -> str:
        return template["metadata"]["labels"]["app.kubernetes.io/component"]

    def _stages(self) -> list[list[dict]]:
        order = {c: i for i, stage in enumerate(STAGES) for c in stage}
        stages: dict[int, list[dict]] = {}
        for d in self._deployments():
            stages.setdefault(order.get(self._component(d["spec"]["template"]), len(STAGES)), []).append(d)
        return [stages[i] for i in sorted(stages)]

    def _data(self, kind: str, name: str) -> dict[str, bytes]:
        """A rendered Secret's or ConfigMap's data, decoded."""
        for o in self.objects:
            if o["kind"] == kind and o["metadata"]["name"] == name:
                encoded, plain = ("data", "stringData") if kind == "Secret" else ("binaryData", "data")
                data = {k: base64.b64decode(v) for k, v in (o.get(encoded) or {}).items()}
                return {**data, **{k: v.encode() for k, v in (o.get(plain) or {}).items()}}
        raise KeyError(f"{kind} {name} is not among the rendered objects")

    @staticmethod
    def _port(pod: Pod, port) -> int:
        if isinstance(port, int):
            return port
        for p in pod.container.get("ports", []):
            if p.get("name") == port:
                return p["containerPort"]
        raise KeyError(f"pod {pod.name} has no port named {port!r}")

    # -- one pod ----------------------------------------------------------------------------------
    def _create(self, deployment: dict) -> str:
        template = deployment["spec"]["template"]
        component = self._component(template)
        base = SHORT.get(component, re.sub(r"[^a-z0-9]", "", component)[:7])
        name = next(f"{base}{i}" for i in range(1, 1000) if f"{base}{i}" not in self.bed.hosts
                    and not (self.bed.dir / f"{base}{i}").exists())
        self.bed.add_host(HostSpec(name, "pod"))
        self._pods[name] = pod = Pod(name, component, template)
        self._start(pod)
        return name

    def _start(self, pod: Pod) -> None:
        """Mounts, hosts file, env; then the container's command in the (running) pod host."""
        c = pod.container
        pod.env = self._env(pod, c)
        scratch = self.bed.dir / pod.name / "tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        self._write_hosts()
        mounts = self._volume_mounts(pod, c) + [["mount", "--bind", str(self._hosts_file(pod.name)), "/etc/hosts"]]
        spec = pod.template["spec"]
        if self.kube_api is not None and spec.get("serviceAccountName") and spec.get("automountServiceAccountToken",
                                                                                     True):
            from bench.bed_kube_api import SERVICE_ACCOUNT_DIR
            source, env = self.kube_api.service_account(pod.name)
            self._make_dir(Path(SERVICE_ACCOUNT_DIR))
            mounts.append(["mount", "--bind", str(source), SERVICE_ACCOUNT_DIR])
            pod.env.update(env)
        for keep in _under_tmp(REPO, BIN.parent):  # the image's files (this checkout, its venv) stay in sight
            mounts += [["mkdir", "-p", str(scratch / keep)], ["mount", "--bind", str(Path("/tmp") / keep),
                                                               str(scratch / keep)]]
        mounts.append(["mount", "--rbind", str(scratch), "/tmp"])  # last: sources under /tmp
        script = "set -e; " + "; ".join(shlex.join(m) for m in mounts)
        out = self.bed.run(pod.name, ["sh", "-c", script], inherit_env=False)
        if out.returncode != 0:
            raise RuntimeError(f"pod {pod.name}: mounts failed: {out.stderr.strip()}")
        argv, workdir = self._argv(c, pod.env)
        logger.info("pod %s (%s) at %s: %s", pod.name, pod.component, self.address(pod.name), shlex.join(argv))
        # NOTE: not `nsenter --wd`, which opens the directory before entering the pod's mounts.
        chdir = ["sh", "-c", 'cd "$0" && exec "$@"', workdir]
        pod.proc = self.bed.popen(pod.name, chdir + argv, env=pod.env, inherit_env=False)
        self._write_hosts()

    def _env(self, pod: Pod, c: dict) -> dict[str, str]:
        if c.get("envFrom"):
            raise ValueError(f"pod {pod.name}: envFrom is not supported")
        fields = {"status.podIP": self.address(pod.name), "status.podIPs": self.address(pod.name),
                  "metadata.name": pod.name, "metadata.namespace": self.namespace}
        env: dict[str, str] = {}
        for e in c.get("env", []):
            source = e.get("valueFrom")
            if source is None:
                env[e["name"]] = expand(e.get("value", ""), env)
            elif "fieldRef" in source:
                env[e["name"]] = fields[source["fieldRef"]["fieldPath"]]
            else:
                ref, kind = (source["secretKeyRef"], "Secret") if "secretKeyRef" in source else \
                    (source["configMapKeyRef"], "ConfigMap")
                try:
                    env[e["name"]] = self._data(kind, ref["name"])[ref["key"]].decode()
                except KeyError:
                    if not ref.get("optional"):
                        raise
        return env

    def _argv(self, c: dict, env: dict[str, str]) -> tuple[list[str], str]:
        """(argv, working dir) of the container, as its image would run it."""
        args = [expand(a, env) for a in c.get("args", [])]
        redis = c["image"].rsplit("/", 1)[-1].split(":")[0] == "redis"
        if "command" in c:
            argv = [expand(a, env) for a in c["command"]] + args
        elif redis:  # docker-entrypoint.sh: no args, or flags first, means redis-server
            argv = ["redis-server", *args] if not args or args[0].startswith("-") or args[0].endswith(".conf") else args
        else:
            raise ValueError(f"container {c['name']}: the pdserve image has no default command")
        return argv, c.get("workingDir") or ("/data" if redis else str(REPO))

    def _volume_mounts(self, pod: Pod, c: dict) -> list[list[str]]:
        """The mount commands of the container's volumeMounts (run inside the pod)."""
        volumes = {v["name"]: v for v in pod.template["spec"].get("volumes", [])}
        commands = []
        for m in c.get("volumeMounts", []):
            if m.get("subPath") or m.get("subPathExpr"):
                raise ValueError(f"pod {pod.name}: subPath mounts are not supported")
            volume, target = volumes[m["name"]], m["mountPath"]
            self._make_dir(Path(target))
            empty = volume.get("emptyDir")
            if empty is not None and empty.get("medium") == "Memory":
                size = ["-o", f"size={quantity_bytes(empty['sizeLimit'])}"] if empty.get("sizeLimit") else []
                commands.append(["mount", "-t", "tmpfs", *size, "tmpfs", target])
            else:
                commands.append(["mount", "--bind", str(self._volume_dir(pod, volume)), target])
            if m.get("readOnly"):
                commands.append(["mount", "-o", "remount,bind,ro", target])
        return commands

    def _volume_dir(self, pod: Pod, volume: dict) -> Path:
        """The directory behind a configMap, secret or (disk) emptyDir volume."""
        path = self.bed.dir / pod.name / "volumes" / volume["name"]
        path.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in volume:
            return path
        source, kind = (volume["configMap"], "ConfigMap") if "configMap" in volume else (volume.get("secret"), "Secret")
        if source is None:
            raise ValueError(f"volume {volume['name']}: only configMap, secret and emptyDir volumes are supported")
        data = self._data(kind, source.get("name") or source["secretName"])
        for item in source.get("items") or [{"key": k, "path": k} for k in data]:
            (path / item["path"]).parent.mkdir(parents=True, exist_ok=True)
            (path / item["path"]).write_bytes(data[item["key"]])
            (path / item["path"]).chmod(item.get("mode", source.get("defaultMode", 0o644)))
        return path

    def _make_dir(self, path: Path) -> None:
        """Creates `path` (and parents) on the shared filesystem if missing; down() removes them."""
        missing = [p for p in (path, *path.parents) if not p.exists()]
        if missing:
            path.mkdir(parents=True)
            self._made += list(reversed(missing))  # parents first; removed deepest first

    # -- Services ---------------------------------------------------------------------------------
    def _hosts_file(self, name: str) -> Path:
        return Path("/etc/netns") / self.bed.hosts[name].link.netns / "hosts"

    def _service_addresses(self) -> dict[str, str]:
        """Service name -> the address of the first running pod it selects."""
        out = {}
        for svc in (o for o in self.objects if o["kind"] == "Service"):
            selector = svc["spec"].get("selector") or {}
            for pod in self._pods.values():
                if pod.running and selector.items() <= pod.template["metadata"]["labels"].items():
                    for p in svc["spec"]["ports"]:
                        if self._port(pod, p.get("targetPort", p["port"])) != p["port"]:
                            raise ValueError(f"Service {svc['metadata']['name']}: port {p['port']} != its target port "
                                             "(no virtual IPs here, a name resolves to a pod)")
                    out[svc["metadata"]["name"]] = self.address(pod.name)
                    break
        return out

    def _write_hosts(self) -> None:
        """Every pod's hosts file (rewritten in place: the bind mounts keep seeing it)."""
        ns = self.namespace
        services = [f"{ip} {s} {s}.{ns} {s}.{ns}.svc {s}.{ns}.svc.cluster.local"
                    for s, ip in self._service_addresses().items()]
        self._make_dir(Path("/etc/netns"))
        for name in self._pods:
            path = self._hosts_file(name)
            path.parent.mkdir(exist_ok=True)
            own = f"{self.address(name)} {name} {socket.gethostname()}"
            path.write_text("\n".join(["127.0.0.1 localhost", "::1 localhost ip6-localhost", own, *services]) + "\n")
