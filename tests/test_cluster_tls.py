"""Mutual TLS on the Cluster port (issue 13: "a shared token or mTLS from files"): logical nodes
whose certificates chain to the cluster's CA form the cluster and a spanning group is exact
over it; a node whose certificate comes from another CA, or that speaks plaintext, is never
registered and says why; the settings go together and their files are checked at start."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import subprocess
import sys

import pytest
from ranklib import wait_until
from test_cluster import Cluster, case, run, serve, topology

pytestmark = pytest.mark.slow

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class Ca:
    """A throwaway CA issuing node certificates valid for 127.0.0.1 and localhost."""

    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                     .sign(self.key, hashes.SHA256()))

    def issue(self, folder: str, node: str) -> tuple[str, str, str]:
        """(cert, key, ca) files of a node certificate for both TLS ends."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(_name(node))
                .issuer_name(self.cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.DNSName("localhost")]), False)
                .sign(self.key, hashes.SHA256()))
        paths = [os.path.join(folder, f"{node}.{ext}") for ext in ("crt", "key", "ca")]
        for path, data in zip(paths, (cert.public_bytes(serialization.Encoding.PEM),
                                      _pem_key(key),
                                      self.cert.public_bytes(serialization.Encoding.PEM)),
                              strict=True):
            with open(path, "wb") as f:
                f.write(data)
            os.chmod(path, 0o600)
        return paths[0], paths[1], paths[2]


class TlsCluster(Cluster):
    """Cluster with per-node TLS files (None: that node speaks plaintext)."""

    def __init__(self, engines: list[int], files: list[tuple[str, str, str] | None],
                 token: str | None = None) -> None:
        super().__init__(engines, token)
        self.files = files

    def args(self, rank: int) -> list[str]:
        tls = self.files[rank]
        extra = [] if tls is None else ["--cluster-tls-cert", tls[0], "--cluster-tls-key",
                                        tls[1], "--cluster-tls-ca", tls[2]]
        return super().args(rank) + extra


def test_nodes_with_the_clusters_ca_form_it_and_a_spanning_group_is_exact(ranks):
    ca = Ca("epd-test-ca")
    c = TlsCluster([1, 1], [])
    try:
        c.files = [ca.issue(c.dir, "node0"), ca.issue(c.dir, "node1")]
        for r in (0, 1):
            c.start(r)
        c.wait_registered()
        assert "mutual TLS" in c.nodes[0].log()
        run(ranks, case(2, nodes=2), [c.ep(0), c.ep(1)])  # placed node-major: hierarchical
        assert topology(c.nodes[1]).cluster.coordinator_reachable
        assert topology(c.nodes[0]).cluster.tls and topology(c.nodes[1]).cluster.tls
        shown = subprocess.run([sys.executable, "-m", "epd.server.cli", "topology",
                                "--socket-dir", c.nodes[1].socket_dir], capture_output=True,
                               text=True, timeout=30).stdout
        assert "(reachable, mutual TLS)" in shown, shown
    finally:
        c.close()


@pytest.mark.parametrize("intruder", ["other-ca", "plaintext"])
def test_a_node_without_the_clusters_certificate_is_not_registered(intruder):
    ca = Ca("epd-test-ca")
    c = TlsCluster([1, 1], [])
    try:
        c.files = [ca.issue(c.dir, "node0"), None]
        c.start(0)
        c.nodes[0].wait_ready(60)
        # The intruder has the token: TLS alone keeps it out.
        bad = TlsCluster([1, 1], [None, None], token=c.token)
        bad.address, c.nodes[1] = c.address, None
        if intruder == "other-ca":
            bad.files[1] = Ca("another-ca").issue(bad.dir, "node1")
        try:
            d = bad.start(1)
            d.wait_ready(60)  # it serves its own node regardless
            wait_until(lambda: "cannot register with node 0" in d.log(), 20,
                       "the node says it cannot register")
            assert not topology(d).cluster.coordinator_reachable
            assert not topology(c.nodes[0]).cluster.nodes[1].healthy
        finally:
            bad.close()
    finally:
        c.close()


@pytest.mark.parametrize("args,needle", [
    (["--cluster-tls-cert", "CERT"], "missing cluster_tls_key, cluster_tls_ca"),
    (["--cluster-tls-cert", "CERT", "--cluster-tls-key", "KEY", "--cluster-tls-ca", "CA",
      "--num-nodes", "1"], "are for cluster mode"),
    (["--num-nodes", "2", "--cluster-address", "127.0.0.1:1", "--cluster-token-file", "TOKEN",
      "--cluster-tls-cert", "CERT", "--cluster-tls-key", "KEY", "--cluster-tls-ca",
      "MISSING"], "--cluster-tls-ca"),
    (["--num-nodes", "2", "--cluster-address", "127.0.0.1:1", "--cluster-token-file", "TOKEN",
      "--cluster-tls-cert", "TOKEN", "--cluster-tls-key", "KEY", "--cluster-tls-ca",
      "CA"], "no PEM block"),
    # another node's key with this node's certificate: named at start on every node (gRPC
    # said only "cannot listen there" on node 0, and nothing but an unreachable peer elsewhere)
    *[(["--num-nodes", "2", "--node-rank", rank, "--cluster-address", "127.0.0.1:1",
        "--cluster-token-file", "TOKEN", "--cluster-tls-cert", "CERT", "--cluster-tls-key",
        "OTHER_KEY", "--cluster-tls-ca", "CA"], "not a certificate and its private key")
      for rank in ("0", "1")],
    # an encrypted key (gRPC cannot use one): named, never a passphrase prompt
    (["--num-nodes", "2", "--cluster-address", "127.0.0.1:1", "--cluster-token-file", "TOKEN",
      "--cluster-tls-cert", "CERT", "--cluster-tls-key", "ENC_KEY", "--cluster-tls-ca", "CA"],
     "not a certificate and its private key"),
    (["--num-nodes", "2", "--cluster-address", "127.0.0.1:1", "--cluster-token-file", "TOKEN",
      "--cluster-tls-cert", "CERT", "--cluster-tls-key", "KEY", "--cluster-tls-ca",
      "GARBLED"], "no CA certificate in it"),
])
def test_tls_settings_are_checked_at_start(tmp_path, args, needle):
    (tmp_path / "token").write_text("s3cret\n")
    ca_ = Ca("epd-test-ca")
    cert, key, ca = ca_.issue(str(tmp_path), "node0")
    other = tmp_path / "other"
    other.mkdir()
    _, other_key, _ = ca_.issue(str(other), "node1")
    (tmp_path / "garbled.pem").write_text("-----BEGIN CERTIFICATE-----\nnot base64\n"
                                          "-----END CERTIFICATE-----\n")
    with open(key, "rb") as f:
        plain = serialization.load_pem_private_key(f.read(), None)
    (tmp_path / "enc.key").write_bytes(plain.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"passphrase")))
    subst = {"TOKEN": str(tmp_path / "token"), "CERT": cert, "KEY": key, "CA": ca,
             "MISSING": str(tmp_path / "missing"), "OTHER_KEY": other_key,
             "GARBLED": str(tmp_path / "garbled.pem"), "ENC_KEY": str(tmp_path / "enc.key")}
    res = serve(tmp_path, *[subst.get(a, a) for a in args])
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0, res.stderr
    assert any(needle in ln for ln in lines), res.stderr
    assert not list(tmp_path.glob("epd-metrics-*"))
    shutil.rmtree(tmp_path / "sock", ignore_errors=True)
