"""Fleets of compute peers on Ray (``pip install 'ember[ray]'``).

    import ember.ray
    devices = ember.ray.launch(4, device="torch:cuda")   # one peer per GPU of the Ray cluster
    ...                                                   # plain ember remote devices, tokens attached
    ember.ray.shutdown()

Each peer is a Ray actor that runs an ember :class:`~ember.remote.server.Server` on its own threads,
in the actor's process, listening on its node's address (a free port): the server dies with the
actor, and the actors with the program that launched them (Ray ends the actors a driver owns when
it exits). ``launch`` draws a token for each peer (``secrets.token_urlsafe``) and returns devices
that carry it, as ``ember://TOKEN@host:port/N`` would; a device prints without its token, and
nothing here logs or shows one. The serving rules hold as for ``ember serve``: a peer off
loopback needs TLS (``tls_cert=``, ``tls_key=``: files on every node, a certificate valid for
every node's address; ``tls_ca=`` for the client and the peers to trust) unless ``insecure=True``
says the cluster's network is trusted; a token it always has. The peers of a fleet fetch tensors
from each other (``x.to_device``, ``ember.distributed``) and from no other peer: ``launch`` fills
each one's ``fetch_from`` with the fleet's addresses once they all listen.

The actors are named ``ember-FLEET-I`` in the Ray namespace ``ember``, so another program on the
cluster finds them: ``peers()`` (and ``ember devices ray://auto``) lists them, never their tokens.

``import ember`` never imports Ray; this module imports it when called.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

from .devices import Device
from .devices import device as as_device
from .errors import ArgumentError, EmberError
from .remote.server import Server, is_loopback

NAMESPACE = "ember"  # the Ray namespace of every peer actor
_launched: list = []  # the actor handles of the peers this process launched, until shutdown()


def _ray():
    try:
        import ray
    except ImportError as error:
        raise ImportError("ember.ray needs Ray, which is not installed: pip install 'ember[ray]'") from error
    return ray


@dataclass(frozen=True)
class Peer:
    """A running peer of a fleet, as any program on the cluster may see it (no token)."""

    name: str              # its Ray actor's name, in the namespace ``ember``
    url: str               # "ember://host:port" (or embers:// with TLS); its devices are url/0, url/1 …
    devices: tuple         # what it hosts, by index: ("numpy",), ("torch:cuda:0",) …
    node: str              # the address of its Ray node
    pid: int               # its process on that node


class PeerActor:
    """One peer: an ember server in this Ray worker process (it ends when the process does)."""

    def __init__(self, fleet: str, index: int):
        self.fleet, self.index, self.server = fleet, index, None

    def start(self, device: str, token: str, host: str | None, options: dict):
        """Serve ``device`` with ``token`` on ``host`` (None: this node's address); this node's
        address, and this peer's description or the error that refused it."""
        import ray
        node = ray.util.get_node_ip_address()
        listen = host or node
        try:
            self.server = Server(device, f"[{listen}]:0" if ":" in listen else f"{listen}:0", token=token, **options).start()
        except (EmberError, OSError) as error:
            return node, error
        return node, self.describe()

    def describe(self) -> Peer | None:
        import ray
        server = self.server
        if server is None:
            return None
        host = f"[{server.host}]" if ":" in server.host else server.host
        return Peer(name=f"ember-{self.fleet}-{self.index}", url=f"{'embers' if server.tls else 'ember'}://{host}:{server.port}",
                    devices=tuple(str(d) for d in server.devices), node=ray.util.get_node_ip_address(), pid=os.getpid())

    def trust(self, addresses: list) -> None:
        """Fetch tensors from the peers at ``addresses`` ("host:port": the fleet's, this one's too)."""
        self.server.fetcher.trust(addresses)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def launch(n: int, device: str = "numpy", *, resources: dict | None = None, host: str | None = None,
           tls_ca: str | None = None, timeout: float = 120, **options) -> list[Device]:
    """Start ``n`` compute peers hosting ``device`` as Ray actors; their devices, peer by peer.

    - ``resources``: the Ray options of each peer's actor (``num_cpus``, ``num_gpus``, custom
      ``resources``, ``scheduling_strategy`` …); by default one GPU for a CUDA device (Ray makes
      it the peer's only visible one: one peer per GPU), else one CPU, spread over the nodes.
    - ``host``: where each peer listens; None (the default) for its node's address, which the
      other nodes reach; "127.0.0.1" for a cluster on this one machine (then no TLS is needed).
    - ``tls_ca``: the CA file the returned devices trust, and the peers when they fetch from each
      other; ``options`` go to each peer's :class:`~ember.Server`: ``tls_cert``, ``tls_key``,
      ``insecure``, ``max_memory``, ``idle_timeout``, ``transfer_ttl`` … Each peer fetches tensors from
      the fleet's other peers (their addresses fill its ``fetch_from``), and from those of a
      ``fetch_from`` given here.
    - ``timeout``: seconds to wait for the cluster to place every peer.

    Starts a local Ray instance (``ray.init()``) when this process has not connected to one. A
    peer that cannot start stops the others and raises its error, naming the peer and its node.
    """
    ray = _ray()
    if not (isinstance(n, int) and n >= 1):
        raise ArgumentError(f"ember.ray.launch: n is the number of peers, a whole number ≥ 1, got {n!r}")
    for key in ("token", "authorize", "listen"):
        if key in options:
            raise ArgumentError(f"ember.ray.launch: {key}= is not an option: launch draws each peer's token and "
                                f"listens on its node's address (host=)")
    device = str(as_device(device).inner())  # a bad device string is refused here, before Ray starts anything
    if resources is None:
        resources = {"num_gpus": 1} if device.startswith("torch:cuda") else {"num_cpus": 1}
    resources = {"scheduling_strategy": "SPREAD", **resources}
    if not ray.is_initialized():
        ray.init()
    options["tls_ca"] = tls_ca
    for key in ("tls_cert", "tls_key", "tls_ca"):  # files on every node: a path that means the same there
        if options.get(key):
            options[key] = os.path.abspath(options[key])
    fleet = secrets.token_hex(4)
    actor = ray.remote(PeerActor)
    actors = [actor.options(name=f"ember-{fleet}-{i}", namespace=NAMESPACE, **resources).remote(fleet, i) for i in range(n)]
    tokens = [secrets.token_urlsafe(32) for _ in range(n)]
    try:
        peers = _serving(ray, [a.start.remote(device, token, host, options) for a, token in zip(actors, tokens)],
                         host, timeout, resources)
        # the peers of a fleet fetch from each other (x.to_device, all_reduce) and from nobody else (--fetch-from)
        addresses = [peer.url.split("://", 1)[1] for peer in peers]
        ray.get([a.trust.remote(addresses) for a in actors], timeout=timeout)
    except BaseException:
        for a in actors:  # no client knows them yet: their servers simply end with their processes
            ray.kill(a)
        raise
    _launched.extend(actors)
    return [as_device(f"{peer.url.replace('://', f'://{token}@', 1)}/{index}",
                      tls_ca=options["tls_ca"] if peer.url.startswith("embers") else None)
            for peer, token in zip(peers, tokens) for index in range(len(peer.devices))]


def _serving(ray, started: list, host: str | None, timeout: float, resources: dict) -> list[Peer]:
    """The peers that ``started`` (their actors' ``start`` calls) describe, once all are placed
    and serving; the error of the first that cannot, naming it and its node."""
    ready, waiting = ray.wait(started, num_returns=len(started), timeout=timeout)
    if waiting:
        raise ArgumentError(f"ember.ray.launch: the Ray cluster placed {len(ready)} of {len(started)} peers within "
                            f"{timeout:g} s, each asking for {resources}; it has {ray.available_resources()} free")
    peers = []
    here = ray.util.get_node_ip_address()
    for i, (node, peer) in enumerate(ray.get(started)):
        problem = peer if isinstance(peer, Exception) else None
        if isinstance(problem, OSError):  # the address: not this node's, or taken
            problem = ArgumentError(str(problem))
        if problem is None and host and is_loopback(host) and node != here:
            problem = ArgumentError(f"host={host!r} is loopback, which only this node ({here}) reaches; leave host out")
        if problem is not None:
            raise type(problem)(f"ember.ray.launch: peer {i} on node {node}: {problem}")
        peers.append(peer)
    return peers


def shutdown() -> None:
    """Stop every peer this process launched: their sessions close, then their actors end.
    Arrays on them raise ``ConnectionLost`` at their next read. Ray itself keeps running."""
    actors, _launched[:] = list(_launched), []
    if actors:
        _stop(_ray(), actors)


def _stop(ray, actors: list) -> None:
    """Stop the actors' servers (their sessions close: no server listens when this returns), then
    end the actors."""
    ray.wait([a.stop.remote() for a in actors], num_returns=len(actors), timeout=30)  # a dead actor answers at once
    for a in actors:
        ray.kill(a)


def peers(address: str = "auto") -> list[Peer]:
    """The peers of every fleet running on a Ray cluster, by fleet and index (no tokens): of the
    cluster this process is connected to, else of the one at ``address`` (as ``ray.init`` takes
    it: "auto" finds ``RAY_ADDRESS`` or the cluster on this machine; "ray://head:10001" is Ray
    Client), connecting only for this call."""
    ray = _ray()
    connected = ray.is_initialized()
    if not connected:
        import logging
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    try:
        found = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] != NAMESPACE or not entry["name"].startswith("ember-"):
                continue
            try:
                peer = ray.get(ray.get_actor(entry["name"], namespace=NAMESPACE).describe.remote(), timeout=30)
            except (ray.exceptions.RayError, ValueError):
                continue  # ended while we looked
            if peer is not None:  # None: not serving (yet)
                found.append(peer)
        return sorted(found, key=lambda p: (p.name.rsplit("-", 1)[0], int(p.name.rsplit("-", 1)[1])))
    finally:
        if not connected:
            ray.shutdown()
