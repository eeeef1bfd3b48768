"""``ember.distributed``: collectives over arrays on several compute peers, run peer to peer.

    import ember.distributed as dist
    total = dist.all_reduce([x_on_a, y_on_a, z_on_b], op="sum")  # one result per input, on its device
    copies = dist.broadcast(w_on_a, [a, b, c])                     # w on each of a, b and c
    gathered = dist.all_gather([x_on_a, z_on_b])                   # np.stack of the inputs, on each device

**How.** The participants are the sessions the arrays live in (a *group* each: arrays in one
session are combined there first). The client draws a :class:`Plan` — rounds of
:class:`Transfer` between groups, from the group count alone — and issues it as ordinary
messages: each transfer is a grant on the source session and a fetch on the target
(:meth:`ember.engines.remote.RemoteEngine.move`, the primitive of ``x.to_device``), each
reduction an ordinary lazy op on the target, taken from the op table's rows (``add``,
``maximum``, ``divide`` …). Nothing waits: the client pays no round trip and sees no tensor byte
until a result is read; the peers pass the chunks among themselves, and each result stays on
its peer. ``all_reduce`` is a ring reduce-scatter (each group's buffer cut into one chunk per
group; chunk c travels the ring, every group adding its own part) followed by one round where
every group fetches the reduced chunks it lacks from their owners: each group sends and receives
about 2·(n−1)/n of the buffer, and every chunk is reduced — and, for ``mean``, divided — once, so
every result is the same bits. ``all_gather`` is one round (every group fetches every other
group's stack); ``broadcast`` a binomial tree (⌈log₂ n⌉ rounds).

**Semantics** (``torch.distributed``'s, with ember's immutable arrays): results are *new*
arrays and the inputs are left as they are — ``all_reduce`` returns one array per input, on
that input's device (inputs in one session share one result); ``all_gather`` returns, for each
input, ``stack(inputs)`` on its device, in the inputs' order; ``broadcast`` returns the array on
each device asked for (the array itself on its own device). Every array must be on a compute
peer (``ember://``, ``ws://``, ``embers://``, ``wss://``): one on a local device (numpy, torch)
or a capture is refused — the client would have to read and upload it, and collectives move no
tensor through the client; move it first with ``x.to_device(peer)``. Collectives record no
gradient: an array on ``em.autodiff(d)`` is taken by value and its result lives on ``d``.
Arrays must agree in shape and dtype. Errors in the call (shapes, dtypes, devices, ``op``) are
raised before anything is sent; a failure on the way — a peer unreachable from another, or gone
— surfaces at the first read of a result that depends on it (``em.ConnectionLost`` naming the
transfer), the other peers going on. To time a collective, ``em.sync`` each result's device.
"""

from __future__ import annotations

from dataclasses import dataclass

from .array import Array, bind
from .devices import Device
from .devices import device as as_device
from .errors import ArgumentError, ConnectionLost, DeviceError, DTypeError, EmberError, NotSupportedError, ShapeError, with_prefix
from .namespace.creation import zeros
from .namespace.manipulation import concat, reshape, stack
from .ops import OPS
from .ops.table import Meta, fmt_shape

__all__ = ["all_reduce", "broadcast", "all_gather", "Plan", "Transfer", "ring_all_reduce", "direct_all_gather",
           "tree_broadcast", "REDUCTIONS"]

#: ``op`` of :func:`all_reduce` → (the row combining two partial results, the row finishing the
#: total with the number of inputs, or None). Adding one is a line here: nothing else knows an op.
REDUCTIONS: dict[str, tuple[str, str | None]] = {
    "sum": ("add", None),
    "mean": ("add", "divide"),
    "max": ("maximum", None),
    "min": ("minimum", None),
    "prod": ("multiply", None),
}


# --- plans: which group sends which chunk to which, in rounds; pure data, no arrays ---------------

@dataclass(frozen=True)
class Transfer:
    """Group ``source`` sends its chunk ``chunk`` to group ``target``."""

    source: int
    target: int
    chunk: int


