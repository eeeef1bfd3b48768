"""The run format: consecutive one-output ops sent as one ``("ops", base, inputs, blob)`` message.

``blob`` is the msgpack of ``(records, let_go)``: the run's ``(name, inputs, outputs, attrs)``
records, whose tensor ids are relative — ``r >= 0`` is tensor ``base + r`` (the run's first output
is ``base``), ``r < 0`` is tensor ``inputs[-1 - r]`` (an array made before the run) — and the
outputs the client let go before it sent the run. So a loop that repeats a computation sends the
same blob every time, whatever ids its tensors have, and a peer keys what it learnt of a run by
those bytes. A client's protocol logs ops into a :class:`Run` (``ClientProtocol._take_log``, on
its hot path, where a call more costs) and packs it here (:func:`encode_run`); the peer takes it
apart here (:func:`decode_run`, :func:`absolute`); what a peer does with it is
``ember/remote/runs.py``'s.
"""

from __future__ import annotations

from ..errors import ProtocolError
from . import protocol

BLOBS_KEPT = 8  # runs whose bytes a client keeps for an equal run to send again


class Run:
    """A run a client is building: relative records, and what it knows of their bytes."""

    __slots__ = ("base", "records", "inputs", "let_go", "reusable", "in_order")

    def __init__(self, base: int):
        self.base = base
        self.records: list = []
        self.inputs: dict = {}     # tensor id made before the run -> its position among the run's inputs
        self.let_go: list = []     # outputs the client let go, as relative ids
        self.reusable = True       # equal values pack to equal bytes (no zero or complex literal, no attributes)
        self.in_order = True       # its outputs are base, base + 1, … (another thread's upload may take one)

    def release(self, ids: list) -> list:
        """Note each of ``ids`` that is an output of this run as let go; return the others."""
        base, let_go, others = self.base, self.let_go, []
        if self.in_order:  # as a run most often has: its outputs are base … last
            last = base + self.records[-1][2][0]
            for tid in ids:
                if base <= tid <= last:
                    let_go.append(tid - base)
                else:
                    others.append(tid)
            return others
        outputs = {base + record[2][0] for record in self.records}
        for tid in ids:
            if tid in outputs:
                let_go.append(tid - base)
            else:
                others.append(tid)
        return others


def encode_run(run: Run, recent: list) -> tuple:
    """The ``ops`` message of ``run`` (the array a ``messages.Ops`` record packs to). Its blob is that
    of an equal run among ``recent`` — ``(records, let_go, blob)`` of the runs sent lately, newest
    first, at most BLOBS_KEPT — when there is one (a loop's, each time: comparing costs a fifth of
    packing), else packed and remembered there. Only runs whose equal values pack to equal bytes are looked up."""
    records, let_go = run.records, run.let_go
    if not run.reusable:
        blob = protocol.pack((records, let_go))
    else:
        for entry in recent:
            if entry[0] == records and entry[1] == let_go:
                blob = entry[2]
                break
        else:
            blob = protocol.pack((records, let_go))
            recent.insert(0, (records, let_go, blob))
            del recent[BLOBS_KEPT:]
    return ("ops", run.base, tuple(run.inputs), blob)  # what Ops(…) packs to, without its cost (client.py: _PLAIN)


def decode_run(blob) -> tuple[tuple, tuple]:
    """The records of a run's blob and the outputs its client let go; ProtocolError unless they are
    a list of 4-item records and a list of outputs those records make."""
    if type(blob) is not bytes:
        raise ProtocolError("an ops message is (base, inputs, blob): the blob must be msgpack bytes")
    run = protocol.unpack(blob)
    if type(run) is not tuple or len(run) != 2:
        raise ProtocolError(f"a run's blob is (records, outputs let go), got {run!r:.60}")
    records, let_go = run
    if type(records) is not tuple or any(type(r) is not tuple or len(r) != 4 for r in records):
        raise ProtocolError(f"a run's records are (name, inputs, outputs, attrs), got {records!r:.60}")
    if type(let_go) is not tuple:
        raise ProtocolError(f"a run's outputs let go are a list of its outputs, got {let_go!r:.60}")
    if let_go:
        made = {o for _, _, outs, _ in records if type(outs) is tuple for o in outs if type(o) is int}
        for ref in let_go:
            if type(ref) is not int or ref not in made:
                raise ProtocolError(f"a run's output let go, {ref!r:.20}, is not one of its records' outputs")
    return records, let_go


def tensor_of(ref: int, base: int, inputs: tuple):
    """The tensor id relative reference ``ref`` names, or None for an input beyond ``inputs``."""
    if ref >= 0:
        return base + ref
    return inputs[-1 - ref] if -ref <= len(inputs) else None


def absolute(records: tuple, base: int, inputs: tuple):
    """Each record as an ``("op", …)`` message with the tensor ids it names (what the op path runs)."""
    def tensor(ref):
        if type(ref) is not int:
            return ref  # a literal, or a malformed reference the op path refuses
        tid = tensor_of(ref, base, inputs)
        if tid is None:
            raise ProtocolError(f"a run's input {ref} is beyond its {len(inputs)} inputs")
        return tid
    for name, refs, outs, attrs in records:
        yield ("op", name, tuple(map(tensor, refs)) if type(refs) is tuple else refs,
               tuple(base + o if type(o) is int else o for o in outs) if type(outs) is tuple else outs, attrs)
