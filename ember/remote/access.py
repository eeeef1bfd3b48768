"""Who may open a session on a compute peer, and who may read its status: authorizers.

An *authorizer* is any callable ``authorize(address, token, device)`` that a peer asks at every
handshake, with the client's address ("host:port"), the token it presented (a str, or None or
anything else a client sent) and the device index it asked for. It

- returns a ``str`` to allow the session: the client's name in the peer's logs and stats;
- returns ``None`` or ``True`` to allow it, naming the client by its address;
- returns ``False`` to refuse with a generic reason;
- raises :class:`~ember.errors.AccessDenied` ``(reason)`` to refuse with that reason, which the
  client sees (the peer removes the token from it if it appears); :class:`NotPermitted`, a kind
  of it, says the token was good but not for this (a device, a session), so it is no failed token.

Anything else it raises refuses the session with a generic reason, and the peer logs the error
(without the token). ``single_token`` is the authorizer of ``--token-file`` (``token=``) and
:class:`TokenFile` the one of ``--tokens-file``. Tokens are compared in constant time.

Who reads ``/status.json`` and ``/metrics`` is a :class:`Viewer`: an authorizer with a method
``viewer(address, token)`` (both of ember's have one) says who a token is and its role; the
roles ``admin`` and ``metrics`` see every session, anyone else only the sessions opened under
their own name. :class:`Throttle` slows down an address that keeps presenting wrong tokens.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import os
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import AccessDenied, ArgumentError

BAD_TOKEN = "bad or missing token: pass it in the device string (ember://TOKEN@host:port/0) or in EMBER_TOKEN"
ROLES = ("admin", "metrics")  #: what a tokens file's ``role=`` may say; both see every session's status
MIN_TOKEN_CHARACTERS = 16     #: ``ember serve`` refuses shorter tokens unless --insecure
MAKE_A_TOKEN = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


class NotPermitted(AccessDenied):
    """A refusal of a client whose token is good (a device it may not use, a session for a token
    that may only read the status): not a failed token, so it does not slow its address down."""


@dataclass(frozen=True)
class Viewer:
    """Who reads a peer's status: a client's ``name`` (or address) and its ``role`` (None, or one
    of :data:`ROLES`); ``sees_all`` says whether it sees every session or only its own."""
    name: str
    role: str | None = None

    @property
    def sees_all(self) -> bool:
        return self.role in ROLES


def _digest(token) -> bytes | None:
    # digests of equal length compare in constant time, whatever the lengths of the tokens
    return hashlib.sha256(token.encode()).digest() if isinstance(token, str) else None


class SingleToken:
    """The authorizer admitting exactly one token (``--token-file``), naming clients by their
    address; the one client it admits is the peer's admin: it sees every session's status."""

    def __init__(self, token: str):
        self._expected = _digest(token)

    def _matches(self, presented) -> bool:
        given = _digest(presented)
        return given is not None and hmac.compare_digest(given, self._expected)

    def __call__(self, address: str, presented, device: int) -> None:
        if not self._matches(presented):
            raise AccessDenied(BAD_TOKEN)

    def viewer(self, address: str, presented) -> Viewer | None:
        """The admin, for the token; None for any other."""
        return Viewer(address, "admin") if self._matches(presented) else None


def single_token(token: str) -> SingleToken:
    """An authorizer admitting exactly ``token``, naming clients by their address."""
    return SingleToken(token)


@dataclass(frozen=True)
class Client:
    """A line of a tokens file: a client's name, its token, the device indices it may use (None:
    all) and its role (None, ``admin`` or ``metrics``: see :class:`TokenFile`)."""
    name: str
    token: str
    devices: frozenset | None = None
    role: str | None = None


class TokenFile:
    """An authorizer naming several clients, each with its own token and, optionally, devices
    and a role.

    The file holds one client a line — ``NAME TOKEN [DEVICE ...] [role=ROLE]`` separated by
    spaces, device indices separated by spaces or commas, all devices when none is listed — and
    blank lines or lines starting with ``#``::

        # name     token                                        devices  role
        alice      dGhpcyBpcyBub3QgYSByZWFsIHRva2VuLCBhdCBhbGw
        ci         c2VlIHRoZSByZWFkbWUgZm9yIGhvdyB0byBtYWtlIG9uZQ  0,1
        ops        bm90IHRoaXMgb25lIGVpdGhlciwgb2YgY291cnNlLi4u              role=admin
        prometheus aG93IG1hbnkgb2YgdGhlc2UgZGlkIHlvdSBkZWNvZGU/             role=metrics

    A client sees only its own sessions on ``/status.json``, ``/metrics`` and ``ember top``; a
    client of role ``admin`` sees every session (and opens sessions as any client does), one of
    role ``metrics`` sees every session and opens none (a monitoring system's token). Names and
    tokens must each be unique, and tokens at least ``min_token_characters`` long. Errors name
    the file and the line, never a token.
    """

    def __init__(self, clients: list[Client]):
        if not clients:
            raise ArgumentError("a tokens file must name at least one client")
        self.clients = clients
        self._digests = [(_digest(c.token), c) for c in clients]

    @classmethod
    def load(cls, path, min_token_characters: int = MIN_TOKEN_CHARACTERS) -> TokenFile:
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
                raise ArgumentError(f"{where}: expected NAME TOKEN [DEVICE ...] [role=ROLE], got only a name")
            name, token, *rest = fields
            options = dict(field.partition("=")[::2] for field in rest if "=" in field)
            unknown = sorted(set(options) - {"role"})
            if unknown or options.get("role", "admin") not in ROLES:
                raise ArgumentError(f"{where}: after the devices comes role=admin or role=metrics, "
                                    f"got {' '.join(f for f in rest if '=' in f)!r}")
            indices = [part for field in rest if "=" not in field for part in field.split(",") if part]
            if not all(part.isdigit() for part in indices):
                raise ArgumentError(f"{where}: device indices are integers ≥ 0, separated by spaces or commas")
            if name in names:
                raise ArgumentError(f"{where}: the client {name!r} is already named on line {names[name]}")
            if token in tokens:
                raise ArgumentError(f"{where}: {name!r} has the same token as {tokens[token]!r}; each client needs its own")
            if len(token) < min_token_characters:
                raise ArgumentError(f"{where}: the token of {name!r} has {len(token)} characters, and a token needs "
                                    f"{min_token_characters} or more (make one with {MAKE_A_TOKEN}; "
                                    f"ember serve --insecure accepts shorter ones)")
            names[name], tokens[token] = number, name
            clients.append(Client(name, token, frozenset(map(int, indices)) if indices else None, options.get("role")))
        if not clients:
            raise ArgumentError(f"the tokens file {path} names no client (lines are NAME TOKEN [DEVICE ...])")
        return cls(clients)

    def _identify(self, token) -> Client | None:
        given = _digest(token)
        found = None
        for expected, client in self._digests:  # every entry, so the time taken says nothing of which matched
            if given is not None and hmac.compare_digest(given, expected):
                found = client
        return found

    def __call__(self, address: str, token, device: int) -> str:
        found = self._identify(token)
        if found is None:
            raise AccessDenied(BAD_TOKEN)
        if found.role == "metrics":
            raise NotPermitted(f"client {found.name} has the role metrics: it may read /status.json and /metrics, "
                               f"not open sessions")
        if found.devices is not None and (type(device) is not int or device not in found.devices):
            raise NotPermitted(f"client {found.name} may not use device {device!r}; its devices are "
                               f"{', '.join(map(str, sorted(found.devices)))}")
        return found.name

    def viewer(self, address: str, token) -> Viewer | None:
        """Who ``token`` is, to read the status: its client's name and role; None if no client's."""
        found = self._identify(token)
        return None if found is None else Viewer(found.name, found.role)


def exposed(path) -> str | None:
    """Why the token file ``path`` is a risk where it is (its group or others may read it), or None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # reading it says why
    if os.name == "nt" or not mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    return (f"the token file {path} may be read by {'its group and others' if mode & stat.S_IROTH else 'its group'} "
            f"(mode {stat.S_IMODE(mode):04o}): anyone who reads it may use this peer; chmod 600 {path}")


FREE_FAILURES = 10     # failed tokens an address may present before it waits (typos, a script retrying)
FIRST_WAIT = 0.5       # seconds it then waits before its next try, doubling with each failure …
LONGEST_WAIT = 60.0    # … up to this
FORGET_SECONDS = 600   # an address that presented no wrong token for this long starts afresh
ADDRESSES = 4096       # the addresses remembered (the least recently seen go first): memory stays bounded


def host_key(host: str) -> str:
    """Whose share a client at ``host`` counts in (failed tokens, handshake slots): an IPv4 address
    itself (an IPv4-mapped IPv6 one too), an IPv6 address's /64 network (one machine may hold a whole
    /64), the IPv6 loopback itself; any other name (a Unix socket's) as given."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])  # without an IPv6 zone
    except ValueError:
        return host
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 4 or ip.is_loopback:
        return str(ip)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def address_key(address: str) -> str:
    """:func:`host_key` of a client's ``address`` ("host:port", "[v6]:port")."""
    if address.startswith("["):
        host = address[1:].partition("]")[0]
    else:
        host = address.partition(":")[0] if address.count(":") == 1 else address
    return host_key(host)


class Throttle:
    """Failed tokens, counted per address (:func:`address_key`), without I/O: the peer asks
    :meth:`admit` before it checks a token and tells :meth:`passed` after a good one.

    An address may present :data:`FREE_FAILURES` wrong tokens at once; after that it waits
    :data:`FIRST_WAIT` seconds before the next try is checked, twice as long after each further
    failure, up to :data:`LONGEST_WAIT`. A try within the wait is refused unchecked, saying how
    long is left — it costs the peer no thread and no sleep. An address's failures are forgotten
    :data:`FORGET_SECONDS` after its last one, and when a good token comes from it (a client's
    typos are not held against it once it is in; so a token holder may interleave its own token
    with guesses at another's, each of them logged). A try counts as a failure from the moment it
    is admitted, so that tries at once from one address cannot all slip in. At most
    :data:`ADDRESSES` addresses are remembered. Thread-safe."""

    def __init__(self, free: int = FREE_FAILURES, first_wait: float = FIRST_WAIT, longest_wait: float = LONGEST_WAIT,
                 forget: float = FORGET_SECONDS, addresses: int = ADDRESSES):
        self.free, self.first_wait, self.longest_wait, self.forget, self.addresses = \
            free, first_wait, longest_wait, forget, addresses
        self._records: OrderedDict[str, list] = OrderedDict()  # key -> [failures, time of the last, refused]
        self._lock = threading.Lock()

    def delay(self, failures: int) -> float:
        """How long after its last failure an address with ``failures`` may try again."""
        if failures < self.free:
            return 0.0
        return min(self.first_wait * 2.0 ** min(failures - self.free, 64), self.longest_wait)

    def admit(self, address: str, now: float) -> float:
        """0 when a token from ``address`` may be checked now (the try counts as a failure unless
        :meth:`passed` follows); else the seconds until one may, and nothing is checked."""
        key = address_key(address)
        with self._lock:
            record = self._records.get(key)
            if record is not None and now - record[1] >= self.forget:
                record = None
            if record is None:
                record = self._records[key] = [0, now, 0]
                if len(self._records) > self.addresses:
                    self._records.popitem(last=False)
            else:
                self._records.move_to_end(key)
            wait = record[1] + self.delay(record[0]) - now
            if wait > 0:
                record[2] += 1
                return wait
            record[0] += 1
            record[1] = now
            return 0.0

    def passed(self, address: str, good: bool = True) -> None:
        """The try just admitted was no failed token: a good one (``good``: the address's failures
        are forgotten), or one refused for another reason (it does not count)."""
        with self._lock:
            key = address_key(address)
            record = self._records.get(key)
            if record is not None and good:
                del self._records[key]
            elif record is not None and record[0] > 0:
                record[0] -= 1

    def failures(self, address: str) -> tuple[int, int]:
        """The failed tokens counted for ``address`` lately, and the tries refused unchecked meanwhile."""
        with self._lock:
            record = self._records.get(address_key(address))
            return (record[0], record[2]) if record is not None else (0, 0)

    def __len__(self) -> int:
        return len(self._records)


class Throttled(AccessDenied):
    """A try made within its address's wait (see :class:`Throttle`): refused unchecked. ``wait``
    is the seconds left."""

    def __init__(self, address: str, wait: float):
        super().__init__(f"too many failed tokens from {address_key(address)}: the next one is checked in "
                         f"{math.ceil(wait * 10) / 10:g} s")
        self.wait = wait


def is_guess(token) -> bool:
    """Whether presenting ``token`` tries one: no token (None, "") is no guess, and is not counted."""
    return token is not None and token != ""
