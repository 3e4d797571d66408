"""deploy/, checked offline: the Kubernetes manifests against pinned schemas and against the node's own flags, the
Grafana dashboard's queries against the metric families a node exports, the images' health checks.

Manifests. The base (deploy/kubernetes) is read by Python from the files its kustomization.yaml lists (it has
nothing but ``resources``, which the loader checks), so its validation needs no kubectl. Where kubectl is
installed, its kustomize rendering of the base must be those same objects, and every overlay's rendering is
validated too; without kubectl that test is skipped with its reason, or fails if P2PNODE_REQUIRE_KUBECTL is set
(CI machines have kubectl). Schemas are the vendored files in deploy/schemas (their README says where each came
from): Kubernetes v1.31.0's strict JSON schemas for core/apps/policy objects, the prometheus-operator PodMonitor
schema for the PodMonitor, made strict here as the API server's strict field validation is.

Dashboard. A panel's query may name only series a node exposes: ``p2pnode:*`` sample names from a MeshMetrics
exposition built here (counters end in _total, histograms in _bucket/_sum/_count: the sample names Prometheus
stores), ``vllm:*`` ones from the metric constructors in the installed vLLM's own source (vllm/v1/metrics/*.py,
parsed, not imported: building its PrometheusStatLogger needs a whole VllmConfig, i.e. a model), with
prometheus_client's suffixes added.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from referencing import Registry, Resource

from p2pnode import config as cfg
from p2pnode.api.metrics import MeshMetrics
from p2pnode.cli import build_parser
from p2pnode.serving.ingress import RequestCounters
from p2pnode.v1 import node_pb2

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "kubernetes"
OVERLAYS = sorted(p for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
SCHEMAS = DEPLOY / "schemas"
K8S_SCHEMAS = SCHEMAS / "kubernetes" / "v1.31.0-local-strict"
#: The $id of the Kubernetes definitions every kind's schema refers to ("/api/_definitions.json#/$defs/...").
K8S_DEFINITIONS = "https://kubernetes.io/api/_definitions.json"
SCHEMA_FILES = {
    ("apps/v1", "StatefulSet"): K8S_SCHEMAS / "statefulset-apps-v1.json",
    ("v1", "Service"): K8S_SCHEMAS / "service-v1.json",
    ("v1", "PersistentVolumeClaim"): K8S_SCHEMAS / "persistentvolumeclaim-v1.json",
    ("v1", "Namespace"): K8S_SCHEMAS / "namespace-v1.json",
    ("policy/v1", "PodDisruptionBudget"): K8S_SCHEMAS / "poddisruptionbudget-policy-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): SCHEMAS / "monitoring.coreos.com" / "podmonitor-v1.json",
}
CRDS = {("monitoring.coreos.com/v1", "PodMonitor")}
DASHBOARD = DEPLOY / "grafana" / "p2pnode.json"
#: Families the dashboard must show (deploy/README.md lists its panels).
DASHBOARD_FAMILIES = {
    "p2pnode:requests_total", "p2pnode:routed_requests_total",
    "p2pnode:time_to_first_token_seconds_bucket", "p2pnode:e2e_request_latency_seconds_bucket",
    "p2pnode:routing_estimated_cached_tokens_total", "p2pnode:engine_cached_tokens_total",
    "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
    "p2pnode:gossip_sent_bytes_total", "p2pnode:gossip_received_bytes_total", "p2pnode:members",
    "p2pnode:plan_warm_keys", "p2pnode:kv_pulls_total", "p2pnode:kv_pull_bytes_total",
    "p2pnode:kv_pull_seconds_bucket",
}


# --- manifests -------------------------------------------------------------------------------------------------


def load_kustomization(directory: Path) -> list[dict[str, Any]]:
    """The objects of a kustomization that only lists resources (files or such kustomizations), as kustomize
    would render them. Anything else in it (patches, labels, namespace...) needs kustomize: refused here."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    extra = set(k) - {"apiVersion", "kind", "resources"}
    assert not extra, f"{directory}/kustomization.yaml uses {sorted(extra)}: the base keeps to `resources`"
    objects = []
    for entry in k["resources"]:
        path = directory / entry
        if path.is_dir():
            objects += load_kustomization(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return objects


#: Without kubectl the rendering test skips -- except where P2PNODE_REQUIRE_KUBECTL is set (.ci/run sets it, and the
#: machine CI runs on has kubectl), where ``kustomize`` fails instead: CI never skips it.
KUBECTL_MISSING = (
    "kubectl is not installed: the base was still validated from its files (test_base_validates); install kubectl "
    ">= 1.27 to check kustomize's rendering and the overlays"
)
needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None and not os.environ.get("P2PNODE_REQUIRE_KUBECTL"), reason=KUBECTL_MISSING
)


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY``'s objects (offline: it only reads the directory)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(KUBECTL_MISSING)
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]