@dataclass(frozen=True)
class Plan:
    """A collective over ``groups`` groups whose buffers are cut into ``chunks`` chunks.

    ``reduce`` rounds combine: the target adds (or takes the maximum of …) what it receives into
    its own chunk. After them, group ``owner[c]`` holds chunk c complete. ``gather`` rounds copy:
    the target keeps what it receives. At the end every group holds every chunk complete. A
    round's transfers read the chunks as they were when the round began, so they may run at once.
    """

    groups: int
    chunks: int
    reduce: tuple[tuple[Transfer, ...], ...]
    owner: tuple[int, ...]
    gather: tuple[tuple[Transfer, ...], ...]

    @property
    def transfers(self) -> int:
        """How many transfers the plan makes (each a grant and a fetch)."""
        return sum(len(r) for r in self.reduce + self.gather)


def ring_all_reduce(groups: int) -> Plan:
    """A ring reduce-scatter — in round s, group g sends chunk (g − s) mod n to group g + 1, which
    combines it with its own — then one round in which every group fetches each reduced chunk it
    lacks from its owner (group c − 1 owns chunk c)."""
    _check_groups(groups)
    reduce = tuple(tuple(Transfer(g, (g + 1) % groups, (g - s) % groups) for g in range(groups))
                   for s in range(groups - 1))
    owner = tuple((c - 1) % groups for c in range(groups))
    gather = (tuple(Transfer(owner[c], t, c) for c in range(groups) for t in range(groups) if t != owner[c]),)
    return Plan(groups, groups, reduce, owner, gather if groups > 1 else ())


def direct_all_gather(groups: int) -> Plan:
    """Each group's chunk (its own contribution) fetched by every other group, in one round."""
    _check_groups(groups)
    gather = tuple(Transfer(s, t, s) for s in range(groups) for t in range(groups) if s != t)
    return Plan(groups, groups, (), tuple(range(groups)), (gather,) if gather else ())


def tree_broadcast(groups: int) -> Plan:
    """Group 0's only chunk to every group along a binomial tree: in round r, each group
    g < 2^r that has it sends it to g + 2^r."""
    _check_groups(groups)
    rounds, have = [], 1
    while have < groups:
        rounds.append(tuple(Transfer(g, g + have, 0) for g in range(have) if g + have < groups))
        have *= 2
    return Plan(groups, 1, (), (0,), tuple(rounds))


def _check_groups(groups: int) -> None:
    if type(groups) is not int or groups < 1:
        raise ArgumentError(f"a plan needs a positive number of groups, got {groups!r}")


# --- the collectives ---------------------------------------------------------------------------------

