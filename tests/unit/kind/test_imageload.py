"""Pure parts of loading images into kind nodes by their missing layers: chain ids, which layers a node
lacks, the snapshotter from containerd's config, and the OCI archive containerd imports."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from rollfleet_dev.kind import imageload

A, B, C = (f"sha256:{c * 64}" for c in "abc")


def test_a_chain_id_covers_every_layer_under_it_as_the_oci_spec_defines() -> None:
    chains = imageload.chain_ids([A, B, C])
    ab = "sha256:" + hashlib.sha256(f"{A} {B}".encode()).hexdigest()
    assert chains == [A, ab, "sha256:" + hashlib.sha256(f"{ab} {C}".encode()).hexdigest()]
    assert imageload.chain_ids([B, A])[1] != chains[1]  # the same layers in another order are another chain


def test_a_node_is_sent_the_layers_above_the_highest_one_it_holds() -> None:
    chains = imageload.chain_ids([A, B, C])
    assert imageload.missing_layers([A, B, C], set()) == [A, B, C]
    assert imageload.missing_layers([A, B, C], {chains[0], "sha256:" + "f" * 64}) == [B, C]
    assert imageload.missing_layers([A, B, C], {chains[0], chains[1]}) == [C]
    assert imageload.missing_layers([A, B, C], set(chains)) == []
    # Layer B alone (not on top of A) is another snapshot: it does not count.
    assert imageload.missing_layers([A, B, C], {B}) == [A, B, C]


def test_the_cri_snapshotter_is_read_from_either_config_version() -> None:
    v3 = "version = 3\n[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n"
    v2 = 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  snapshotter = "native"\n'
    assert imageload.snapshotter(v3) == "overlayfs"
    assert imageload.snapshotter(v2) == "native"
    with pytest.raises(imageload.ImageLoadError, match="kind load"):
        imageload.snapshotter("version = 3\n")


def test_the_archive_names_every_layer_and_carries_only_the_missing_ones() -> None:
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": [A, B]}}).encode()
    top = b"the top layer's tar"
    top_id = "sha256:" + hashlib.sha256(top).hexdigest()
    ref = "docker.io/rollfleet/engine-cpu:0.1.0"
    archive = imageload.oci_archive(ref, config, [(A, 7_000_000_000), (top_id, len(top))], {top_id: top})

    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]

    def blob(digest: str) -> bytes:
        data = files["blobs/sha256/" + digest.removeprefix("sha256:")]
        assert "sha256:" + hashlib.sha256(data).hexdigest() == digest  # content-addressed
        return data

    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    [entry] = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"]["io.containerd.image.name"] == ref
    manifest = json.loads(blob(entry["digest"]))
    assert manifest["config"]["digest"] == "sha256:" + hashlib.sha256(config).hexdigest()
    assert blob(manifest["config"]["digest"]) == config
    assert [(x["digest"], x["size"]) for x in manifest["layers"]] == [(A, 7_000_000_000), (top_id, len(top))]
    assert blob(top_id) == top
    assert "blobs/sha256/" + A.removeprefix("sha256:") not in files  # the node holds it


@pytest.mark.parametrize(
    ("image", "ref"),
    [
        ("rollfleet/engine-cpu:0.1.0", "docker.io/rollfleet/engine-cpu:0.1.0"),
        ("registry.k8s.io/pause:3.10", "registry.k8s.io/pause:3.10"),
        ("localhost:5000/x:1", "localhost:5000/x:1"),
    ],
)
def test_a_docker_hub_name_is_recorded_under_docker_io(image: str, ref: str) -> None:
    assert imageload.full_ref(image) == ref
