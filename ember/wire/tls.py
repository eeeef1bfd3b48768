"""TLS for both framings, with the standard library's ``ssl``: the contexts, the client's
handshake, and certificate failures in plain words.

TLS wraps the connected socket before anything else is sent — the first frame over TCP, the
HTTP upgrade over WebSocket — so the frames and everything above them are unchanged.
"""

from __future__ import annotations

import socket
import ssl

from ..errors import ArgumentError, ConnectionLost, TLSError

#: the first byte of a TLS connection (a handshake record): how a peer tells TLS clients from plain ones
HANDSHAKE_RECORD = b"\x16"
#: what a client is told when the peer closes or resets the connection before the TLS handshake is done
CLOSED_IN_HANDSHAKE = ("the peer closed the connection during the TLS handshake (it may be busy, with more connections "
                       "than it takes at once, or not serve TLS: a plain peer is ember:// or ws://); try again later")

# OpenSSL's verification codes (X509_V_ERR_*), grouped by what the user should do about them
_UNTRUSTED = {2, 18, 19, 20, 21}  # no issuer, self-signed leaf or chain, issuer not local, leaf unverifiable
_WRONG_NAME = {62, 64}            # hostname mismatch, IP address mismatch
_EXPIRED, _NOT_YET_VALID = 10, 9


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS ≥ 1.2 server context presenting the certificate chain ``cert`` with its private ``key`` (PEM files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as error:
        raise ArgumentError(f"cannot load the TLS certificate {cert} with the key {key}: {_reason(error)}") from None
    return context


def client_context(ca_file: str | None = None) -> ssl.SSLContext:
    """A TLS ≥ 1.2 client context that checks the peer's certificate and hostname against the
    system's CA store, or only against the CA certificates in ``ca_file`` (PEM)."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as error:
        raise TLSError(f"cannot load the CA file {ca_file}: {_reason(error)}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def wrap_client(sock: socket.socket, context: ssl.SSLContext, host: str, port: int, scheme: str) -> ssl.SSLSocket:
    """The TLS handshake with ``host`` over a connected socket, within its timeout. A refused
    certificate or a peer that does not speak TLS raises TLSError naming ``scheme://host:port``
    and the reason; the socket is closed on any failure."""
    where = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
    try:
        return context.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as error:
        raise TLSError(f"{where}: {_certificate_problem(error, host)}") from None
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionResetError, ConnectionAbortedError,
            BrokenPipeError) as error:
        # no answer, only a close or a reset: a busy peer too full to answer does this, as does one that
        # is not TLS and gave up on the bytes (a plain ember peer answers them with a frame instead)
        raise ConnectionLost(f"{where}: {CLOSED_IN_HANDSHAKE} ({_reason(error)})") from None
    except ssl.SSLError as error:  # the peer answered with something that is not TLS
        raise TLSError(f"{where}: the TLS handshake failed ({error.reason or error}): the peer does not seem to "
                       f"serve TLS (a plain peer is ember:// or ws://)") from None
    except TimeoutError:
        raise ConnectionLost(f"{where}: timed out during the TLS handshake") from None
    except OSError as error:
        raise ConnectionLost(f"{where}: the connection was lost during the TLS handshake: {error}") from None


def _certificate_problem(error: ssl.SSLCertVerificationError, host: str) -> str:
    code = error.verify_code
    if code in _UNTRUSTED:
        return ("the peer's certificate is not trusted (self-signed or unknown CA); pass its CA with EMBER_TLS_CA=FILE "
                "or em.device(..., tls_ca=FILE)")
    if code in _WRONG_NAME:
        return f"the peer's certificate is not valid for {host} (hostname mismatch); connect with a name it lists"
    if code == _EXPIRED:
        return "the peer's certificate has expired; the peer needs a new one"
    if code == _NOT_YET_VALID:
        return "the peer's certificate is not valid yet; check both machines' clocks"
    return f"the peer's certificate was refused ({error.verify_message})"


def _reason(error: OSError) -> str:
    return getattr(error, "reason", None) or error.strerror or str(error)
