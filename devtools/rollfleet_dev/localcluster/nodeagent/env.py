"""Container environment and `$(VAR)` expansion, as kubelet computes them (pure).

The ConfigMaps and Secrets a pod refers to are fetched by `pods` first and passed in
as `Refs`; this module does no I/O. Talks to nobody.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rollfleet.errors import RollfleetError
from rollfleet_dev.localcluster.nodeagent.downward import FieldError, field_value, resource_value

Obj = dict[str, Any]


class EnvError(RollfleetError, ValueError):
    """The environment cannot be built (missing Secret key, ...): kubelet's CreateContainerConfigError."""


def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    """Kubelet's expansion: `$(VAR)` becomes VAR's value when defined and stays as written when not;
    `$$` is an escaped `$`; any other `$` is kept."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "$" and i + 1 < n:
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                close = text.find(")", i + 2)
                if close != -1:
                    name = text[i + 2 : close]
                    value = lookup(name)
                    out.append(value if value is not None else f"$({name})")
                    i = close + 1
                    continue
            out.append("$")
            i += 1
            continue
        out.append(ch)
        i += 1
    return "".join(out)


@dataclass
class Refs:
    """ConfigMaps and Secrets of the pod's namespace by name (None: does not exist), and its Services."""

    config_maps: dict[str, Obj | None] = field(default_factory=dict)
    secrets: dict[str, Obj | None] = field(default_factory=dict)
    services: list[Obj] = field(default_factory=list)

    def config_map_data(self, name: str) -> dict[str, str] | None:
        cm = self.config_maps.get(name)
        if cm is None:
            return None
        data = dict(cm.get("data") or {})
        for key, value in (cm.get("binaryData") or {}).items():
            data[key] = base64.b64decode(value).decode(errors="replace")
        return data

    def secret_data(self, name: str) -> dict[str, str] | None:
        secret = self.secrets.get(name)
        if secret is None:
            return None
        data = {k: base64.b64decode(v).decode(errors="replace") for k, v in (secret.get("data") or {}).items()}
        data.update(secret.get("stringData") or {})
        return data


def referenced_objects(pod: Obj) -> tuple[set[str], set[str]]:
    """Names of the ConfigMaps and Secrets that the pod's env, envFrom and volumes refer to."""
    cms: set[str] = set()
    secrets: set[str] = set()
    spec = pod.get("spec", {})
    for c in spec.get("containers", []) + spec.get("initContainers", []):
        for src in c.get("envFrom") or []:
            if "configMapRef" in src:
                cms.add(src["configMapRef"]["name"])
            if "secretRef" in src:
                secrets.add(src["secretRef"]["name"])
        for var in c.get("env") or []:
            vf = var.get("valueFrom") or {}
            if "configMapKeyRef" in vf:
                cms.add(vf["configMapKeyRef"]["name"])
            if "secretKeyRef" in vf:
                secrets.add(vf["secretKeyRef"]["name"])
    for vol in spec.get("volumes") or []:
        if "configMap" in vol:
            cms.add(vol["configMap"]["name"])
        if "secret" in vol:
            secrets.add(vol["secret"]["secretName"])
        for src in (vol.get("projected") or {}).get("sources") or []:
            if "configMap" in src:
                cms.add(src["configMap"]["name"])
            if "secret" in src:
                secrets.add(src["secret"]["name"])
    return cms, secrets


def _from_key(kind: str, data: dict[str, str] | None, ref: Obj) -> str | None:
    optional = bool(ref.get("optional"))
    if data is None:
        if optional:
            return None
        raise EnvError(f'{kind} "{ref["name"]}" not found')
    if ref["key"] not in data:
        if optional:
            return None
        raise EnvError(f"couldn't find key {ref['key']} in {kind} {ref['name']}")
    return data[ref["key"]]


def service_links(services: list[Obj]) -> dict[str, str]:
    """Kubelet's service environment variables (`enableServiceLinks`): for each Service of the pod's
    namespace with a cluster IP, `<NAME>_SERVICE_HOST`, `<NAME>_SERVICE_PORT` (its first port) and
    `<NAME>_SERVICE_PORT_<PORT NAME>`, and the Docker-link `<NAME>_PORT=tcp://ip:port`. There is no
    cluster DNS here, so these are how a pod finds a Service by name."""
    env: dict[str, str] = {}
    for svc in services:
        spec = svc.get("spec") or {}
        ip, ports = spec.get("clusterIP"), spec.get("ports") or []
        if not ip or ip == "None" or not ports:
            continue
        name = svc["metadata"]["name"].upper().replace("-", "_")
        env[f"{name}_SERVICE_HOST"] = ip
        env[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            if port.get("name"):
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
        env[f"{name}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
    return env


def container_env(
    pod: Obj, container: Obj, refs: Refs, base: Mapping[str, str], node_allocatable: dict[str, str]
) -> dict[str, str]:
    """The environment of one container: `base` (PATH, KUBERNETES_SERVICE_*, service links, ...), then
    envFrom, then env in order, each `value` expanded against what is defined before it."""
    env = dict(base)
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        data: dict[str, str] | None
        if "configMapRef" in src:
            ref, data, kind = src["configMapRef"], refs.config_map_data(src["configMapRef"]["name"]), "configmap"
        else:
            ref, data, kind = src["secretRef"], refs.secret_data(src["secretRef"]["name"]), "secret"
        if data is None:
            if ref.get("optional"):
                continue
            raise EnvError(f'{kind} "{ref["name"]}" not found')
        for key, val in data.items():
            if "=" not in key:  # kubelet skips keys that cannot be variable names
                env[prefix + key] = val
    for var in container.get("env") or []:
        name = var["name"]
        vf = var.get("valueFrom")
        value: str | None
        if vf is None:
            value = expand(var.get("value", ""), env.get)
        elif "fieldRef" in vf:
            try:
                value = field_value(pod, vf["fieldRef"]["fieldPath"])
            except FieldError as e:
                raise EnvError(str(e)) from e
        elif "resourceFieldRef" in vf:
            ref = vf["resourceFieldRef"]
            try:
                value = resource_value(
                    pod,
                    ref.get("containerName") or container["name"],
                    ref["resource"],
                    ref.get("divisor"),
                    node_allocatable,
                )
            except FieldError as e:
                raise EnvError(str(e)) from e
        elif "configMapKeyRef" in vf:
            value = _from_key("configmap", refs.config_map_data(vf["configMapKeyRef"]["name"]), vf["configMapKeyRef"])
        elif "secretKeyRef" in vf:
            value = _from_key("secret", refs.secret_data(vf["secretKeyRef"]["name"]), vf["secretKeyRef"])
        else:
            raise EnvError(f"unsupported valueFrom for {name}: {sorted(vf)}")
        if value is not None:
            env[name] = value
    return env


def container_argv(container: Obj, env: Mapping[str, str], entrypoint: list[str], cmd: list[str]) -> list[str]:
    """command+args with `$(VAR)` expanded; the image's entrypoint/cmd fill in what the container omits
    (Docker semantics: `command` replaces ENTRYPOINT and drops CMD; `args` replaces CMD)."""
    command = container.get("command")
    args = container.get("args")
    head = list(command) if command else list(entrypoint)
    tail = list(args) if args is not None else ([] if command else list(cmd))
    argv = head + tail
    return [expand(a, env.get) for a in argv]
