"""deploy/k8s, offline: every overlay (and each component over the cpu overlay) renders with kustomize, what it
renders validates against the Kubernetes API schemas (kubernetes-validate, strict: unknown fields are errors),
and every pdserve command line in it parses with pdserve's own parsers into valid settings, under the
environment its container would have. Then what ties the objects together: the workers' --router names the
routers' headless Service, ports and probes name declared ports, budgets and autoscalers select real pods, the
autoscalers' metrics are served by the Prometheus adapter's rules.

No cluster is started (there is none on the CI machine); tests/deploy/test_two_routers.py runs the same
topology as processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.router_flags import router_config
from pdserve.worker.flags import worker_settings_from_args
from tests.deploy.kustomize import (
    K8S,
    Rendered,
    adapter_metric_names,
    container_env,
    kustomize_command,
    render,
)

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").exists())
# the oldest Kubernetes still supported upstream when this was written, and the newest the package knows
VERSIONS = ("1.31.0", kubernetes_validate.latest_version())

pytestmark = pytest.mark.skipif(kustomize_command() is None,
                                reason="kubectl (or kustomize) is not installed: nothing can render deploy/k8s")


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, Rendered]:
    return request.param, render(K8S / "overlays" / request.param)


def test_the_overlays_are_there() -> None:
    assert OVERLAYS == ["cpu", "dev", "gpu"] and COMPONENTS == ["autoscaling", "external-redis", "model-pvc"]


def test_every_overlay_renders_and_validates(overlay: tuple[str, Rendered]) -> None:
    _, rendered = overlay
    kinds = {o["kind"] for o in rendered.objects}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "Namespace"} <= kinds
    _validate(rendered)


@pytest.mark.parametrize("component", ["external-redis", "model-pvc"])
def test_each_component_over_the_cpu_overlay(component: str, tmp_path: Path) -> None:
    """The components no overlay includes, rendered over one that is (paths must be relative for kustomize)."""
    root = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [str(root / "overlays" / "cpu")], "components": [str(root / "components" / component)]}))
    rendered = render(tmp_path)
    _validate(rendered)
    if component == "external-redis":
        assert rendered.get("Deployment", "pdserve-redis") is None and rendered.get("Service", "pdserve-redis") is None
        for role in ("prefill", "decode"):
            worker = _container(rendered.deployment(f"pdserve-{role}"), "worker")
            [url] = [v for v in worker["env"] if v["name"] == "PDSERVE_REDIS_URL"]
            assert url["valueFrom"]["secretKeyRef"]["key"] == "redis-url"
    else:
        assert rendered.get("PersistentVolumeClaim", "pdserve-model-cache") is not None
        for deployment in ("pdserve-router", "pdserve-prefill", "pdserve-decode"):
            volumes = {v["name"]: v for v in rendered.deployment(deployment)["spec"]["template"]["spec"]["volumes"]}
            assert volumes["model-cache"] == {"name": "model-cache",
                                              "persistentVolumeClaim": {"claimName": "pdserve-model-cache"}}


def test_every_pdserve_command_line_parses_into_settings(overlay: tuple[str, Rendered], tmp_path: Path) -> None:
    _, rendered = overlay
    seen = set()
    for deployment, container in rendered.pdserve_containers():
        argv, env = container_env(rendered, deployment, container, tmp_path / deployment["metadata"]["name"])
        with mock.patch.dict(os.environ, env, clear=True):  # the environment the container's process sees
            args = build_parser().parse_args(argv)
        seen.add(args.command)
        if args.command == "router":
            config = router_config(args, "served-model", (), 8192, env.get("PDSERVE_SECRET"))
            assert config.secret and args.host == "0.0.0.0"
            assert int(args.port) == _port(container, "http")
        elif args.command in ("prefill", "decode"):
            settings = worker_settings_from_args(args, env.get("PDSERVE_CACHE_DIR"), env.get("PDSERVE_SECRET"))
            _check_worker(rendered, container, settings)
        else:
            assert argv == ["model", "fetch"] and env["PDSERVE_CACHE_DIR"] == "/cache"
    assert seen == {"router", "prefill", "decode", "model"}


def _check_worker(rendered: Rendered, container: dict[str, Any], settings: Any) -> None:
    server = settings.server
    assert server.drain_on_sigterm and server.secret and settings.tiers.redis_url
    assert (server.worker_id, server.advertise_host) == ("pdserve-prefill-5d8f7c9b4-x2x7q", "10.244.1.17")
    assert (server.port, server.data_port, settings.transfer.port) == (
        _port(container, "http"), _port(container, "data"), _port(container, "kv"))
    assert settings.cache_policy.redis_ttl_s == 86400  # read from the mounted cache-policy ConfigMap
    [router_url] = server.router_urls
    host, port = urlsplit(router_url).hostname, urlsplit(router_url).port
    service = rendered.get("Service", host)
    assert service is not None, f"--router {router_url}: no Service {host}"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert [p["port"] for p in service["spec"]["ports"]] == [port]
    router = _container(rendered.deployment("pdserve-router"), "router")
    assert _selects(service["spec"]["selector"], rendered.deployment("pdserve-router"))
    assert _port(router, "http") == port


def test_probes_budgets_and_autoscalers_point_at_real_things(overlay: tuple[str, Rendered]) -> None:
    name, rendered = overlay
    for deployment, container in rendered.pdserve_containers():
        if container["name"] == "model-fetch":
            continue
        ports = {p["name"] for p in container["ports"]}
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert {container[p]["httpGet"]["port"] for p in ("readinessProbe", "livenessProbe", "startupProbe")} <= ports
        if container["name"] == "worker":
            assert container["livenessProbe"]["httpGet"]["path"] == "/health"
            assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60  # the drain
    for budget in rendered.of_kind("PodDisruptionBudget"):
        matched = [d for d in rendered.of_kind("Deployment") if _selects(budget["spec"]["selector"]["matchLabels"], d)]
        assert [d["metadata"]["name"] for d in matched] == [budget["metadata"]["name"]]
    for service in rendered.of_kind("Service"):
        assert any(_selects(service["spec"]["selector"], d) for d in rendered.of_kind("Deployment"))
    autoscalers = rendered.of_kind("HorizontalPodAutoscaler")
    assert {a["metadata"]["name"] for a in autoscalers} == (set() if name == "dev" else {"pdserve-prefill",
                                                                                          "pdserve-decode"})
    served = adapter_metric_names()
    for hpa in autoscalers:
        assert rendered.deployment(hpa["spec"]["scaleTargetRef"]["name"])
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in served


def test_gpus_only_in_the_gpu_overlay(overlay: tuple[str, Rendered]) -> None:
    name, rendered = overlay
    for role in ("prefill", "decode"):
        worker = _container(rendered.deployment(f"pdserve-{role}"), "worker")
        gpus = worker.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus, worker["image"]) == ((1, "pdserve:gpu") if name == "gpu" else (None, "pdserve:cpu"))
    router = _container(rendered.deployment("pdserve-router"), "router")
    assert router["image"] == "pdserve:cpu" and "nvidia.com/gpu" not in str(router.get("resources"))


def test_secrets_come_from_the_dev_overlay_only(overlay: tuple[str, Rendered]) -> None:
    name, rendered = overlay
    secrets = [s["metadata"]["name"] for s in rendered.of_kind("Secret")]
    assert len(secrets) == (1 if name == "dev" else 0)  # cpu, gpu: created by the operator first
    for deployment, container in rendered.pdserve_containers():
        for var in container.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None and name == "dev":
                assert ref["name"] == secrets[0] and (rendered.secret_value(ref["name"], ref["key"]) is not None
                                                      or ref.get("optional"))
            elif ref is not None:
                assert ref["name"] == "pdserve-secrets"


def _validate(rendered: Rendered) -> None:
    errors = []
    for obj in rendered.objects:
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message} at {exc.path}")
    assert not errors, "\n".join(errors)


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def _selects(selector: dict[str, str], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())
