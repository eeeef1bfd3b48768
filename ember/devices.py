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

A TLS device trusts the CA certificates of ``device(spec, tls_ca=FILE)``, else of the file named
by ``EMBER_TLS_CA``, else the system's store. Like ``EMBER_TOKEN``, the variable is read when a
device string is first parsed: the CA file is part of the shared device object, so one address
with two CA files gives two devices (two sessions) that still compare equal.
"""

from __future__ import annotations

import os
import threading
from urllib.parse import unquote, urlsplit

from .errors import DeviceError


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
        raise _tls_ca_misplaced(spec) if tls_ca else DeviceError(f"expected a device or a device string, got {spec!r}")
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
    return DeviceError(f"tls_ca applies to TLS device strings (embers://, wss://), not {spec!r}")


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
        raise DeviceError(f"bad torch device {spec!r}: expected torch:cpu, torch:cuda or torch:cuda:N")
    if text == "jax" or text.startswith("jax:"):
        parts = text.split(":")[1:] or ["cpu"]
        if parts == ["cpu"]:
            return LocalDevice("jax", "jax:cpu")
        if parts[0] == "gpu" and len(parts) <= 2 and (len(parts) == 1 or parts[1].isdigit()):
            return LocalDevice("jax", f"jax:gpu:{int(parts[1]) if len(parts) == 2 else 0}")
        raise DeviceError(f"bad jax device {spec!r}: expected jax:cpu, jax:gpu or jax:gpu:N")
    if "://" in text:
        return _parse_remote(spec, text, tls_ca)
    raise DeviceError(f"unknown device {spec!r}: expected numpy, torch:cpu, torch:cuda:N, jax:cpu, jax:gpu:N, capture, "
                      f"ember://host:port/N or ws://host:port/N (embers:// or wss:// over TLS)")


def _parse_remote(spec: str, text: str, tls_ca: str | None) -> RemoteDevice:
    try:
        url = urlsplit(text)
        host, port = url.hostname, url.port or DEFAULT_PORT
    except ValueError as error:
        raise DeviceError(f"bad remote device {spec!r}: {error}") from None
    if url.scheme not in ("ember", "ws", "embers", "wss"):
        raise DeviceError(f"bad remote device {spec!r}: the scheme must be ember:// (TCP) or ws:// (WebSocket), "
                          f"or embers:// or wss:// over TLS")
    if not host:
        raise DeviceError(f"bad remote device {spec!r}: no host")
    path = url.path.strip("/") or "0"
    if not path.isdigit():
        raise DeviceError(f"bad remote device {spec!r}: the path must be a device index like /0")
    token = unquote(url.username) if url.username else os.environ.get("EMBER_TOKEN") or None
    if url.scheme in ("embers", "wss") and tls_ca is None and os.environ.get("EMBER_TLS_CA"):
        tls_ca = os.path.abspath(os.environ["EMBER_TLS_CA"])
    return RemoteDevice(url.scheme, host, port, int(path), token, tls_ca)


def default_device() -> Device:
    """The device of arrays made without one: ``$EMBER_DEVICE``, else ``numpy``."""
    return device(os.environ.get("EMBER_DEVICE") or "numpy")
