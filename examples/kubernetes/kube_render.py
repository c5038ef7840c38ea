"""The manifests of examples/kubernetes as Kustomize builds them, and as podman runs them here.

``python3 kube_render.py build DIR`` prints the resources of a Kustomize folder (DIR: a base or
an overlay); ``python3 kube_render.py podman DIR`` prints them as ``podman kube play`` runs them
on one machine (examples/kubernetes/e2e.sh). No kustomize binary is needed: ``build`` handles the
subset these folders use (``resources``, ``components``, and ``patches`` that are JSON patches
with a ``target``), and the tests validate what it prints (tests/static/test_kubernetes.py).

What ``podman`` changes, because podman 4.3 runs pods on one host and plays only Pods,
Deployments and ConfigMaps (docs/kubernetes.md, "What was tested here"):

- every pod uses the host's network (``hostNetwork``), so each binds its own loopback ports:
  a role's port + ``PORT_OFFSET`` + 10 x its instance, and the Services' names in the
  cluster file become those loopback addresses; containers list no ``ports`` (podman refuses
  port mappings on the host's network);
- no probes: podman 4.3 runs a liveness probe as a systemd healthcheck (there is no systemd
  here) and ignores the others and ``preStop``; e2e.sh runs the readiness probes' commands and
  the preStop hook itself, as the kubelet does;
- a StatefulSet of N becomes N one-pod Deployments, each given its pod's name
  (``zserve-backend-1``) as ``ZSERVE_INDEX``, as the StatefulSet's pod would have;
- the pod IP (``ZSERVE_ADVERTISE``) is 127.0.0.1 and the image ``localhost/zserve:dev``;
- optionally another scheduling policy (e2e.sh: ``POLICY``);
- Services, PodDisruptionBudgets and autoscalers are left out (nothing plays them here; the e2e
  script stands in for the Service: it sends to the ready frontends that are not terminating).
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]

PORT_OFFSET = 20000
IMAGE = "localhost/zserve:dev"
LOOPBACK = "127.0.0.1"
PODMAN_KINDS = {"ConfigMap", "Deployment", "StatefulSet"}


# --------------------------------------------------------------------------- kustomize subset


def load_docs(path: Path) -> list[Doc]:
    with path.open(encoding="utf-8") as stream:
        return [doc for doc in yaml.safe_load_all(stream) if doc]


def build(folder: Path) -> list[Doc]:
    """The resources of the Kustomization (or Component) in ``folder``, patches applied."""
    kustomization = load_docs(folder / "kustomization.yaml")[0]
    docs: list[Doc] = []
    for entry in kustomization.get("resources", []):
        target = folder / entry
        docs += build(target) if target.is_dir() else load_docs(target)
    for entry in kustomization.get("components", []):
        docs += build(folder / entry)
    for patch in kustomization.get("patches", []):
        operations = yaml.safe_load((folder / patch["path"]).read_text(encoding="utf-8"))
        matched = [doc for doc in docs if _targets(patch["target"], doc)]
        if len(matched) != 1:
            raise ValueError(f"{folder}: patch {patch['path']} matches {len(matched)} resources")
        apply_json_patch(matched[0], operations)
    return docs


def _targets(target: Doc, doc: Doc) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    wanted = {"group": group, "version": version, "kind": doc["kind"],
              "name": doc["metadata"]["name"]}
    return all(wanted[key] == value for key, value in target.items())


def apply_json_patch(doc: Doc, operations: list[Doc]) -> None:
    """RFC 6902 ``test``, ``replace``, ``add`` and ``remove``, in place."""
    for operation in operations:
        *parents, last = [part.replace("~1", "/").replace("~0", "~")
                          for part in operation["path"].split("/")[1:]]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(last) if isinstance(node, list) and last != "-" else last
        op = operation["op"]
        if op == "test" and node[key] != operation["value"]:
            raise ValueError(f"test failed at {operation['path']}: {node[key]!r}")
        if op == "replace":
            node[key] = operation["value"]
        elif op == "add" and isinstance(node, list):
            node.insert(len(node) if key == "-" else key, operation["value"])
        elif op == "add":
            node[key] = operation["value"]
        elif op == "remove":
            del node[key]


# --------------------------------------------------------------------------- podman variant


def podman_variant(docs: list[Doc], policy: str | None = None) -> list[Doc]:
    """The resources as podman runs them on this machine (the module docstring); ``policy``:
    the scheduling policy to run instead of the cluster file's."""
    out: list[Doc] = []
    for doc in docs:
        if doc["kind"] not in PODMAN_KINDS:
            continue
        if doc["kind"] == "ConfigMap":
            out.append(_loopback_config(doc, policy))
        elif doc["kind"] == "StatefulSet":
            out += [_one_pod(doc, i) for i in range(doc["spec"]["replicas"])]
        else:
            out.append(_one_pod(doc, None))
    return out


