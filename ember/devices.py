"""Devices: small value objects parsed from device strings, each owning an engine.

    numpy                         the embedded default (EMBER_DEVICE overrides the default)
    torch:cpu, torch:cuda[:N]     PyTorch; ``torch`` means torch:cpu, ``torch:cuda`` torch:cuda:0
    jax:cpu, jax:gpu[:N]          JAX; ``jax`` means jax:cpu, ``jax:gpu`` jax:gpu:0
    ember://[token@]host:port/N   device N of a compute peer, over TCP
    ws://[token@]host:port/N      the same peer protocol over WebSocket
    embers://…, wss://…           the same over TLS (a peer started with --tls-cert and --tls-key)
    capture                       records operations without executing them

Devices compare by hardware: ``autodiff(d) == d``, and the ``ember://``, ``ws://``, ``embers://``
and ``wss://`` addresses of one peer's device are one device. The engine is created on first use.

A token is best given in ``EMBER_TOKEN`` (read when the device string is first parsed), not in the
string, where the program's source, its arguments and its shell history keep it. Either way no
message shows it: a device prints without it, and errors show a device string's userinfo as
``***`` (:func:`redacted`).

A TLS device trusts the CA certificates of ``device(spec, tls_ca=FILE)``, else of the file named
by ``EMBER_TLS_CA``, else the system's store. Like ``EMBER_TOKEN``, the variable is read when a
device string is first parsed: the CA file is part of the shared device object, so one address
with two CA files gives two devices (two sessions) that still compare equal.
"""

from __future__ import annotations

import os
import re
import threading
from urllib.parse import unquote, urlsplit

from .errors import DeviceError, EmberError, with_prefix

