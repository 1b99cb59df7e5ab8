"""The local cluster's pure parts: certificates, the containerd and CNI configuration,
the pip settings a base image inherits, the version stamp of the Kubernetes builds.
(The cluster itself runs in ``tests/e2e``.)"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import re
import tomllib
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from specula.devcluster import host, images
from specula.devcluster.cluster import STATE_DIR, LocalCluster, _containerd_toml
from specula.devcluster.pki import ClusterPKI

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_leaf_certificates_are_signed_by_the_ca_with_their_names(tmp_path):
    pki = ClusterPKI(tmp_path)
    ca = _load(pki.ca.cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server = pki.issue("apiserver", "kube-apiserver", dns_names=("kubernetes.default.svc",),
                       ip_addresses=("10.88.0.1", "10.96.0.1"), server=True)
    client = pki.issue("client", "kube-apiserver-kubelet-client",
                       organizations=("system:masters",), client=True)
    for pair in (server, client):
        cert = _load(pair.cert)
        assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
        cert.verify_directly_issued_by(ca)
        assert cert.not_valid_after_utc > dt.datetime.now(dt.UTC)
        assert oct(pair.key.stat().st_mode & 0o777) == "0o600"
    sans = _load(server.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert sans.value.get_values_for_type(x509.DNSName) == ["kubernetes.default.svc"]
    assert sans.value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.88.0.1"), ipaddress.ip_address("10.96.0.1")]
    usage = _load(server.cert).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    subject = _load(client.cert).subject
    assert subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    with pytest.raises(ValueError):
        pki.issue("bad", "x", ip_addresses=("not-an-ip",))


def test_containerd_config_has_what_this_kind_of_machine_needs(tmp_path):
    text = _containerd_toml(root=tmp_path / "root", state=STATE_DIR / "containerd",
                            socket=STATE_DIR / "containerd.sock", runc_root=STATE_DIR / "runc",
                            cni_conf=tmp_path / "net.d")
    config = tomllib.loads(text)
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["sandbox_image"] == images.PAUSE_IMAGE
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["options"]["SystemdCgroup"] is False
    assert runc["options"]["Root"].startswith(str(STATE_DIR))
    assert config["grpc"]["address"] == str(STATE_DIR / "containerd.sock")
    assert cri["cni"]["conf_dir"] == str(tmp_path / "net.d")


def test_pods_share_the_bridge_whose_address_is_the_node():
    config = LocalCluster(workdir=Path("/nonexistent"))._cni_config()
    bridge = config["plugins"][0]
    assert bridge["bridge"] == host.BRIDGE and bridge["isGateway"] and not bridge["ipMasq"]
    (subnet,) = bridge["ipam"]["ranges"][0]
    assert subnet["gateway"] == host.NODE_IP
    assert ipaddress.ip_address(host.NODE_IP) in ipaddress.ip_network(subnet["subnet"])
    assert ipaddress.ip_address(subnet["rangeStart"]) in ipaddress.ip_network(host.POD_SUBNET)
    # IP allocations live with the node's state, which teardown removes.
    assert bridge["ipam"]["dataDir"].startswith(str(STATE_DIR))
    json.dumps(config)


def test_base_image_inherits_the_host_pip_settings(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    conf = images._pip_conf()
    assert "cert = /etc/ssl/certs/ca-certificates.crt" in conf
    assert "index-url = https://mirror.example/simple" in conf


def test_debian_mirror_follows_the_environment(monkeypatch):
    monkeypatch.setenv("SPECULA_DEBIAN_MIRROR", "http://mirror.example/debian")
    assert images.debian_mirror() == "http://mirror.example/debian"


@pytest.mark.parametrize("script", ["hack/control-plane.sh", "hack/node.sh"])
def test_kubernetes_builds_stamp_their_version(script):
    """Without the stamp the binaries report v0.0.0-master, which `kubectl version`
    cannot parse."""
    text = (ROOT / script).read_text()
    for var in ("gitVersion", "gitMajor", "gitMinor"):
        assert re.search(rf"-X \$pkg\.{var}=", text), f"{script} does not stamp {var}"
    assert "k8s.io/component-base/version" in text