def _strict(schema: Any) -> Any:
    """A CRD schema as strict field validation applies it: no field beyond those listed, unless the schema says
    x-kubernetes-preserve-unknown-fields; the ObjectMeta reference pointed at the Kubernetes definitions."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
        out["$ref"] = f"{K8S_DEFINITIONS}#/$defs/{ref.removeprefix('#/components/schemas/')}"
    if "properties" in out:
        out["properties"] = {name: _strict(s) for name, s in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_strict(s) for s in out[key]]
    return out


@cache
def _registry() -> Registry:
    definitions = json.loads((K8S_SCHEMAS / "_definitions.json").read_text())
    return Registry().with_resource(K8S_DEFINITIONS, Resource.from_contents(definitions))


@cache
def validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    path = SCHEMA_FILES.get((api_version, kind))
    assert path is not None, (
        f"no pinned schema for {api_version} {kind}: vendor it under deploy/schemas (see its README) and add it to "
        "SCHEMA_FILES"
    )
    schema = json.loads(path.read_text())
    if (api_version, kind) in CRDS:
        schema = _strict(schema)
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """Every way OBJ breaks its pinned schema, one line each (empty: valid)."""
    if not isinstance(obj, dict) or "apiVersion" not in obj or "kind" not in obj:
        return [f"not a Kubernetes object: {str(obj)[:80]}"]
    name = f"{obj['kind']}/{obj.get('metadata', {}).get('name', '?')}"
    try:
        v = validator(obj["apiVersion"], obj["kind"])
    except AssertionError as e:
        return [f"{name}: {e}"]
    return [
        f"{name}: {'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(v.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    ]


@cache
def base_objects() -> tuple[dict[str, Any], ...]:
    return tuple(load_kustomization(BASE))


def by_kind(objects: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_vendored_schemas_match_their_recorded_digests() -> None:
    readme = (SCHEMAS / "README.md").read_text()
    files = [*K8S_SCHEMAS.iterdir(), *(SCHEMAS / "monitoring.coreos.com").iterdir()]
    assert set(files) >= set(SCHEMA_FILES.values())
    for path in files:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"`{digest}`" in readme, f"{path.relative_to(ROOT)}: SHA-256 {digest} is not the one in its README"


def test_base_validates() -> None:
    objects = base_objects()
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["PersistentVolumeClaim", "PodDisruptionBudget", "PodMonitor", "Service", "Service",
                     "StatefulSet"]
    errors = [line for obj in objects for line in schema_errors(obj)]
    assert not errors, "\n".join(errors)


@needs_kubectl
def test_kustomize_renders_the_base_as_its_files_and_every_overlay_validates() -> None:
    def canonical(objects: Any) -> list[str]:
        return sorted(json.dumps(o, sort_keys=True) for o in objects)

    rendered = kustomize(BASE)
    assert canonical(rendered) == canonical(base_objects()), (
        "kubectl kustomize deploy/kubernetes differs from the files it lists (YAML read differently?)"
    )
    assert OVERLAYS, "deploy/overlays has no example"
    for overlay in OVERLAYS:
        objects = kustomize(overlay)
        errors = [line for obj in objects for line in schema_errors(obj)]
        assert not errors, f"{overlay.relative_to(ROOT)}:\n" + "\n".join(errors)
        sts = by_kind(objects)[("StatefulSet", "p2pnode")]
        check_node_pods(sts, objects)  # the overlay keeps the wiring


def _mutations() -> Iterator[tuple[str, str, Any]]:
    """(object, what is broken, a function that breaks it): each must be caught by the schemas."""

    def container(o: dict[str, Any]) -> dict[str, Any]:
        return o["spec"]["template"]["spec"]["containers"][0]

    def misspell(d: dict[str, Any], key: str, wrong: str) -> None:
        d[wrong] = d.pop(key)

    yield "StatefulSet", "a misspelled probe field", lambda o: misspell(container(o), "readinessProbe",
                                                                          "readinesProbe")
    yield "StatefulSet", "a misspelled field deep in a probe", lambda o: misspell(
        container(o)["livenessProbe"]["httpGet"], "path", "paht")
    yield "StatefulSet", "replicas as a string", lambda o: o["spec"].__setitem__("replicas", "3")
    yield "StatefulSet", "a port number as a string", lambda o: container(o)["ports"][0].__setitem__(
        "containerPort", "50051")
    yield "StatefulSet", "args as one string", lambda o: container(o).__setitem__("args", "--model=/m")
    yield "Service", "a misspelled spec field", lambda o: misspell(o["spec"], "selector", "selecter")
    yield "PodDisruptionBudget", "a field of another kind", lambda o: o["spec"].__setitem__("replicas", 1)
    yield "PodMonitor", "a misspelled endpoint field", lambda o: misspell(o["spec"]["podMetricsEndpoints"][0],
                                                                          "path", "metricsPath")
    yield "PodMonitor", "a misspelled spec field", lambda o: misspell(o["spec"], "podMetricsEndpoints",
                                                                      "podMetricEndpoints")
    yield "PodMonitor", "an interval as a number", lambda o: o["spec"]["podMetricsEndpoints"][0].__setitem__(
        "interval", 15)
    yield "PodMonitor", "an unknown relabel action", lambda o: o["spec"]["podMetricsEndpoints"][0][
        "relabelings"][0].__setitem__("action", "rename")
    yield "PodMonitor", "a misspelled metadata field", lambda o: misspell(o["metadata"], "labels", "label")
    yield "PersistentVolumeClaim", "access modes as a string", lambda o: o["spec"].__setitem__(
        "accessModes", "ReadWriteMany")


@pytest.mark.parametrize(("kind", "what", "mutate"), list(_mutations()), ids=lambda x: x if isinstance(x, str)
                         else "")
def test_schemas_catch_broken_manifests(kind: str, what: str, mutate: Any) -> None:
    obj = copy.deepcopy(next(o for o in base_objects() if o["kind"] == kind))
    assert not schema_errors(obj)
    mutate(obj)
    assert schema_errors(obj), f"{kind} with {what} passed validation"


def test_an_object_without_a_pinned_schema_is_an_error() -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
    (error,) = schema_errors(cm)
    assert "no pinned schema for v1 ConfigMap" in error


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def check_node_pods(sts: dict[str, Any], objects: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> None:
    """The StatefulSet runs `p2pnode serve` as the node expects, and the Services, probes, PDB and PodMonitor
    point at what it serves."""
    objs = by_kind(objects)
    pod = sts["spec"]["template"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    labels = pod["metadata"]["labels"]
    selector = sts["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    name, namespace = f"{sts['metadata']['name']}-7", "ns"
    env = {"POD_NAME": name, "POD_NAMESPACE": namespace}
    field_refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    assert field_refs == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    # The node's own parser takes the args (a misspelled flag fails here).
    argv = ["serve", *(_expand(a, env) for a in c["args"])]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"p2pnode serve refuses the StatefulSet's args (its error is above): {argv}") from None
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    grpc_port, http_port = ports["grpc"], ports["http"]
    assert args.listen == f"0.0.0.0:{grpc_port}"
    assert args.http_listen in (None, f"0.0.0.0:{http_port}")
    assert cfg.derived_http_listen(args.listen) == f"0.0.0.0:{http_port}"  # the image's default pairing too
    # Identity and seeds: the pod's stable DNS name through the headless Service.
    headless = objs[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True  # seeds resolve before any node is ready
    assert headless["spec"]["selector"].items() <= labels.items()

    def dns(pod_name: str) -> str:
        return f"{pod_name}.{headless['metadata']['name']}.{namespace}.svc.cluster.local:{grpc_port}"

    assert args.node_id == name
    assert args.advertise == dns(name)
    seeds = args.seeds.split(",")
    pods = {dns(f"{sts['metadata']['name']}-{i}") for i in range(sts["spec"]["replicas"])}
    assert set(seeds) <= pods, f"seeds {sorted(set(seeds) - pods)} are not the DNS names of the StatefulSet's pods"
    assert len(seeds) >= 2 and sts["spec"]["replicas"] >= 2  # a seed left for every node, seeds included
    # The cluster secret, from a Secret mounted as a file.
    secret_mounts = [m for m in c["volumeMounts"] if Path(m["mountPath"]) == args.cluster_secret_file.parent]
    (mount,) = secret_mounts
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] and {i["path"] for i in volume["secret"]["items"]} == {
        args.cluster_secret_file.name}
    # The model is mounted where --model says, read-only.
    (model_mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(args.model)]
    assert model_mount["readOnly"] is True
    # Probes on the HTTP port: readiness /ready, liveness and startup /health; startup allows a long load.
    probes = {kind: c[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {kind: (p["path"], ports.get(p["port"], p["port"])) for kind, p in probes.items()} == {
        "startupProbe": ("/health", http_port), "livenessProbe": ("/health", http_port),
        "readinessProbe": ("/ready", http_port)}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    # SIGTERM drain: the grace period outlasts the preStop pause, the drain and the engine's shutdown.
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    pause = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    assert spec["terminationGracePeriodSeconds"] >= pause + args.drain_timeout + 30
    assert args.drain_timeout == cfg.DEFAULT_DRAIN_TIMEOUT_S
    # One GPU, memory bounded.
    resources = c["resources"]
    assert str(resources["limits"]["nvidia.com/gpu"]) == "1" and "memory" in resources["limits"]
    assert {"cpu", "memory"} <= set(resources["requests"])
    # Clients, disruptions and metrics select these pods and name their ports.
    api = [o for (kind, _), o in objs.items() if kind == "Service" and o is not headless]
    assert api and all(s["spec"]["selector"].items() <= labels.items() for s in api)
    for service in (headless, *api):
        for p in service["spec"]["ports"]:
            assert ports[p["targetPort"]] == p["port"], (service["metadata"]["name"], p)
    (pdb,) = [o for (kind, _), o in objs.items() if kind == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (monitor,) = [o for (kind, _), o in objs.items() if kind == "PodMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert ports[endpoint["port"]] == http_port and endpoint["path"] == "/metrics"


def test_node_pods_are_wired_to_the_node() -> None:
    objects = base_objects()
    check_node_pods(by_kind(objects)[("StatefulSet", "p2pnode")], objects)


# --- dashboard -------------------------------------------------------------------------------------------------


def p2pnode_sample_names() -> set[str]:
    """Sample names of every p2pnode:* family, from a MeshMetrics whose status fills every optional family."""
    status = node_pb2.NodeStatus()
    status.eviction.policy, status.eviction.active = "adaptive", "lru"
    status.eviction.shadow_hit_rates["lru"] = 0.5
    status.kv.exports["ok"] = 1
    metrics = MeshMetrics(lambda: status, RequestCounters())
    text = generate_latest(metrics.registry).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "p2pnode:requests_total" in names and "p2pnode:kv_exports_total" in names
    return names


def vllm_sample_names() -> set[str]:
    """Sample names of the vllm:* families the installed vLLM defines (vllm/v1/metrics/*.py, parsed)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vllm is not installed: the dashboard's vllm:* queries are checked against its source "
                    "(scripts/bootstrap.sh installs it)")
    metrics_dir = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics"
    kinds = {"gauge": ["{}"], "counter": ["{}_total", "{}_created"],
             "histogram": ["{}_bucket", "{}_sum", "{}_count", "{}_created"]}
    names: set[str] = set()
    for path in sorted(metrics_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")).lower()
            kind = next((k for k in kinds if k in called), None)
            name = next((kw.value.value for kw in node.keywords if kw.arg == "name"
                         and isinstance(kw.value, ast.Constant)), None)
            if kind is None or not isinstance(name, str) or not name.startswith("vllm:"):
                continue
            if kind == "counter":
                name = name.removesuffix("_total")  # prometheus_client's own rule
            names.update(pattern.format(name) for pattern in kinds[kind])
    assert {"vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total"} <= names, metrics_dir
    return names


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_METRIC = re.compile(r"(?<![\w:])((?:p2pnode|vllm):[A-Za-z0-9_:]+)")


def query_metrics(expr: str) -> set[str]:
    """The p2pnode:* and vllm:* series a PromQL expression names (label values and strings left out)."""
    return set(_METRIC.findall(_STRING.sub('""', expr)))


def _balanced(expr: str) -> bool:
    stack: list[str] = []
    for ch in _STRING.sub('""', expr):
        if ch in "([{":
            stack.append({"(": ")", "[": "]", "{": "}"}[ch])
        elif ch in ")]}" and (not stack or stack.pop() != ch):
            return False
    return not stack


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def test_query_metrics_parses_promql() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, instance) (rate(p2pnode:time_to_first_token_seconds_bucket'
            '{instance=~"$instance", path="vllm:x"}[$__rate_interval]))) / on() vllm:kv_cache_usage_perc[5m:1m]')
    assert query_metrics(expr) == {"p2pnode:time_to_first_token_seconds_bucket", "vllm:kv_cache_usage_perc"}
    assert _balanced(expr) and not _balanced("sum(rate(x[1m])") and not _balanced("max(x{a=\"b\")}")


def test_dashboard_queries_name_families_a_node_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = p2pnode_sample_names() | vllm_sample_names()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    used: set[str] = set()
    for panel in panels(dashboard):
        if panel["type"] in ("row", "text"):
            continue
        exprs = [t["expr"] for t in panel.get("targets", [])]
        assert exprs, f"panel {panel['title']!r} has no query"
        for expr in exprs:
            assert _balanced(expr), f"panel {panel['title']!r}: unbalanced brackets in {expr!r}"
            names = query_metrics(expr)
            assert names, f"panel {panel['title']!r}: {expr!r} names no p2pnode:* or vllm:* series"
            unknown = names - exported
            assert not unknown, f"panel {panel['title']!r}: {sorted(unknown)} not exported by a node ({expr!r})"
            used |= names
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    missing = DASHBOARD_FAMILIES - used
    assert not missing, f"the dashboard shows none of {sorted(missing)}"


def test_dashboard_catches_a_wrong_family_name() -> None:
    exported = p2pnode_sample_names() | vllm_sample_names()
    for wrong in ("rate(p2pnode:requests[1m])",  # a counter without its _total
                  "histogram_quantile(0.5, rate(p2pnode:time_to_first_token_seconds[1m]))",  # no _bucket
                  "vllm:gpu_cache_usage_perc",  # vLLM v0's name
                  "vllm:prefix_cache_hit_total"):
        assert query_metrics(wrong) - exported, wrong


# --- images ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_images_check_health_on_the_http_port(dockerfile: str) -> None:
    text = (ROOT / "docker" / dockerfile).read_text()
    (check,) = re.findall(r"^HEALTHCHECK .*?(?<!\\)$", text, flags=re.M | re.S)
    assert "/health" in check and "P2PNODE_HTTP_PORT" in check
    (exposed,) = re.findall(r"^EXPOSE (\d+) (\d+)$", text, flags=re.M)
    default_port = re.search(r"^ENV P2PNODE_HTTP_PORT=(\d+)", text, flags=re.M)
    assert default_port is not None, "the health check's port needs a default"
    assert cfg.derived_http_listen(f"0.0.0.0:{exposed[0]}") == f"0.0.0.0:{default_port.group(1)}" == \
        f"0.0.0.0:{exposed[1]}"


def test_compose_health_checks_each_nodes_http_port() -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    image_default = re.search(r"^ENV P2PNODE_HTTP_PORT=(\d+)", (ROOT / "docker" / "Dockerfile.cpu").read_text(),
                              flags=re.M)
    assert image_default is not None
    for name, service in compose["services"].items():
        command = service["command"]
        listen = command[command.index("--listen") + 1]
        port = service.get("environment", {}).get("P2PNODE_HTTP_PORT", image_default.group(1))
        assert cfg.derived_http_listen(listen).rsplit(":", 1)[1] == str(port), name


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".git", "models", "results", "docker/secrets"} <= ignored