def _loopback_config(doc: Doc, policy: str | None) -> Doc:
    """The cluster file with each Service's address replaced by its loopback address (and
    ``policy`` as the scheduler's, if given)."""
    doc = copy.deepcopy(doc)

    def loopback(match: re.Match[str]) -> str:
        instance = 1 if match.group(1) == "b" else 0
        return f"tcp://{LOOPBACK}:{_port(int(match.group(2)), instance)}"

    for key, text in doc["data"].items():
        local = re.sub(r"tcp://zserve-scheduler-([ab]):(\d+)", loopback, text)
        if policy is not None:
            local = local.replace("[scheduler]\n", f'[scheduler]\npolicy = "{policy}"\n', 1)
        doc["data"][key] = local
    return doc


def _port(port: int, instance: int) -> int:
    return port + PORT_OFFSET + 10 * instance


def _one_pod(doc: Doc, instance: int | None) -> Doc:
    """A one-pod Deployment of ``doc``'s pod template (a StatefulSet's pod ``instance``)."""
    name = doc["metadata"]["name"]
    pod_name = name if instance is None else f"{name}-{instance}"
    template = copy.deepcopy(doc["spec"]["template"])
    template["metadata"]["labels"]["zserve/pod"] = pod_name
    spec = template["spec"]
    spec["hostNetwork"] = True
    for container in spec["containers"]:
        _localize(container, pod_name, 1 if name.endswith("-b") else instance or 0)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": pod_name, "labels": dict(doc["metadata"]["labels"])},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"zserve/pod": pod_name}},
            "template": template,
        },
    }


def _localize(container: Doc, pod_name: str, instance: int) -> None:
    """Loopback ports and addresses, the pod's name as its index, the local image."""
    container["image"] = IMAGE
    for env in container.get("env", []):
        if env["name"] == "ZSERVE_INDEX":
            env.pop("valueFrom", None)
            env["value"] = pod_name
        elif env["name"] == "ZSERVE_ADVERTISE":
            env.pop("valueFrom", None)
            env["value"] = LOOPBACK
        elif isinstance(env.get("value"), str) and "0.0.0.0:" in env["value"]:
            address, _, port = env["value"].rpartition(":")
            env["value"] = (address.replace("0.0.0.0", LOOPBACK) + ":"
                            + str(_port(int(port), instance)))
    # A host-network pod publishes nothing (podman refuses port mappings there): the ports
    # are what the roles bind; probes name them by number.
    container.pop("ports", None)
    # podman runs a liveness probe as a systemd healthcheck (no systemd here) and no other
    # probe or preStop hook: e2e.sh runs them itself, as the kubelet would.
    for field in ("startupProbe", "livenessProbe", "readinessProbe"):
        container.pop(field, None)


def main(argv: list[str]) -> int:
    if len(argv) not in {2, 3} or argv[0] not in {"build", "podman"}:
        print("usage: kube_render.py build|podman KUSTOMIZE_DIR [POLICY]", file=sys.stderr)
        return 2
    docs = build(Path(argv[1]))
    if argv[0] == "podman":
        docs = podman_variant(docs, argv[2] if len(argv) == 3 else None)
    yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
