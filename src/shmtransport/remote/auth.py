"""Authenticating the remote tier's TCP endpoint: a shared secret, mutual TLS, or both.

- Shared secret: every Remote call of a peer (``Attach`` and each call after it) carries it as gRPC
  metadata ``shmt-remote-secret``; the daemon compares it in constant time and answers
  UNAUTHENTICATED otherwise. Without TLS it travels in clear text.
- ``RemoteTLS``: the daemon serves the TCP port with TLS and requires a client certificate signed
  by the configured CA; the reader checks the daemon's certificate against its CA.

Only the TCP port is guarded by TLS; the daemon's Unix socket stays local (file mode), and the
secret is required there too, except for ``Describe`` (a local producer's exporter asks it).
"""
from __future__ import annotations

import dataclasses
import hmac
import os
from typing import Iterable

import grpc

from ..errors import InvalidArgument

SECRET_METADATA_KEY = "shmt-remote-secret"
MIN_SECRET_LEN = 16


def check_secret(secret: str | None) -> str | None:
    """The secret as given, or InvalidArgument: gRPC metadata carries printable ASCII only."""
    if secret is None:
        return None
    if not isinstance(secret, str) or len(secret) < MIN_SECRET_LEN:
        raise InvalidArgument(f"remote secret must be a str of at least {MIN_SECRET_LEN} characters")
    if not (secret.isascii() and secret.isprintable()) or secret != secret.strip():
        raise InvalidArgument("remote secret must be printable ASCII without surrounding spaces "
                              "(e.g. secrets.token_urlsafe(32))")
    return secret


def secret_matches(metadata: Iterable[tuple[str, str | bytes]], secret: str) -> bool:
    """Whether the call's metadata carries ``secret`` (compared in constant time)."""
    for key, value in metadata:
        if key == SECRET_METADATA_KEY:
            given = value.encode() if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(given, secret.encode())
    return False


@dataclasses.dataclass(frozen=True, repr=False)
class RemoteTLS:
    """PEM material for mutual TLS on the remote endpoint.

    Daemon side (``remote_extension(tls=...)``): the daemon's certificate chain and key, and ``ca``:
    the CA that signs the peers' client certificates (every peer must present one). Reader side
    (``RemoteReader(tls=...)``): the reader's client certificate chain and key, and ``ca``: the CA
    that signs the daemons' certificates. ``server_name`` (reader side): the name the daemons'
    certificates carry when it is not the host of the endpoint the reader dials.
    """

    cert_chain: bytes
    private_key: bytes
    ca: bytes
    server_name: str | None = None

    def __post_init__(self) -> None:
        for field in ("cert_chain", "private_key", "ca"):
            value = getattr(self, field)
            if not isinstance(value, bytes) or b"-----BEGIN" not in value:
                raise InvalidArgument(f"RemoteTLS.{field} must be PEM bytes")

    @classmethod
    def from_files(cls, cert_chain: str | os.PathLike[str], private_key: str | os.PathLike[str],
                   ca: str | os.PathLike[str], server_name: str | None = None) -> RemoteTLS:
        """The PEM material read from these files."""
        def read(path: str | os.PathLike[str]) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return cls(read(cert_chain), read(private_key), read(ca), server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Daemon-side credentials; every peer must present a client certificate signed by ``ca``."""
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Reader-side credentials: this client's certificate, and ``ca`` to check the daemon's."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.private_key,
                                            certificate_chain=self.cert_chain)

    def channel_options(self) -> list[tuple[str, str]]:
        """The channel options naming the expected server (``server_name``), if set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def __repr__(self) -> str:  # never the key
        return f"RemoteTLS(server_name={self.server_name!r})"
