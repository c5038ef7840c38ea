"""The Kubernetes manifests of examples/kubernetes, offline: every resource of every Kustomize
folder (as ``kube_render.py build`` assembles it) and of the podman variant that e2e.sh plays
validates strictly against the Kubernetes schemas (``kubernetes-validate``: an unknown or
misspelled field is an error), KEDA's ScaledObject against its CRD schema (vendored in
tests/static/schemas; jsonschema), and the wiring the roles rely on holds: probes, preStop,
keys, every ``ZSERVE_*`` variable a real flag of its role, the cluster file valid for zserve,
disruption budgets and autoscalers aimed at the right pods. The end-to-end run on podman is
examples/kubernetes/e2e.sh (minutes; not in this suite)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from zserve.backends.host import main as backend_main
from zserve.config.cluster import ClusterConfig, load_config
from zserve.frontend.host import main as frontend_main
from zserve.scheduler.shard_process import main as scheduler_main

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "kubernetes"
KEDA_SCHEMA = Path(__file__).with_name("schemas") / "keda-scaledobject-v1alpha1.json"
# The oldest Kubernetes these manifests claim (docs/kubernetes.md) and the newest the validator
# knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
KUSTOMIZE_DIRS = ("base", "overlays/gpu", "overlays/gpu-hpa", "overlays/cpu")
ADVICE_GAUGE = "zserve_autoscale_backends_advice"
# Variables of the image's scripts, not role flags (entrypoint.sh, prestop.sh, probe.sh).
SCRIPT_VARIABLES = {"ZSERVE_KEYS_FROM", "ZSERVE_PRESTOP_DELAY_S"}
ROLE_MAINS: dict[str, Callable[[list[str]], int]] = {
    "frontend": frontend_main, "scheduler": scheduler_main, "backend": backend_main}

Doc = dict[str, Any]


def _load_renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kube_render", EXAMPLES / "kube_render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kube_render = _load_renderer()


def rendered(folder: str) -> list[Doc]:
    return list(kube_render.build(EXAMPLES / folder))


def podman_docs() -> list[Doc]:
    return list(kube_render.podman_variant(rendered("overlays/cpu")))


def workloads(docs: list[Doc]) -> Iterator[tuple[Doc, Doc]]:
    """(workload, container) of every Deployment and StatefulSet."""
    for doc in docs:
        if doc["kind"] in {"Deployment", "StatefulSet"}:
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


def env_of(container: Doc) -> dict[str, Any]:
    return {env["name"]: env.get("value", env.get("valueFrom")) for env in container["env"]}


def validate(doc: Doc, version: str) -> None:
    if doc["apiVersion"].startswith("keda.sh/"):
        schema = json.loads(KEDA_SCHEMA.read_text())
        jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("folder", [*KUSTOMIZE_DIRS, "podman"])
def test_every_resource_validates_strictly(folder: str, version: str) -> None:
    docs = podman_docs() if folder == "podman" else rendered(folder)
    assert docs
    for doc in docs:
        validate(doc, version)


def test_the_validators_refuse_what_kubernetes_would() -> None:
    """The checks above can fail: a misspelled field, a wrong type, a ScaledObject without
    triggers or with an unknown metric type."""
    deployment = next(d for d in rendered("base") if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, KUBERNETES_VERSIONS[0])
    service = next(d for d in rendered("base") if d["kind"] == "Service")
    service["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(service, KUBERNETES_VERSIONS[0])
    scaled = next(d for d in rendered("overlays/gpu") if d["kind"] == "ScaledObject")
    for breakage in ({"triggers": None}, {"minReplicas": 1}):
        broken = json.loads(json.dumps(scaled))
        broken["spec"].update(breakage)
        if breakage.get("triggers", 0) is None:
            del broken["spec"]["triggers"]
        with pytest.raises(jsonschema.ValidationError):
            validate(broken, "")
    scaled["spec"]["triggers"][0]["metricType"] = "Average"
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled, "")


def test_every_role_has_probes_a_draining_prestop_and_its_keys() -> None:
    docs = rendered("overlays/gpu")
    for workload, container in workloads(docs):
        name = workload["metadata"]["name"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert probe in container, (name, probe)
        assert container["lifecycle"]["preStop"]["exec"]["command"] == ["zserve-prestop"]
        ready = container["readinessProbe"]
        if "frontend" in name:  # the OIP health endpoints
            assert ready["httpGet"]["path"] == "/v2/health/ready"
            assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        else:  # the probe files
            assert ready["exec"]["command"] == ["zserve-probe", "ready"]
            assert container["livenessProbe"]["exec"]["command"] == ["zserve-probe", "alive"]
        env = env_of(container)
        assert env["ZSERVE_KEYS_FROM"] == "/etc/zserve/keys"
        assert env["ZSERVE_ADVERTISE"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes["keys"]["secret"]["secretName"] == "zserve-keys"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["keys"] == env["ZSERVE_KEYS_FROM"]
        assert env["ZSERVE_CONFIG"].startswith(mounts["cluster"] + "/")
        # the grace period covers the preStop's delay and the drain
        delay = float(env.get("ZSERVE_PRESTOP_DELAY_S", 0))
        grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= delay + cluster_file(docs).drain_s + 5


def cluster_file(docs: list[Doc]) -> ClusterConfig:
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    return parse_toml(config_map["data"]["cluster.toml"])


def parse_toml(text: str) -> ClusterConfig:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cluster.toml"
        path.write_text(text)
        return load_config(path)


def test_each_variable_is_a_flag_of_its_role(capsys: pytest.CaptureFixture[str]) -> None:
    """A ``ZSERVE_<FLAG>`` that no flag reads would be ignored in silence."""
    for workload, container in workloads(rendered("overlays/gpu")):
        role = container["args"][1]
        with pytest.raises(SystemExit):
            ROLE_MAINS[role](["--help"])
        flags = set(re.findall(r"--([a-z][a-z-]*)", capsys.readouterr().out))
        for name in env_of(container):
            if name not in SCRIPT_VARIABLES:
                flag = name.removeprefix("ZSERVE_").lower().replace("_", "-")
                assert flag in flags, (workload["metadata"]["name"], name)


def test_the_cluster_files_are_valid_and_name_the_scheduler_services() -> None:
    gpu, cpu = cluster_file(rendered("overlays/gpu")), cluster_file(rendered("overlays/cpu"))
    services = {d["metadata"]["name"]: d for d in rendered("base") if d["kind"] == "Service"}
    for cluster in (gpu, cpu):
        scheduler = cluster.scheduler
        assert scheduler.standby and scheduler.shards == 0 and cluster.security.curve
        for address in (scheduler.rank_address, scheduler.standby_rank_address,
                        *scheduler.shard_addresses, scheduler.standby_shard_address):
            assert address is not None
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            assert int(port) in {p["port"] for p in services[host]["spec"]["ports"]}, address
    assert gpu.backends.device == "cuda" and cpu.backends.device == "cpu"
    podman = cluster_file(podman_docs())
    assert podman.scheduler.rank_address == "tcp://127.0.0.1:27100"
    assert podman.scheduler.standby_rank_address == "tcp://127.0.0.1:27110"
    assert podman.scheduler.policy == "deferred"  # the manifests' (the default)
    eager = kube_render.podman_variant(rendered("overlays/cpu"), "eager")
    assert cluster_file(eager).scheduler.policy == "eager"


def test_backends_ask_for_a_gpu_except_in_the_cpu_variant() -> None:
    for folder, gpus in (("overlays/gpu", 1), ("overlays/cpu", None)):
        backend = next(c for w, c in workloads(rendered(folder))
                       if w["metadata"]["name"] == "zserve-backend")
        assert backend["resources"]["limits"].get("nvidia.com/gpu") == gpus
        assert env_of(backend)["ZSERVE_DEVICE"] == ("cuda:0" if gpus else "cpu")


def test_budgets_services_and_autoscalers_select_the_right_pods() -> None:
    docs = rendered("overlays/gpu") + [d for d in rendered("overlays/gpu-hpa")
                                       if d["kind"] == "HorizontalPodAutoscaler"]
    pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"]
            for w, _ in workloads(docs)}

    def selected(selector: dict[str, str]) -> set[str]:
        return {name for name, labels in pods.items() if selector.items() <= labels.items()}

    for doc in docs:
        if doc["kind"] == "PodDisruptionBudget":
            assert len(selected(doc["spec"]["selector"]["matchLabels"])) >= 1
        elif doc["kind"] == "Service":
            assert selected(doc["spec"]["selector"]), doc["metadata"]["name"]
    assert selected({"zserve/scheduler": "a"}) == {"zserve-scheduler-a"}
    scalers = [d for d in docs if d["kind"] in {"ScaledObject", "HorizontalPodAutoscaler"}]
    assert {d["kind"] for d in scalers} == {"ScaledObject", "HorizontalPodAutoscaler"}
    for scaler in scalers:
        assert scaler["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "StatefulSet", "name": "zserve-backend"}
        assert ADVICE_GAUGE in json.dumps(scaler["spec"])


def test_the_cluster_files_export_the_advice_the_autoscalers_read() -> None:
    """The gauge KEDA and the HPA scale on exists only under ``[autoscale] enabled``; on
    Kubernetes they act (``act = false``: zserve starts no backend), and the advice's bounds are
    the scalers' replica bounds (an advice beyond them would not be followed)."""
    for folder in ("overlays/gpu", "overlays/gpu-hpa", "overlays/cpu"):
        docs = rendered(folder)
        autoscale = cluster_file(docs).autoscale
        assert autoscale.enabled and not autoscale.act, folder
        bounds = autoscale.bounds(cluster_file(docs).backends.total)
        for scaler in docs:
            if scaler["kind"] == "ScaledObject":
                replicas = (scaler["spec"]["minReplicaCount"], scaler["spec"]["maxReplicaCount"])
            elif scaler["kind"] == "HorizontalPodAutoscaler":
                replicas = (scaler["spec"]["minReplicas"], scaler["spec"]["maxReplicas"])
            else:
                continue
            assert bounds == replicas, (folder, bounds, replicas)
    assert cluster_file(podman_docs()).autoscale.enabled