def all_reduce(arrays, op: str = "sum") -> list[Array]:
    """The elementwise reduction of ``arrays`` (arrays of one shape and dtype, on compute peers),
    as one new array per input on that input's device; the inputs are left as they are.

    ``op`` is ``"sum"``, ``"mean"`` (the sum divided by the number of arrays: floating dtypes),
    ``"max"``, ``"min"`` or ``"prod"``. Arrays in one session are combined there first; the
    sessions then reduce around a ring, peer to peer (see the module's doc). Nothing waits: a
    read of a result is the first round trip. Every result holds the same bits.
    """
    what = "all_reduce"
    items, meta = _participants(arrays, what)
    if not isinstance(op, str) or op not in REDUCTIONS:
        raise ArgumentError(f"{what}: op must be one of {', '.join(map(repr, REDUCTIONS))}; got {op!r}")
    combine, finish = (OPS[name] if name else None for name in REDUCTIONS[op])
    try:
        for row in (combine, finish):
            if row is not None and row.infer((meta, meta), {})[1] != (meta,):
                raise DTypeError(f"{row.name}: the result is not of the arrays' {meta.dtype}")
    except EmberError as error:
        raise with_prefix(error, f"{what}(op={op!r})") from None
    devices, members = _groups(items)
    partials = []
    for member in members:
        partial = items[member[0]][1]
        for i in member[1:]:
            partial = bind(combine, (partial, items[i][1]), {})
        partials.append(partial)
    plan = ring_all_reduce(len(devices))
    size = meta.size
    bounds = [size * c // plan.chunks for c in range(plan.chunks + 1)]
    chunked = plan.chunks > 1
    buffers = []
    for partial in partials:
        flat = reshape(partial, (size,)) if chunked and partial.ndim != 1 else partial
        buffers.append({c: flat[bounds[c]:bounds[c + 1]] if chunked else flat for c in range(plan.chunks)})

    def finished(chunk: Array) -> Array:
        if finish is None:
            return chunk
        return bind(finish, (chunk, float(len(items))), {}, literal_dtype=meta.dtype)

    _run(plan, buffers, devices, combine, finished)
    results = []
    for buffer in buffers:
        if not chunked:  # one session: a new array even where the input itself is the total
            results.append(Array._new(buffer[0]._handle, meta, buffer[0].device))
            continue
        flat = concat([buffer[c] for c in range(plan.chunks)], axis=0)
        results.append(reshape(flat, meta.shape) if len(meta.shape) != 1 else flat)
    group = {i: g for g, member in enumerate(members) for i in member}
    return [results[group[i]] for i in range(len(items))]


def all_gather(arrays) -> list[Array]:
    """``stack(arrays)`` — shape ``(len(arrays), *shape)``, in the inputs' order — as one new
    array per input, on that input's device. Each session stacks its own arrays, then every
    session fetches every other's stack directly, in one round; nothing waits."""
    what = "all_gather"
    items, meta = _participants(arrays, what)
    devices, members = _groups(items)
    buffers = [{g: stack([items[i][1] for i in member], axis=0)} for g, member in enumerate(members)]
    _run(direct_all_gather(len(devices)), buffers, devices)
    where = {i: (g, k) for g, member in enumerate(members) for k, i in enumerate(member)}
    results = []
    for g, buffer in enumerate(buffers):
        if len(members) == 1:
            results.append(buffer[0])
            continue
        pieces = [items[i][1] if where[i][0] == g else buffer[where[i][0]][where[i][1]] for i in range(len(items))]
        results.append(stack(pieces, axis=0))
    return [results[where[i][0]] for i in range(len(items))]


def broadcast(array: Array, devices) -> list[Array]:
    """``array`` on each of ``devices`` (compute peers; device objects or strings), as a list in
    that order: the array itself on its own device, a copy fetched peer to peer on every other,
    along a binomial tree rooted at the array's session. Nothing waits."""
    what = "broadcast"
    ((_, source),), meta = _participants([array], what, "array")
    if isinstance(devices, (str, Device)) or not hasattr(devices, "__iter__"):
        raise ArgumentError(f"{what}: devices must be a list of devices, got {type(devices).__name__}")
    targets = []
    for i, spec in enumerate(devices):
        try:
            target = as_device(spec).inner()
        except EmberError as error:
            raise with_prefix(error, f"{what}: devices[{i}]") from None
        if target.kind != "remote":
            raise DeviceError(f"{what}: devices[{i}] is {target}, not a compute peer: {_PEERS_ONLY}")
        targets.append(target)
    order = list({id(d): d for d in [source.device, *targets]}.values())  # sessions: devices equal by hardware may differ
    for target in order[1:]:
        engine = target.engine  # a new session starts here: one handshake
        if meta.dtype.name not in engine.dtypes:
            raise NotSupportedError(f"{what}: {target} ({engine.info.get('device')}) does not support {meta.dtype}")
    buffers = [{0: source}] + [{} for _ in order[1:]]
    _run(tree_broadcast(len(order)), buffers, order)
    result = {id(d): buffer[0] for d, buffer in zip(order, buffers)}
    return [result[id(d)] for d in targets]


# --- arguments, groups, and running a plan ---------------------------------------------------------

_PEERS_ONLY = ("collectives run peer to peer and move no tensor through the client; move the array to a peer "
               "first with x.to_device('ember://HOST:PORT/0')")


def _participants(arrays, what: str, name: str = "arrays") -> tuple[list[tuple[Device, Array]], Meta]:
    """Each array as (its peer device, the array on it, untracked), checked; and their common meta."""
    if isinstance(arrays, Array) or not hasattr(arrays, "__iter__"):
        raise ArgumentError(f"{what}: expected a list of ember arrays, got {type(arrays).__name__}")
    arrays = list(arrays)
    if not arrays:
        raise ArgumentError(f"{what}: expected at least one array, got an empty list")
    items = []
    for i, x in enumerate(arrays):
        label = name if name == "array" else f"{name}[{i}]"
        if type(x) is not Array:
            raise DTypeError(f"{what}: {label} is a {type(x).__name__}, not an ember array")
        device = x.device.inner()
        handle = x._handle if device is x.device else x.device.engine.unwrap(x._handle)
        if device.kind != "remote":
            raise DeviceError(f"{what}: {label} is on {device}, not on a compute peer: {_PEERS_ONLY}")
        if handle.engine.lost is not None:
            from .engines.remote import lost_session  # the remote engine is loaded with the first session
            raise lost_session(what, label, handle.engine)
        items.append((device, x if device is x.device else Array._new(handle, x._meta, device)))
    first_device, first = items[0][1].device, items[0][1]._meta
    for i, (device, x) in enumerate(items[1:], 1):
        if x.shape != first.shape:
            raise ShapeError(f"{what}: {name}[{i}] has shape {fmt_shape(x.shape)} on {device} but {name}[0] has shape "
                             f"{fmt_shape(first.shape)} on {first_device}; the arrays must have one shape")
        if x.dtype is not first.dtype:
            raise DTypeError(f"{what}: {name}[{i}] is {x.dtype} on {device} but {name}[0] is {first.dtype} on "
                             f"{first_device}; the arrays must have one dtype (cast with ember.astype)")
    return items, first


def _groups(items) -> tuple[list[Device], list[list[int]]]:
    """The sessions taking part, in order of first appearance, and the indices of each one's arrays.
    A session is a device object: two that compare equal (one peer's ``ember://`` and ``ws://``)
    are two sessions."""
    devices: dict[int, Device] = {}
    members: dict[int, list[int]] = {}
    for i, (device, _) in enumerate(items):
        devices.setdefault(id(device), device)
        members.setdefault(id(device), []).append(i)
    return list(devices.values()), list(members.values())


def _run(plan: Plan, buffers: list[dict], devices: list[Device], combine=None, finished=None) -> None:
    """Issue ``plan`` over ``buffers`` (per group, chunk → array), in place. Per session, each round
    sends its grants and fetches before its ops, so every grant follows the ops it reads and no
    session waits on a grant that comes after its own wait. An empty chunk is made where it goes."""
    for transfers in plan.reduce:
        arrived = [(t, _move(buffers[t.source][t.chunk], devices[t.target])) for t in transfers]
        for t, moved in arrived:
            if moved is not None:
                buffers[t.target][t.chunk] = bind(combine, (moved, buffers[t.target][t.chunk]), {})
    if finished is not None:
        for c, g in enumerate(plan.owner):
            buffers[g][c] = finished(buffers[g][c])
    for transfers in plan.gather:
        for t, moved in [(t, _move(buffers[t.source][t.chunk], devices[t.target])) for t in transfers]:
            if moved is None:
                chunk = buffers[t.source][t.chunk]
                moved = zeros(chunk.shape, dtype=chunk.dtype, device=devices[t.target])
            buffers[t.target][t.chunk] = moved


def _move(x: Array, target: Device) -> Array | None:
    """``x`` fetched by ``target``'s session from its own, peer to peer (None for an empty chunk:
    there is nothing to send)."""
    if x.size == 0:
        return None
    handle = x._handle
    moved = handle.engine.move(handle, x._meta, target.engine)
    if moved is None:  # the source session was lost while the plan went out
        raise handle.engine.lost or ConnectionLost(f"cannot move a tensor from {x.device} to {target}")
    return Array._new(moved, x._meta, target)
