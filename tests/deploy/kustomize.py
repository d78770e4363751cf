"""deploy/k8s rendered by `kubectl kustomize`, and the pdserve processes its containers would start.

`render(dir)` runs kustomize (kubectl's, or a standalone `kustomize`) and returns the objects. `Rendered` finds
objects by kind and name, and `container_env` rebuilds what a container's process would see: its `env` over its
`envFrom` ConfigMaps, Secrets from the render when it has them (overlays/dev) or placeholders, downward-API
fields as a pod would have them, and every ConfigMap volume written under a local folder, the mount paths in
argv and env rewritten to it.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
POD_FIELDS = {"metadata.name": "pdserve-prefill-5d8f7c9b4-x2x7q", "status.podIP": "10.244.1.17",
              "metadata.namespace": "pdserve", "spec.nodeName": "node-1"}
SECRET_KEYS = ("internal-secret", "admin-token", "api-key", "redis-url")  # deploy/k8s/base/kustomization.yaml


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(directory: Path) -> Rendered:
    command = kustomize_command()
    if command is None:
        raise FileNotFoundError("neither kubectl nor kustomize is on PATH")
    result = subprocess.run([*command, str(directory)], check=False, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} {directory} failed:\n{result.stderr}")
    return Rendered([doc for doc in yaml.safe_load_all(result.stdout) if doc])


@dataclass
class Rendered:
    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((o for o in self.of_kind(kind) if o["metadata"]["name"] == name), None)

    def deployment(self, name: str) -> dict[str, Any]:
        found = self.get("Deployment", name)
        assert found is not None, f"no Deployment {name}: {[o['metadata']['name'] for o in self.of_kind('Deployment')]}"
        return found

    def config_data(self, name: str) -> dict[str, str]:
        found = self.get("ConfigMap", name)
        assert found is not None, f"no ConfigMap {name}"
        return dict(found.get("data") or {})

    def secret_value(self, name: str, key: str) -> str | None:
        found = self.get("Secret", name)
        if found is None:
            return None
        if key in (found.get("stringData") or {}):
            return found["stringData"][key]
        raw = (found.get("data") or {}).get(key)
        return base64.b64decode(raw).decode() if raw is not None else None

    def pdserve_containers(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(deployment, container) for every container running the pdserve image, init containers too."""
        out = []
        for deployment in self.of_kind("Deployment"):
            spec = deployment["spec"]["template"]["spec"]
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                if container["image"].split(":")[0].endswith("pdserve"):
                    out.append((deployment, container))
        return out


def container_env(rendered: Rendered, deployment: dict[str, Any], container: dict[str, Any],
                  files: Path) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the container's process; ConfigMap volumes are written under `files`."""
    env: dict[str, str] = {"PATH": os.environ.get("PATH", "")}
    for source in container.get("envFrom", []):
        env |= rendered.config_data(source["configMapRef"]["name"])
    for var in container.get("env", []):
        env[var["name"]] = _value(rendered, var)
    mounts = _write_mounts(rendered, deployment, container, files)
    argv = [_remap(arg, mounts) for arg in container.get("args", [])]
    return argv, {name: _remap(value, mounts) for name, value in env.items()}


def _value(rendered: Rendered, var: dict[str, Any]) -> str:
    if "value" in var:
        return str(var["value"])
    source = var["valueFrom"]
    if "fieldRef" in source:
        return POD_FIELDS[source["fieldRef"]["fieldPath"]]
    ref = source["secretKeyRef"]
    assert ref["key"] in SECRET_KEYS, f"secret key {ref['key']} is not one of the documented {SECRET_KEYS}"
    found = rendered.secret_value(ref["name"], ref["key"])
    if found is not None:
        return found
    return "redis://redis.example:6379/0" if ref["key"] == "redis-url" else f"placeholder-{ref['key']}"


def _write_mounts(rendered: Rendered, deployment: dict[str, Any], container: dict[str, Any],
                  files: Path) -> dict[str, Path]:
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "configMap" not in volume:
            continue
        folder = files / mount["name"]
        folder.mkdir(parents=True, exist_ok=True)
        for key, text in rendered.config_data(volume["configMap"]["name"]).items():
            (folder / key).write_text(text)
        mounts[mount["mountPath"]] = folder
    return mounts


def _remap(value: str, mounts: dict[str, Path]) -> str:
    for mount_path, folder in mounts.items():
        if value.startswith(mount_path + "/"):
            return str(folder) + value[len(mount_path):]
    return value


def adapter_metric_names() -> set[str]:
    """The metric names the Prometheus adapter serves under its rules (name.as applied to the series)."""
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    names = set()
    for rule in values["rules"]["custom"]:
        series = rule["seriesQuery"].split("{")[0].strip("'\" ")
        names.add(re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series))
    return names


def adapter_series() -> set[str]:
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    return {rule["seriesQuery"].split("{")[0].strip("'\" ") for rule in values["rules"]["custom"]}
