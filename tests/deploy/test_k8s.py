"""deploy/k8s, checked without a cluster: schemas, wiring, probes, termination, autoscaling.

Renders the base, both overlays and the autoscaling kustomization (`kubectl kustomize` where
installed, else tests/deploy/kustomize.py; where kubectl is installed both renderings must agree),
validates every object against a current Kubernetes version's schemas (kubernetes-validate; the
ServiceMonitor is a CRD with no schema there and is checked structurally instead), and checks what
the deployment relies on: several routers, replaced one at a time and kept through node drains;
workers reach every router through the headless control Service, advertise their pod IP, are named
after their pod (which the prometheus-adapter rules rely on), have probes on the health endpoint,
and get a grace period that covers their drain; one cluster secret in every pod; adapter rules
that sum over routers only what each router counts itself.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from common.protocol import HEARTBEAT_INTERVAL_S
from tests.deploy import kustomize
from tests.deploy.local_pods import find, main_container, named_port, pod_spec
from tests.deploy.promql import (
    ADAPTER_VALUES,
    ROUTER_COUNTED,
    adapter_metric,
    adapter_rules,
    combined_over_routers,
    hpa_metrics,
    metric_names,
    queried_metrics,
)

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "autoscaling")
DEPLOYMENTS = ("router", "prefill", "decode")
WORKERS = ("prefill", "decode")
CRDS = {"ServiceMonitor": "a Prometheus Operator CRD: kubernetes-validate has no schema for it"}
DRAIN_GRACE_S = 2.5 * HEARTBEAT_INTERVAL_S  # common.runtime.worker: WorkerBase._drained
CONTROL_SERVICE = "pdserve-router-headless"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {k: kustomize.render(K8S / k) for k in KUSTOMIZATIONS}


def _key(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def deployment(objects: list[dict], stage: str) -> dict:
    return find(objects, "Deployment", f"pdserve-{stage}")


def env_of(objects: list[dict], stage: str) -> dict[str, dict]:
    """name -> the env entry (value or valueFrom); the ConfigMap's keys as {'value': ...}."""
    container = main_container(deployment(objects, stage))
    out = {}
    for source in container.get("envFrom", []):
        data = find(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
        out.update({k: {"value": v} for k, v in data.items()})
    out.update({e["name"]: e for e in container.get("env", [])})
    return out


# --- rendering and schemas -----------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_fallback_renderer_agrees_with_kubectl(name: str) -> None:
    ours = {_key(o): o for o in kustomize.render_fallback(K8S / name)}
    theirs = {_key(o): o for o in kustomize.render_kubectl(K8S / name)}
    assert ours.keys() == theirs.keys()
    for key, obj in theirs.items():
        assert ours[key] == obj, key


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_manifests_validate_against_kubernetes_schemas(name: str, rendered) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    from kubernetes_validate.utils import latest_version

    version = latest_version()
    assert tuple(map(int, version.split(".")[:2])) >= (1, 30)
    validated = 0
    for obj in rendered[name]:
        if obj["kind"] in CRDS:
            continue  # checked in test_servicemonitor_scrapes_the_router_http_port
        kv.validate(obj, version, strict=True)  # strict: unknown fields are errors too
        validated += 1
    assert validated > 0


def test_validator_catches_a_bad_manifest(rendered) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    from kubernetes_validate.utils import latest_version

    bad = deployment(rendered["base"], "decode")
    bad = kustomize.apply_json_patch(
        bad, [{"op": "add", "path": "/spec/template/spec/containers/0/prots", "value": []}]
    )
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, latest_version(), strict=True)


@pytest.mark.parametrize("name", ["base", "overlays/cpu", "overlays/gpu"])
def test_everything_in_one_namespace(name: str, rendered) -> None:
    for obj in rendered[name]:
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == "pdserve"
        else:
            assert obj["metadata"]["namespace"] == "pdserve", _key(obj)


# --- wiring --------------------------------------------------------------------------------------


