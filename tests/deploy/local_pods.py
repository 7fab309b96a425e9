"""Running rendered Kubernetes Deployments as local processes, exactly as their manifests say.

Owns turning one Deployment's container (its `command`, `args`, `env` and `envFrom`) into an argv
and an environment for a local process, with the few substitutions that stand in for the cluster:
- each pod gets local ports for its containerPorts (pods have their own network namespace; local
  processes share one), and an env value equal to one of them becomes the local port;
- a Service name with a port (`pdserve-router:8000`) becomes 127.0.0.1 and the local port
  of the containerPort the Service targets in the pod it selects; a headless Service (clusterIP
  None) stands for every pod it selects, as its DNS name does: `tcp://name:port` becomes the
  comma-separated list of their addresses (which `--router` takes as it takes such a name);
- `0.0.0.0` becomes 127.0.0.1 (the test binds loopback only);
- the downward API: `metadata.name` is the pod's name, `status.podIP` 127.0.0.1, a
  `resourceFieldRef` the container's request (rounded up by the divisor, as the kubelet does);
- a volume's mountPath at the start of a value becomes a local directory given by the caller;
- Secrets are given by the caller (a missing optional one is left out, as the kubelet does);
- `pdserve` (the image's console script) is `python -m common.cli`.
Anything else (an env source or a field it does not know) is an error, so the test cannot quietly
run something other than what the manifests say.

Used by tests/deploy/test_k8s_cluster.py.
"""

from __future__ import annotations

import math
import random
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Manifest = dict[str, Any]

POD_IP = "127.0.0.1"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A free port below the OS's ephemeral range: a worker binds it only once its model is
    loaded, and meanwhile a port from that range could go to anyone binding port 0."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    for _ in range(100):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{high}")


def find(objects: list[Manifest], kind: str, name: str) -> Manifest:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise KeyError(f"no {kind} {name} in the rendered manifests")


def pod_spec(deployment: Manifest) -> Manifest:
    return deployment["spec"]["template"]["spec"]


def main_container(deployment: Manifest) -> Manifest:
    (container,) = pod_spec(deployment)["containers"]
    return container


def named_port(container: Manifest, port: int | str) -> int:
    """A probe's or Service's port (a number or a containerPort's name) as a number."""
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise KeyError(f"container {container['name']} has no port named {port!r}")


def _quantity(value: str) -> float:
    """A Kubernetes quantity ('500m', '2', '1Gi') as a number."""
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    if m is None or m.group(2) not in ("", *units):
        raise ValueError(f"not a quantity: {value!r}")
    return float(m.group(1)) * units.get(m.group(2), 1)


@dataclass
class LocalPod:
    """One Deployment's pod as a local process: its name, local ports, argv and environment."""

    deployment: Manifest
    name: str
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> local port

    @classmethod
    def of(cls, deployment: Manifest, name: str) -> LocalPod:
        container = main_container(deployment)
        ports = {int(p["containerPort"]): free_port() for p in container.get("ports", [])}
        return cls(deployment, name, ports)

    @property
    def container(self) -> Manifest:
        return main_container(self.deployment)

    def local_port(self, port: int | str) -> int:
        return self.ports[named_port(self.container, port)]

    def argv(self) -> list[str]:
        argv = [*self.container.get("command", []), *self.container.get("args", [])]
        if not argv or argv[0] != "pdserve":
            raise ValueError(f"{self.name}: expected `pdserve ...`, got {argv}")
        return [sys.executable, "-m", "common.cli", *argv[1:]]

    def env(
        self,
        objects: list[Manifest],
        pods: dict[str, LocalPod],
        mounts: dict[str, Path],
        secrets: dict[str, dict[str, str]],
    ) -> dict[str, str]:
        """The container's environment as the kubelet would set it, then localised (see above).

        `pods`: every pod, by any key (to resolve Services); `mounts`: mountPath -> local
        directory; `secrets`: Secret name -> data."""
        raw: dict[str, str] = {}
        for source in self.container.get("envFrom", []):
            (kind,) = source
            if kind != "configMapRef":
                raise ValueError(f"{self.name}: envFrom {kind} not supported here")
            raw.update(find(objects, "ConfigMap", source[kind]["name"]).get("data", {}))
        for var in self.container.get("env", []):  # env wins over envFrom, as in Kubernetes
            value = self._env_value(var, objects, secrets)
            if value is not None:
                raw[var["name"]] = value
        for mount in self.container.get("volumeMounts", []):
            if mount["mountPath"] not in mounts:
                raise ValueError(f"{self.name}: no local directory for {mount['mountPath']}")
        return {k: self._localise(v, objects, pods, mounts) for k, v in raw.items()}

    def _env_value(
        self, var: Manifest, objects: list[Manifest], secrets: dict[str, dict[str, str]]
    ) -> str | None:
        if "value" in var:
            return str(var["value"])
        (kind,) = var["valueFrom"]
        ref = var["valueFrom"][kind]
        if kind == "configMapKeyRef":
            return find(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        if kind == "secretKeyRef":
            data = secrets.get(ref["name"])
            if data is None and ref.get("optional"):
                return None  # the kubelet leaves the variable unset
            return data[ref["key"]]
        if kind == "fieldRef":
            return {"metadata.name": self.name, "status.podIP": POD_IP}[ref["fieldPath"]]
        if kind == "resourceFieldRef":
            kind_, resource = ref["resource"].split(".", 1)
            amount = _quantity(self.container["resources"][kind_][resource])
            return str(math.ceil(amount / _quantity(ref.get("divisor", "1"))))
        raise ValueError(f"{self.name}: env source {kind} not supported here")

    def _localise(
        self,
        value: str,
        objects: list[Manifest],
        pods: dict[str, LocalPod],
        mounts: dict[str, Path],
    ) -> str:
        for mount_path, local in mounts.items():
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(local) + value[len(mount_path.rstrip("/")) :]
        if value == "0.0.0.0":
            return "127.0.0.1"
        if value.isdigit() and int(value) in self.ports:
            return str(self.ports[int(value)])

        def service(m: re.Match) -> str:
            scheme, name, number = m.group(1), m.group(2), int(m.group(3))
            svc = find(objects, "Service", name)
            port = next(p for p in svc["spec"]["ports"] if int(p["port"]) == number)
            target = port.get("targetPort", port["port"])
            chosen = _selected_pods(svc, pods)
            if svc["spec"].get("clusterIP") != "None":
                chosen = chosen[:1]  # one virtual address: any one pod behind it answers
            if len(chosen) > 1 and not scheme:
                raise ValueError(f"{self.name}: headless {name} in {value!r}: no list form known")
            prefix = f"{scheme}://" if scheme else ""
            return ",".join(f"{prefix}127.0.0.1:{p.local_port(target)}" for p in chosen)

        names = [o["metadata"]["name"] for o in objects if o["kind"] == "Service"]
        if not names:
            return value
        names.sort(key=len, reverse=True)  # the longest first: a name may start another
        pattern = r"\b(?:(\w+)://)?(" + "|".join(map(re.escape, names)) + r")(?:\.[\w.-]+)?:(\d+)\b"
        return re.sub(pattern, service, value)


def _selected_pods(service: Manifest, pods: dict[str, LocalPod]) -> list[LocalPod]:
    """The pods a Service's selector picks, in `pods`' order."""
    selector = service["spec"]["selector"]
    chosen = [
        p
        for p in pods.values()
        if selector.items() <= p.deployment["spec"]["template"]["metadata"]["labels"].items()
    ]
    if not chosen:
        raise ValueError(f"Service {service['metadata']['name']} selects no pod")
    return chosen