_SCHEME = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*:/*")


def redacted(spec) -> str:
    """``spec`` (a device string) as a message may show it: its userinfo — the token, everything
    between the scheme and the last ``@`` — written ``***``; a string without ``@`` is unchanged."""
    text = str(spec)
    if "@" not in text:
        return text
    scheme = _SCHEME.match(text)
    return text[:scheme.end() if scheme else 0] + "***@" + text.rpartition("@")[2]


def redact_secrets(text: str, *sources) -> str:
    """``text`` without the secrets of ``sources``: the userinfo of device strings, and tokens
    given as such (secrets under four characters are left: no secret, they would garble the text)."""
    secrets = set()
    for source in sources:
        if not isinstance(source, str) or not source:
            continue
        if "@" in source:
            scheme = _SCHEME.match(source)
            userinfo = source[scheme.end() if scheme else 0:].rpartition("@")[0]
            secrets.update({userinfo, unquote(userinfo), *userinfo.split(":"), *unquote(userinfo).split(":")})
        else:
            secrets.add(source)
    for secret in sorted(secrets, key=len, reverse=True):  # the whole userinfo before its parts
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


class Device:
    """A place where arrays live and operations run. Compare with ``==``; print for its string."""

    __slots__ = ("_engine", "_lock", "_tracked")
    kind = ""

    def __init__(self):
        self._engine = None
        self._lock = threading.Lock()
        self._tracked = None  # this device under autodiff, made once

    @property
    def engine(self):
        """The engine doing this device's work (created on first use)."""
        engine = self._engine
        if engine is None or engine.lost is not None:
            engine = self._renew()
        return engine

    def _renew(self):
        """A new engine in place of none or a lost one (a peer that went away: a new session)."""
        with self._lock:
            if self._engine is None or self._engine.lost is not None:
                self._engine = self._make_engine()
            return self._engine

    def _make_engine(self):
        raise NotImplementedError

    def literal(self, value, dtype):
        """Python scalar ``value``, a literal of ``dtype`` beside an array, in the form this device's
        engine takes it fastest: the scalar itself, but on a local device what
        :meth:`LocalEngine.literal` makes of it (the namespace asks before applying a binary op)."""
        return value

    @property
    def hardware(self) -> tuple:
        """What identifies the hardware: equal for devices that share it."""
        raise NotImplementedError

    def inner(self) -> Device:
        """The device under a wrapper (autodiff); a plain device returns itself."""
        return self

    def autodiff(self) -> Device:
        """This device with gradient tracking (``em.autodiff(self)``): the same object every time."""
        if self.kind == "autodiff":
            raise DeviceError(f"autodiff: {self} already tracks gradients; wrap the plain device once "
                              f"(ember computes first-order gradients)")
        with self._lock:
            if self._tracked is None:
                self._tracked = AutodiffDevice(self)
        return self._tracked

    def __eq__(self, other) -> bool:
        if isinstance(other, str):
            try:
                other = device(other)
            except DeviceError:
                return False
        return isinstance(other, Device) and self.hardware == other.hardware

    def __hash__(self) -> int:
        return hash(self.hardware)

    def __repr__(self) -> str:
        return f"ember.device({str(self)!r})"


class LocalDevice(Device):
    """A hardware device of a local backend (numpy, torch:cpu, torch:cuda:N, jax:cpu, jax:gpu:N)."""

    # a local engine is never lost, so once made it sits in a plain slot: ``device.engine`` on the
    # hot path of every op is an attribute read, not the base class's property (``__getattr__``
    # makes it on first use)
    __slots__ = ("backend_name", "name", "engine", "literal")
    kind = "local"

    def __init__(self, backend_name: str, name: str):
        super().__init__()
        self.backend_name, self.name = backend_name, name

    def __getattr__(self, name: str):
        if name not in ("engine", "literal"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        engine = self._renew()
        self.engine, self.literal = engine, engine.literal
        return getattr(self, name)

    def _make_engine(self):
        from .backends import backend_module
        from .engines.local import LocalEngine
        try:
            module = backend_module(self.backend_name)
        except ImportError as error:
            raise DeviceError(f"device {self.name!r} needs {self.backend_name}, which is not installed: "
                              f"pip install 'ember[{self.backend_name}]'") from error
        return LocalEngine(module.backend(self.name))

    @property
    def hardware(self) -> tuple:
        return ("local", self.name)

    def __str__(self) -> str:
        return self.name


class RemoteDevice(Device):
    """Device ``index`` of a compute peer reached over ``ember://`` (TCP) or ``ws://``, or over
    TLS with ``embers://`` or ``wss://``, trusting the CA certificates in ``tls_ca`` (a PEM file)
    or else the system's."""

    __slots__ = ("scheme", "host", "port", "index", "token", "tls_ca")
    kind = "remote"

    def __init__(self, scheme: str, host: str, port: int, index: int, token: str | None, tls_ca: str | None = None):
        super().__init__()
        self.scheme, self.host, self.port, self.index, self.token, self.tls_ca = scheme, host, port, index, token, tls_ca

    @property
    def tls(self) -> bool:
        """Whether the connection is wrapped in TLS (``embers://``, ``wss://``)."""
        return self.scheme in ("embers", "wss")

    @property
    def engine(self):
        """The session with the peer (opened on first use, and again once the peer ended it)."""
        engine = self._engine
        if engine is not None and engine.recheck:
            engine.check()  # before a new batch: did the peer end the session meanwhile?
        if engine is None or engine.lost is not None:
            engine = self._renew()
        return engine

    def _make_engine(self):
        from .engines.remote import connect  # the remote engine picks the framing for its scheme
        return connect(self)

    def _renew(self):
        """A new session in place of none or a lost one. Where the lost one's peer cannot be reached
        (or refuses), the error says first that the lost session and its arrays' data are gone: a
        read of an array made in it (pending when the peer restarted) fails for that, whatever
        becomes of a new session."""
        with self._lock:
            lost = self._engine
            if lost is not None and lost.lost is None:  # another thread renewed it meanwhile
                return lost
            try:
                self._engine = self._make_engine()
                return self._engine
            except EmberError as error:
                if lost is None:  # the first session: nothing was lost
                    raise
                failed = error
        raise with_prefix(failed, f"the session with {self} is lost, and the data of its arrays with it "
                                  f"({lost.lost}); a new one cannot be opened") from None

    @property
    def hardware(self) -> tuple:
        return ("remote", self.host, self.port, self.index)

    def __str__(self) -> str:  # never prints the token
        return f"{self.scheme}://{_host_port(self.host, self.port)}/{self.index}"


class CaptureDevice(Device):
    """A device that records operations into a graph and never executes them."""

    __slots__ = ("scope",)
    kind = "capture"

    def __init__(self, scope=None):
        super().__init__()
        self.scope = scope

    def _make_engine(self):
        from .engines.capture import CaptureEngine
        return CaptureEngine(self, self.scope)

    @property
    def hardware(self) -> tuple:
        return ("capture", id(self.scope) if self.scope is not None else 0)

    def __str__(self) -> str:
        return "capture" if self.scope is None else f"capture[{id(self.scope):x}]"


class AutodiffDevice(Device):
    """Gradient tracking on top of another device; ``inner()`` is that device, and the two
    compare equal (one hardware)."""

    __slots__ = ("_inner",)
    kind = "autodiff"

    def __init__(self, inner: Device):
        super().__init__()
        self._inner = inner

    def _make_engine(self):
        from .engines.autodiff import AutodiffEngine
        return AutodiffEngine(self._inner)

    @property
    def hardware(self) -> tuple:
        return self._inner.hardware

    def inner(self) -> Device:
        return self._inner

    def __str__(self) -> str:
        return f"autodiff({self._inner})"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_DEVICES: dict[str, Device] = {}
_DEVICES_LOCK = threading.Lock()
DEFAULT_PORT = 7878


def device(spec: str | Device | None = None, *, tls_ca: str | os.PathLike | None = None) -> Device:
    """The device named by ``spec`` (see the module docstring); ``None`` gives the default.
    ``tls_ca`` is a PEM file of the CA certificates an ``embers://`` or ``wss://`` device trusts.

    Devices are shared: ``device("numpy") is device("numpy")``.
    """
    if spec is None and tls_ca is None:
        return default_device()
    if isinstance(spec, Device) and tls_ca is None:
        return spec
    if not isinstance(spec, str):
        raise _tls_ca_misplaced(spec) if tls_ca else DeviceError(f"expected a device or a device string, got "
                                                                 f"{redacted(repr(spec))}")
    if tls_ca is not None:
        tls_ca = os.path.abspath(tls_ca)  # the file, wherever the program changes directory to later
    key = spec if tls_ca is None else (spec, tls_ca)
    try:
        return _DEVICES[key]
    except KeyError:
        pass
    parsed = _parse(spec, tls_ca)
    if tls_ca is not None and not (isinstance(parsed, RemoteDevice) and parsed.tls):
        raise _tls_ca_misplaced(spec)
    with _DEVICES_LOCK:
        return _DEVICES.setdefault(key, _DEVICES.setdefault(_canonical(parsed), parsed))


def _tls_ca_misplaced(spec) -> DeviceError:
    return DeviceError(f"tls_ca applies to TLS device strings (embers://, wss://), not {redacted(spec)!r}")


def _canonical(d: Device) -> str:
    if not isinstance(d, RemoteDevice):
        return str(d)
    return f"{d.scheme}://{d.token or ''}@{_host_port(d.host, d.port)}/{d.index}" + (f" {d.tls_ca}" if d.tls_ca else "")


def _parse(spec: str, tls_ca: str | None = None) -> Device:
    text = spec.strip()
    if text == "numpy":
        return LocalDevice("numpy", "numpy")
    if text == "capture":
        return CaptureDevice()
    if text == "torch" or text.startswith("torch:"):
        parts = text.split(":")[1:] or ["cpu"]
        kind = parts[0]
        if kind == "cpu" and len(parts) == 1:
            return LocalDevice("torch", "torch:cpu")
        if kind == "cuda" and len(parts) <= 2:
            index = parts[1] if len(parts) == 2 else "0"
            if index.isdigit():
                return LocalDevice("torch", f"torch:cuda:{int(index)}")
        raise DeviceError(f"bad torch device {redacted(spec)!r}: expected torch:cpu, torch:cuda or torch:cuda:N")
    if text == "jax" or text.startswith("jax:"):
        parts = text.split(":")[1:] or ["cpu"]
        if parts == ["cpu"]:
            return LocalDevice("jax", "jax:cpu")
        if parts[0] == "gpu" and len(parts) <= 2 and (len(parts) == 1 or parts[1].isdigit()):
            return LocalDevice("jax", f"jax:gpu:{int(parts[1]) if len(parts) == 2 else 0}")
        raise DeviceError(f"bad jax device {redacted(spec)!r}: expected jax:cpu, jax:gpu or jax:gpu:N")
    if "://" in text:
        return _parse_remote(spec, text, tls_ca)
    raise DeviceError(f"unknown device {redacted(spec)!r}: expected numpy, torch:cpu, torch:cuda:N, jax:cpu, jax:gpu:N, "
                      f"capture, ember://host:port/N or ws://host:port/N (embers:// or wss:// over TLS)")


def _parse_remote(spec: str, text: str, tls_ca: str | None) -> RemoteDevice:
    shown = redacted(spec)  # errors name the string without its token, and hold no exception that has it
    try:
        url = urlsplit(text)
        host, port = url.hostname, url.port or DEFAULT_PORT
        problem = None
    except ValueError as error:
        problem = redact_secrets(str(error), spec)
    if problem is not None:  # raised here, out of the except clause: no __context__ quotes the string
        raise DeviceError(f"bad remote device {shown!r}: {problem}")
    if url.scheme not in ("ember", "ws", "embers", "wss"):
        raise DeviceError(f"bad remote device {shown!r}: the scheme must be ember:// (TCP) or ws:// (WebSocket), "
                          f"or embers:// or wss:// over TLS")
    if not host:
        raise DeviceError(f"bad remote device {shown!r}: no host")
    path = url.path.strip("/") or "0"
    if not path.isdigit():
        raise DeviceError(f"bad remote device {shown!r}: the path must be a device index like /0")
    token = unquote(url.username) if url.username else os.environ.get("EMBER_TOKEN") or None
    if url.scheme in ("embers", "wss") and tls_ca is None and os.environ.get("EMBER_TLS_CA"):
        tls_ca = os.path.abspath(os.environ["EMBER_TLS_CA"])
    return RemoteDevice(url.scheme, host, port, int(path), token, tls_ca)


def default_device() -> Device:
    """The device of arrays made without one: ``$EMBER_DEVICE``, else ``numpy``."""
    return device(os.environ.get("EMBER_DEVICE") or "numpy")