def _selects(service: dict, dep: dict) -> bool:
    labels = dep["spec"]["template"]["metadata"]["labels"]
    return service["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("name", ["base", "overlays/cpu", "overlays/gpu"])
def test_workers_find_every_router_through_a_headless_service(name: str, rendered) -> None:
    objects = rendered[name]
    svc = find(objects, "Service", CONTROL_SERVICE)
    # Headless: the name resolves to every router pod (a ClusterIP would give a worker one router).
    assert svc["spec"]["clusterIP"] == "None"
    # A router is not ready until workers registered with it: they must reach it anyway.
    assert svc["spec"]["publishNotReadyAddresses"] is True
    router_dep = deployment(objects, "router")
    assert _selects(svc, router_dep)
    assert not any(_selects(svc, deployment(objects, stage)) for stage in WORKERS)
    (port,) = svc["spec"]["ports"]
    router = main_container(router_dep)
    target = named_port(router, port["targetPort"])
    assert env_of(objects, "router")["PDSERVE_CONTROL_PORT"]["value"] == str(target)
    assert env_of(objects, "router")["PDSERVE_CONTROL_HOST"]["value"] == "0.0.0.0"
    for stage in WORKERS:
        address = env_of(objects, stage)["PDSERVE_ROUTER"]["value"]
        assert address == f"tcp://{CONTROL_SERVICE}:{port['port']}", stage
    # No other Service carries the control port (the old ClusterIP pdserve-router-control is gone).
    control_services = [
        o["metadata"]["name"]
        for o in objects
        if o["kind"] == "Service" and any(p["port"] == port["port"] for p in o["spec"]["ports"])
    ]
    assert control_services == [CONTROL_SERVICE]
    # The API: a normal Service in front of every ready router.
    api = find(objects, "Service", "pdserve-router")
    assert "clusterIP" not in api["spec"] and _selects(api, router_dep)
    assert "publishNotReadyAddresses" not in api["spec"]  # clients only reach a ready router
    assert env_of(objects, "router")["PDSERVE_PORT"]["value"] == str(
        named_port(router, api["spec"]["ports"][0]["targetPort"])
    )


@pytest.mark.parametrize("name", ["base", "overlays/cpu", "overlays/gpu"])
def test_several_routers_replaced_one_at_a_time(name: str, rendered) -> None:
    objects = rendered[name]
    router = deployment(objects, "router")
    assert router["spec"]["replicas"] >= 2
    strategy = router["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    # A new router is ready (workers registered with it) before an old one stops.
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    # Ready means serving: /health is 200 only once a prefill and a decode worker registered.
    container = main_container(router)
    get = container["readinessProbe"]["httpGet"]
    assert get["path"] == "/health"
    assert named_port(container, get["port"]) == int(env_of(objects, "router")["PDSERVE_PORT"][
        "value"])  # fmt: skip
    # Liveness must not be /health: a router without workers is alive, just not ready.
    for probe in ("startupProbe", "livenessProbe"):
        assert "httpGet" not in container[probe] or container[probe]["httpGet"]["path"] != "/health"
    # Spread over nodes where it can be, so one node's loss leaves a router.
    (spread,) = pod_spec(router)["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"].items() <= router["spec"]["template"]["metadata"][
        "labels"].items()  # fmt: skip


def test_workers_named_after_their_pod_advertise_its_ip(rendered) -> None:
    objects = rendered["base"]
    for stage in WORKERS:
        ref = env_of(objects, stage)["PDSERVE_WORKER_ID"]["valueFrom"]["fieldRef"]
        assert ref["fieldPath"] == "metadata.name"  # the adapter maps worker= to the pod
        threads = env_of(objects, stage)["PDSERVE_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
        assert threads["resource"] == "requests.cpu"
        # Every worker's KV receiver is reachable pod to pod: decode workers take prompts' KV
        # there, and any worker serves and fetches cached prefixes there (peer fetch)
        kv = env_of(objects, stage)
        assert kv["PDSERVE_KV_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP"
        ), stage
        assert kv["PDSERVE_KV_HOST"]["value"] == "0.0.0.0", stage
        kv_port = int(kv["PDSERVE_KV_PORT"]["value"])
        assert kv_port in {p["containerPort"] for p in main_container(deployment(objects, stage))[
            "ports"]}, stage  # fmt: skip
    shared = env_of(objects, "prefill")
    assert shared["PDSERVE_KV_TRANSPORT"]["value"] == "tcp"  # pod to pod


@pytest.mark.parametrize("name", ["base", "overlays/cpu", "overlays/gpu"])
def test_every_pod_gets_the_cluster_secret(name: str, rendered) -> None:
    # One secret for every router replica and every worker: CURVE keys derive from it, and a
    # worker registers with every router.
    objects = rendered[name]
    seen = set()
    for stage in DEPLOYMENTS:
        spec = pod_spec(deployment(objects, stage))
        secret_path = env_of(objects, stage)["PDSERVE_CLUSTER_SECRET_FILE"]["value"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = main_container(deployment(objects, stage))["volumeMounts"]
        (mount,) = [m for m in mounts if secret_path.startswith(m["mountPath"] + "/")]
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == "pdserve-cluster-secret"
        seen.add((secret["secretName"], secret.get("items") is None, secret_path))
        assert secret_path.rsplit("/", 1)[1] == "secret"  # the key `kubectl create secret` sets
        assert secret["defaultMode"] & 0o007 == 0  # not world-readable
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]
    assert len(seen) == 1, seen  # the same Secret, whole, at the same path everywhere
    api_key = env_of(objects, "router")["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert api_key["optional"] is True


# --- probes, termination, resources --------------------------------------------------------------


@pytest.mark.parametrize("name", ["base", "overlays/cpu", "overlays/gpu"])
def test_probes_and_resources_everywhere(name: str, rendered) -> None:
    objects = rendered[name]
    for stage in DEPLOYMENTS:
        container = main_container(deployment(objects, stage))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe in container, (stage, probe)
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), stage
        assert "memory" in resources["limits"], stage
    for stage in WORKERS:
        container = main_container(deployment(objects, stage))
        env = env_of(objects, stage)
        health_port = int(env["PDSERVE_HEALTH_PORT"]["value"])
        assert env["PDSERVE_HEALTH_HOST"]["value"] == "0.0.0.0"  # the kubelet probes the pod IP
        paths = {}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            get = container[probe]["httpGet"]
            assert named_port(container, get["port"]) == health_port
            paths[probe] = get["path"]
        assert paths == {
            "startupProbe": "/healthz",
            "livenessProbe": "/healthz",
            "readinessProbe": "/readyz",
        }
    router = main_container(deployment(objects, "router"))
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"


def test_graceful_termination_covers_the_drain(rendered) -> None:
    objects = rendered["base"]
    config = find(objects, "ConfigMap", "pdserve-config")["data"]
    # A draining worker finishes what it has: requests live at most --request-timeout-s (decode),
    # a prefill job at most --prefill-deadline-s; plus the drain's own grace.
    bounds = {
        "decode": float(config["PDSERVE_REQUEST_TIMEOUT_S"]),
        "prefill": float(config["PDSERVE_PREFILL_DEADLINE_S"]),
    }
    for stage, bound in bounds.items():
        spec = pod_spec(deployment(objects, stage))
        assert spec["terminationGracePeriodSeconds"] >= bound + DRAIN_GRACE_S, stage
        # kubelet sends SIGTERM after preStop: a hook that signalled would make kubelet's the
        # second signal, which stops a worker without draining.
        assert "lifecycle" not in main_container(deployment(objects, stage)), stage
        strategy = deployment(objects, stage)["spec"]["strategy"]
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0, stage
    router = deployment(objects, "router")
    pre_stop = main_container(router)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod_spec(router)["terminationGracePeriodSeconds"] > float(pre_stop[1])


def _pdb_selects(pdb: dict, dep: dict) -> bool:
    labels = dep["spec"]["template"]["metadata"]["labels"]
    return pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_pod_disruption_budgets_select_their_stage(rendered) -> None:
    objects = rendered["base"]
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    names = sorted(p["metadata"]["name"] for p in pdbs)
    assert names == sorted(f"pdserve-{stage}" for stage in DEPLOYMENTS)
    for pdb in pdbs:  # each selects exactly its own Deployment's pods
        chosen = [s for s in DEPLOYMENTS if _pdb_selects(pdb, deployment(objects, s))]
        assert chosen == [pdb["metadata"]["name"].removeprefix("pdserve-")], chosen
    for stage in WORKERS:
        pdb = find(objects, "PodDisruptionBudget", f"pdserve-{stage}")
        assert pdb["spec"]["maxUnavailable"] == 1
    # Node drains leave a router serving, and can still evict one (replicas > minAvailable).
    router_pdb = find(objects, "PodDisruptionBudget", "pdserve-router")["spec"]
    assert router_pdb["minAvailable"] == 1 and "maxUnavailable" not in router_pdb
    assert deployment(objects, "router")["spec"]["replicas"] > router_pdb["minAvailable"]


def test_gpu_overlay(rendered) -> None:
    objects = rendered["overlays/gpu"]
    config = find(objects, "ConfigMap", "pdserve-config")["data"]
    model = config["PDSERVE_MODEL"]
    assert "PDSERVE_KV_CACHE_MEMORY" not in config
    for stage in DEPLOYMENTS:
        dep = deployment(objects, stage)
        spec = pod_spec(dep)
        assert "initContainers" not in spec  # the model comes from the volume
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "pdserve:cuda"
        mounts = main_container(dep)["volumeMounts"]
        (mount,) = [m for m in mounts if model.startswith(m["mountPath"] + "/")]
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        claim = volume["persistentVolumeClaim"]["claimName"]
        find(objects, "PersistentVolumeClaim", claim)
    for stage in WORKERS:
        resources = main_container(deployment(objects, stage))["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"]
        assert "nvidia.com/gpu" not in main_container(deployment(objects, "router"))["resources"][
            "limits"]  # fmt: skip


def test_cpu_overlay(rendered) -> None:
    objects = rendered["overlays/cpu"]
    for stage in WORKERS:
        spec = pod_spec(deployment(objects, stage))
        assert [c["command"] for c in spec["initContainers"]] == [
            ["pdserve", "models", "pull", "--quiet"]
        ]
        assert "nvidia.com/gpu" not in main_container(deployment(objects, stage))["resources"][
            "limits"]  # fmt: skip


# --- autoscaling ---------------------------------------------------------------------------------


def test_servicemonitor_scrapes_the_router_http_port(rendered) -> None:
    (monitor,) = [o for o in rendered["autoscaling"] if o["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selected = [
        s
        for s in rendered["base"]
        if s["kind"] == "Service"
        and monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["pdserve-router"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    # With an API key, /metrics must stay open to Prometheus.
    config = find(rendered["base"], "ConfigMap", "pdserve-config")["data"]
    assert config["PDSERVE_METRICS_WITHOUT_KEY"] == "true"


def test_hpas_scale_each_stage_on_an_adapter_metric(rendered) -> None:
    hpas = {o["metadata"]["name"]: o for o in rendered["autoscaling"] if o["kind"] == (
        "HorizontalPodAutoscaler")}  # fmt: skip
    assert set(hpas) == {"pdserve-prefill", "pdserve-decode"}
    for hpa in hpas.values():
        target = hpa["spec"]["scaleTargetRef"]
        find(rendered["base"], target["kind"], target["name"])
        assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])
        down = hpa["spec"]["behavior"]["scaleDown"]["policies"]
        assert all(p["value"] == 1 for p in down)  # drains one worker at a time
    served = {api: series for series, api in map(adapter_metric, adapter_rules())}
    by_hpa: dict[str, set[str]] = {}
    for hpa_name, metric in hpa_metrics():
        assert metric in served, f"{hpa_name}: no prometheus-adapter rule serves {metric}"
        by_hpa.setdefault(hpa_name, set()).add(served[metric])
    assert by_hpa["pdserve-prefill"] == {"pdserve:prefill_queued_tokens"}
    assert "pdserve:kv_cache_usage_perc" in by_hpa["pdserve-decode"]


def test_adapter_rules_map_the_worker_label_to_pods() -> None:
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert values["rules"]["default"] is False
    for rule in adapter_rules():
        assert rule["resources"]["overrides"]["worker"] == {"resource": "pod"}
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert placeholder in rule["metricsQuery"]
        series, api_name = adapter_metric(rule)
        assert series.startswith("pdserve:") and ":" not in api_name


def test_adapter_rules_combine_the_routers_copies_rightly() -> None:
    # Every router reports every worker. What a router counts itself (its own dispatches) adds
    # up over routers; what the worker reports in heartbeats is the same from each: taken once.
    for rule in adapter_rules():
        series, _ = adapter_metric(rule)
        query = rule["metricsQuery"].replace("<<.Series>>", series)
        expected = "sum" if series in ROUTER_COUNTED else "max"
        assert combined_over_routers(query, series) == expected, (series, query)


# --- PromQL --------------------------------------------------------------------------------------


def test_promql_metric_names() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(pdserve:ttft_bucket{worker=~"a|b",x="y"}'
        "[$__rate_interval]))) / on (worker) group_left sum without (code) "
        "(pdserve:errors_total offset 5m) > bool 1e3 and max_over_time(up[5m:1m])"
    )
    assert metric_names(expr) == {"pdserve:ttft_bucket", "pdserve:errors_total", "up"}


def test_queries_only_read_pdserve_metrics() -> None:
    queried = queried_metrics()
    assert len(queried) >= 20
    for name, where in queried.items():
        assert re.fullmatch(r"pdserve:[a-z0-9_]+", name), (name, where)
