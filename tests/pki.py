"""A throwaway PKI for TLS tests (trustme): a CA the system's store does not trust, and its certificates."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass
class Certificate:
    cert: str
    key: str

    def serve_args(self) -> tuple[str, ...]:
        return ("--tls-cert", self.cert, "--tls-key", self.key)


@dataclass
class Pki:
    ca: str              # the CA's certificate (PEM): what clients must be given
    local: Certificate   # for 127.0.0.1 and localhost
    elsewhere: Certificate  # for example.org only
    expired: Certificate  # for 127.0.0.1, expired a year ago


def make_pki(folder: Path) -> Pki:
    """A throwaway CA in ``folder`` and the certificates the TLS tests serve."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(folder / "ca.pem")

    def issue(name: str, *identities: str, **validity) -> Certificate:
        leaf = ca.issue_cert(*identities, **validity)
        for k, blob in enumerate(leaf.cert_chain_pems):
            blob.write_to_path(folder / f"{name}.pem", append=k > 0)
        leaf.private_key_pem.write_to_path(folder / f"{name}.key")
        return Certificate(str(folder / f"{name}.pem"), str(folder / f"{name}.key"))

    now = datetime.datetime.now(datetime.timezone.utc)
    return Pki(str(folder / "ca.pem"), issue("local", "127.0.0.1", "localhost"), issue("elsewhere", "example.org"),
               issue("expired", "127.0.0.1", not_before=now - datetime.timedelta(days=730),
                     not_after=now - datetime.timedelta(days=365)))
