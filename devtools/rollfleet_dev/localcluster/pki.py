"""Certificates and credentials of a local cluster, made with the `openssl` CLI.

One CA signs the API server's serving certificate; a separate key pair signs
ServiceAccount tokens. Components authenticate with static bearer tokens (the
token file is regenerated with every cluster, so tokens never outlive it).
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

# user name, groups: what each static token authenticates as.
IDENTITIES: dict[str, tuple[str, str]] = {
    "admin": ("rollfleet-admin", "system:masters"),
    "scheduler": ("system:kube-scheduler", ""),
    "controller-manager": ("system:kube-controller-manager", ""),
    "node-agent": ("rollfleet-node-agent", "system:masters"),
    # LeaderWorkerSet's manager (rollfleet_dev.lws): bound to LWS's own ClusterRole when it is installed.
    "lws": ("rollfleet-lws-manager", ""),
}


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def apiserver_crt(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    @property
    def token_file(self) -> Path:
        return self.dir / "tokens.csv"

    def token(self, identity: str) -> str:
        for line in self.token_file.read_text().splitlines():
            token, user, *_ = line.split(",")
            if user == IDENTITIES[identity][0]:
                return token
        raise KeyError(identity)


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.strip()}")


def create(pki_dir: Path, sans: list[str]) -> Pki:
    """Create a CA, the API server's certificate for `sans`, the SA key pair and tokens."""
    pki = Pki(pki_dir)
    pki_dir.mkdir(parents=True, exist_ok=True)
    pki_dir.chmod(0o700)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-subj",
        "/CN=rollfleet-local-ca",
        "-keyout",
        str(pki.ca_key),
        "-out",
        str(pki.ca_crt),
    )
    serving_certificate(pki, "kube-apiserver", sans, pki.apiserver_crt, pki.apiserver_key)
    _openssl("genrsa", "-out", str(pki.sa_key), "2048")
    _openssl("rsa", "-in", str(pki.sa_key), "-pubout", "-out", str(pki.sa_pub))
    lines = []
    for i, (user, groups) in enumerate(IDENTITIES.values()):
        group_field = f',"{groups}"' if groups else ""
        lines.append(f"{secrets.token_hex(24)},{user},{i + 1}{group_field}")
    pki.token_file.write_text("\n".join(lines) + "\n")
    for f in pki_dir.iterdir():
        f.chmod(0o600)
    return pki


def serving_certificate(pki: Pki, name: str, sans: list[str], crt: Path, key: Path) -> None:
    """A server certificate for `sans` (IP addresses or DNS names), signed by the cluster's CA."""
    san = ",".join(f"IP:{s}" if s[0].isdigit() else f"DNS:{s}" for s in sans)
    csr, ext = pki.dir / f"{name}.csr", pki.dir / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(pki.ca_crt),
        "-CAkey",
        str(pki.ca_key),
        "-CAcreateserial",
        "-days",
        "3650",
        "-extfile",
        str(ext),
        "-out",
        str(crt),
    )
    key.chmod(0o600)


def kubeconfig(server: str, ca: Path, token: str, user: str) -> str:
    """A kubeconfig for one identity (YAML text)."""
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: rollfleet-local\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n"
        f"users:\n- name: {user}\n  user:\n    token: {token}\n"
        f"contexts:\n- name: rollfleet-local\n  context:\n    cluster: rollfleet-local\n    user: {user}\n"
        "current-context: rollfleet-local\n"
    )
