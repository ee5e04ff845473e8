"""Volume contents, the atomic publish, and mount plans."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollfleet_dev.localcluster.nodeagent.env import Refs
from rollfleet_dev.localcluster.nodeagent.volumes import (
    Mount,
    VolumeError,
    claim_volume,
    mount_plan,
    prepare_host_volume,
    token_requests,
    volume_files,
    write_atomic,
)

POD = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": {"a": "1"}},
    "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "250m"}}}]},
}

KUBE_API_ACCESS = {
    "name": "kube-api-access-x",
    "projected": {
        "defaultMode": 420,
        "sources": [
            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {
                "downwardAPI": {
                    "items": [
                        {"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
                    ]
                }
            },
        ],
    },
}


def test_default_service_account_volume() -> None:
    pod = {**POD, "spec": {**POD["spec"], "volumes": [KUBE_API_ACCESS]}}
    assert token_requests(pod) == {("", 3607)}
    refs = Refs(config_maps={"kube-root-ca.crt": {"data": {"ca.crt": "PEM"}}})
    files = volume_files(KUBE_API_ACCESS, pod, refs, {("", 3607): "tok"}, {})
    assert files == {"token": (b"tok", 0o644), "ca.crt": (b"PEM", 0o644), "namespace": (b"ns", 0o644)}


def test_config_map_items_modes_and_missing() -> None:
    vol = {"configMap": {"name": "cm", "items": [{"key": "k", "path": "dir/f", "mode": 0o600}]}}
    refs = Refs(config_maps={"cm": {"data": {"k": "v", "other": "x"}}})
    assert volume_files(vol, POD, refs, {}, {}) == {"dir/f": (b"v", 0o600)}
    with pytest.raises(VolumeError, match='configmap "cm" not found'):
        volume_files(vol, POD, Refs(config_maps={"cm": None}), {}, {})
    optional = {"configMap": {"name": "cm", "optional": True}}
    assert volume_files(optional, POD, Refs(config_maps={"cm": None}), {}, {}) == {}


def test_downward_volume_resources() -> None:
    vol = {
        "downwardAPI": {
            "items": [
                {
                    "path": "cpu",
                    "resourceFieldRef": {"containerName": "c", "resource": "requests.cpu", "divisor": "1m"},
                },
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
            ]
        }
    }
    files = volume_files(vol, POD, Refs(), {}, {})
    assert files == {"cpu": (b"250", 0o644), "labels": (b'a="1"', 0o644)}


def test_write_atomic_swaps_whole_sets(tmp_path: Path) -> None:
    write_atomic(tmp_path, {"a": (b"1", 0o644), "sub/b": (b"2", 0o600)})
    assert (tmp_path / "a").read_text() == "1" and (tmp_path / "sub" / "b").read_text() == "2"
    first = os.readlink(tmp_path / "..data")
    write_atomic(tmp_path, {"a": (b"new", 0o644)})
    assert (tmp_path / "a").read_text() == "new"
    assert not (tmp_path / "sub").exists() and not (tmp_path / first).exists()
    assert (tmp_path / "a").is_symlink()


def test_host_volumes(tmp_path: Path) -> None:
    assert prepare_host_volume({"emptyDir": {}}, tmp_path / "e", Path) == str(tmp_path / "e")
    assert (tmp_path / "e").is_dir()
    created = tmp_path / "made" / "here"
    assert prepare_host_volume({"hostPath": {"path": str(created), "type": "DirectoryOrCreate"}}, tmp_path / "x", Path)
    assert created.is_dir()
    with pytest.raises(VolumeError, match="not a directory"):
        prepare_host_volume({"hostPath": {"path": str(tmp_path / "nope"), "type": "Directory"}}, tmp_path / "y", Path)
    assert prepare_host_volume({"secret": {"secretName": "s"}}, tmp_path / "s", Path) is None
    with pytest.raises(VolumeError, match="unsupported"):
        prepare_host_volume({"name": "n", "nfs": {}}, tmp_path / "n", Path)


def test_a_claim_is_mounted_as_the_host_path_of_its_bound_volume() -> None:
    volume = {"name": "results", "persistentVolumeClaim": {"claimName": "data"}}
    bound = {"status": {"phase": "Bound"}, "spec": {"volumeName": "pv-1"}}
    pv = {"metadata": {"name": "pv-1"}, "spec": {"hostPath": {"path": "/srv/pv-1"}, "capacity": {"storage": "1Gi"}}}
    assert claim_volume(volume, bound, pv) == {"name": "results", "hostPath": {"path": "/srv/pv-1"}}
    local = {"metadata": {"name": "pv-1"}, "spec": {"local": {"path": "/mnt/disk"}}}
    assert claim_volume(volume, bound, local)["hostPath"] == {"path": "/mnt/disk", "type": "Directory"}
    with pytest.raises(VolumeError, match='persistentvolumeclaim "data" not found'):
        claim_volume(volume, None, None)
    with pytest.raises(VolumeError, match="not bound"):
        claim_volume(volume, {"status": {"phase": "Pending"}, "spec": {}}, None)
    with pytest.raises(VolumeError, match=r"not hostPath or local: \['nfs'\]"):
        claim_volume(volume, bound, {"metadata": {"name": "pv-1"}, "spec": {"nfs": {"server": "x"}}})


def test_mount_plan() -> None:
    container = {
        "volumeMounts": [
            {"name": "data", "mountPath": "/data", "subPath": "x"},
            {"name": "cfg", "mountPath": "/etc/cfg"},
            {"name": "data", "mountPath": "/ro", "readOnly": True},
        ]
    }
    sources = {"data": ("/state/data", False), "cfg": ("/state/cfg", True)}
    assert mount_plan(container, sources) == [
        Mount("/state/data/x", "/data", False),
        Mount("/state/cfg", "/etc/cfg", True),
        Mount("/state/data", "/ro", True),
    ]
    with pytest.raises(VolumeError, match="invalid subPath"):
        mount_plan({"volumeMounts": [{"name": "data", "mountPath": "/d", "subPath": "../etc"}]}, sources)
    with pytest.raises(VolumeError, match="names no volume"):
        mount_plan({"volumeMounts": [{"name": "nope", "mountPath": "/d"}]}, sources)
