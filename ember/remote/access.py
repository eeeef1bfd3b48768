"""Who may open a session on a compute peer: authorizers.

An *authorizer* is any callable ``authorize(address, token, device)`` that a peer asks at every
handshake, with the client's address ("host:port"), the token it presented (a str, or None or
anything else a client sent) and the device index it asked for. It

- returns a ``str`` to allow the session: the client's name in the peer's logs and stats;
- returns ``None`` or ``True`` to allow it, naming the client by its address;
- returns ``False`` to refuse with a generic reason;
- raises :class:`~ember.errors.AccessDenied` ``(reason)`` to refuse with that reason, which the
  client sees (the peer removes the token from it if it appears).

Anything else it raises refuses the session with a generic reason, and the peer logs the error
(without the token). ``single_token`` is the authorizer of ``--token-file`` (``token=``) and
:class:`TokenFile` the one of ``--tokens-file``. Tokens are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from ..errors import AccessDenied, ArgumentError

BAD_TOKEN = "bad or missing token: pass it in the device string (ember://TOKEN@host:port/0) or in EMBER_TOKEN"


def _digest(token) -> bytes | None:
    # digests of equal length compare in constant time, whatever the lengths of the tokens
    return hashlib.sha256(token.encode()).digest() if isinstance(token, str) else None


def single_token(token: str):
    """An authorizer admitting exactly ``token``, naming clients by their address."""
    expected = _digest(token)

    def authorize(address: str, presented, device: int) -> None:
        given = _digest(presented)
        if given is None or not hmac.compare_digest(given, expected):
            raise AccessDenied(BAD_TOKEN)

    return authorize


@dataclass(frozen=True)
class Client:
    """A line of a tokens file: a client's name, its token, the device indices it may use (None: all)."""
    name: str
    token: str
    devices: frozenset | None = None


class TokenFile:
    """An authorizer naming several clients, each with its own token and, optionally, devices.

    The file holds one client a line — ``NAME TOKEN [DEVICE ...]`` separated by spaces, device
    indices separated by spaces or commas, all devices when none is listed — and blank lines or
    lines starting with ``#``::

        # name     token                              devices
        alice      dGhpcyBpcyBub3QgYSByZWFsIHRva2Vu
        ci         c2VlIHRoZSByZWFkbWUgZm9yIG9uZQ    0,1

    Names and tokens must each be unique. Errors name the file and the line, never a token.
    """

    def __init__(self, clients: list[Client]):
        if not clients:
            raise ArgumentError("a tokens file must name at least one client")
        self.clients = clients
        self._digests = [(_digest(c.token), c) for c in clients]

    @classmethod
    def load(cls, path) -> TokenFile:
        """Read and check a tokens file; ArgumentError naming the line of any mistake."""
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ArgumentError(f"cannot read the tokens file {path}: {error}") from None
        clients, names, tokens = [], {}, {}
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            where = f"tokens file {path}, line {number}"
            if len(fields) < 2:
                raise ArgumentError(f"{where}: expected NAME TOKEN [DEVICE ...], got only a name")
            name, token, *rest = fields
            indices = [part for field in rest for part in field.split(",") if part]
            if not all(part.isdigit() for part in indices):
                raise ArgumentError(f"{where}: device indices are integers ≥ 0, separated by spaces or commas")
            if name in names:
                raise ArgumentError(f"{where}: the client {name!r} is already named on line {names[name]}")
            if token in tokens:
                raise ArgumentError(f"{where}: {name!r} has the same token as {tokens[token]!r}; each client needs its own")
            names[name], tokens[token] = number, name
            clients.append(Client(name, token, frozenset(map(int, indices)) if indices else None))
        if not clients:
            raise ArgumentError(f"the tokens file {path} names no client (lines are NAME TOKEN [DEVICE ...])")
        return cls(clients)

    def __call__(self, address: str, token, device: int) -> str:
        given = _digest(token)
        found = None
        for expected, client in self._digests:  # every entry, so the time taken says nothing of which matched
            if given is not None and hmac.compare_digest(given, expected):
                found = client
        if found is None:
            raise AccessDenied(BAD_TOKEN)
        if found.devices is not None and (type(device) is not int or device not in found.devices):
            raise AccessDenied(f"client {found.name} may not use device {device!r}; its devices are "
                               f"{', '.join(map(str, sorted(found.devices)))}")
        return found.name