def test_the_podman_variant_runs_one_pod_per_instance_on_loopback() -> None:
    docs = podman_docs()
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"]
    assert names == ["zserve-scheduler-a", "zserve-scheduler-b", "zserve-frontend-0",
                     "zserve-frontend-1", "zserve-backend-0", "zserve-backend-1"]
    for workload, container in workloads(docs):
        spec = workload["spec"]["template"]["spec"]
        assert spec["hostNetwork"] and "ports" not in container
        env = env_of(container)
        assert env["ZSERVE_ADVERTISE"] == "127.0.0.1"
        if "ZSERVE_INDEX" in env:
            assert env["ZSERVE_INDEX"] == workload["metadata"]["name"]
        for value in env.values():
            assert "0.0.0.0" not in str(value)
    http = {env_of(c).get("ZSERVE_HTTP") for _, c in workloads(docs)} - {None}
    assert http == {"127.0.0.1:28000", "127.0.0.1:28010"}


def test_the_json_patch_subset_fails_loudly() -> None:
    doc: Doc = {"a": {"b": [1, 2]}}
    kube_render.apply_json_patch(doc, [{"op": "add", "path": "/a/b/-", "value": 3},
                                       {"op": "replace", "path": "/a/b/0", "value": 0},
                                       {"op": "remove", "path": "/a/b/1"}])
    assert doc == {"a": {"b": [0, 3]}}
    with pytest.raises(ValueError, match="test failed"):
        kube_render.apply_json_patch(doc, [{"op": "test", "path": "/a/b/0", "value": 9}])


def test_the_container_recipe_takes_its_base_as_an_argument() -> None:
    recipe = (ROOT / "Containerfile").read_text()
    assert "ARG BASE=python:3.11-slim\nFROM ${BASE}" in recipe
    for script in re.findall(r"COPY (examples/kubernetes/\S+)", recipe):
        assert (ROOT / script).exists(), script
