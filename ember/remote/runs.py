"""Runs of ops a peer has seen before, replayed as compiled plans.

A client sends each run of consecutive one-output ops as one ``("ops", base, inputs, blob)``
message, its tensor ids relative (the format is ``ember/wire/runs.py``'s), with the outputs the
client let go before it sent the run (a chain's intermediates, as Burn's tensor status tells a
backend which tensors it may consume). The peer never stores those: each is
freed after the last record that reads it, and a compiled run computes them in buffers of its own,
written over in place. So a loop that repeats a computation sends the same blob every time, and
the peer keys what it learnt of a run by those bytes. At a blob's second sighting the peer
compiles its records, against the metas their inputs have then, into a local engine plan (rules
checked once, literals converted once, kernels called straight); later sightings whose inputs
still have those metas replay it. Anything the plan cannot vouch for — an input missing, failed or
of another meta, an output id in use, no room in the budget, a kernel raising — runs op by op
instead, as the first sighting did, so errors, poisons and accounting are the op path's own: a
plan stores nothing until every kernel has run.
"""

from __future__ import annotations

from ..errors import EmberError
from ..ops.records import check_records
from ..wire.runs import tensor_of

KEPT_RUNS = 64           # blobs a session remembers (seen once, or compiled); past that it starts again
KEPT_BLOB_BYTES = 16 << 10  # a longer blob is run op by op every time (a 64-op chain's is about 1.5 KiB)
NOT_COMPILED = False      # what a session remembers of a run it cannot compile


def endings(records: tuple, let_go: tuple) -> dict:
    """Index -> the outputs let go right after that record: each after the last record that makes
    or reads it, as eager execution frees an array after its last use."""
    going = set(let_go)
    last = {}
    for index, (_, refs, outs, _) in enumerate(records):
        for refs_or_outs in (refs, outs):
            if type(refs_or_outs) is tuple:
                for ref in refs_or_outs:
                    if type(ref) is int and ref in going:
                        last[ref] = index
    ended: dict = {}
    for ref, index in last.items():
        ended.setdefault(index, []).append(ref)
    return ended


def peak(records: tuple, needs: list, ended: dict, metas: dict, overhead: int = 0) -> int:
    """The most bytes the op path holds at once running ``records``: each record's need while it
    runs (``needs``: its outputs, and its kernels' scratch) over what the records before it made
    and still hold — each output its bytes and ``overhead`` (its id's, as the session counts it) —
    the outputs in ``ended`` (what :func:`endings` makes) let go after their last use. What a
    compiled run or graph reserves: its plan holds no more."""
    held = most = 0
    for index, (_, _, outs, _) in enumerate(records):
        most = max(most, held + needs[index])
        held += sum(metas[o].nbytes + overhead for o in outs)
        held -= sum(metas[ref].nbytes + overhead for ref in ended.get(index, ()))
    return most


class RunPlan:
    """A run compiled for the metas its inputs had: ``replay`` runs it, or says it cannot."""

    __slots__ = ("plan", "inputs", "outputs", "kept", "metas", "sizes", "held", "need")

    def __init__(self, plan, inputs: list, outputs: list, kept: list, metas: list, need: int, overhead: int = 0):
        self.plan = plan
        self.inputs = inputs    # (relative reference, the meta it had) per input of the plan, in its order
        self.outputs = outputs  # every relative output id: none may be in use
        self.kept = kept        # those the client holds, in the plan's order, and their metas and sizes
        self.metas = metas
        self.sizes = [meta.nbytes + overhead for meta in metas]  # as the table counts them: with their ids' overhead
        self.held = sum(self.sizes)
        self.need = need        # the most the op path holds at once: what a replay reserves

    @classmethod
    def compile(cls, table, engine, records: tuple, let_go: tuple, ended: dict, base: int, inputs: tuple,
                overhead: int = 0) -> RunPlan | bool:
        """The plan of ``records`` as the tensors of ``table`` (a session's
        :class:`~ember.remote.tensors.TensorTable`) stand, run once already by ``engine``, or NOT_COMPILED
        where a record is one the plan does not take: several outputs, a data-dependent size,
        kernel scratch, an output over the tensor limit, an input that failed. The outputs
        ``let_go`` are the plan's own: freed after their last use (``ended``, what :func:`endings`
        made of them), or written over in place. Each output costs ``overhead`` besides its bytes
        (the session's per-id overhead), as on the op path."""
        made: set = set()
        known: dict = {}  # relative reference -> meta, of every input
        for _, refs, outs, _ in records:
            if type(refs) is not tuple or type(outs) is not tuple or any(type(o) is not int for o in outs):
                return NOT_COMPILED  # the op path refuses these
            for ref in refs:
                if type(ref) is int and ref not in made and ref not in known:
                    tid = tensor_of(ref, base, inputs)
                    meta = table.metas.get(tid) if type(tid) is int else None
                    if meta is None:  # unknown, failed, or being fetched
                        return NOT_COMPILED
                    known[ref] = meta
            made.update(outs)
        input_metas = dict(known)
        try:
            checked = check_records(records, known)
        except (EmberError, TypeError, ValueError):  # the op path says what is wrong with it
            return NOT_COMPILED
        limit = table.quota.limits.max_tensor_bytes
        for row, _, _, _, _, out_metas in checked:
            if row.multiple or row.data_dependent or row.scratch is not None or out_metas[0].nbytes > limit:
                return NOT_COMPILED
        outputs = [outs[0] for _, _, outs, _, _, _ in checked]
        if min(outputs, default=0) < 0:
            return NOT_COMPILED
        going = set(let_go)
        kept = list(dict.fromkeys(o for o in outputs if o not in going))
        ops = [(row, refs, outs, attrs) for row, refs, outs, attrs, _, _ in checked]
        need = peak(ops, [out_metas[0].nbytes + overhead for *_, out_metas in checked], ended, known, overhead)
        if not engine.computes_every_dtype:  # its op path checks each op's dtypes; a plan would not
            return NOT_COMPILED
        try:
            plan = engine.compile(ops, list(input_metas), {}, kept, known, native=False)
        except EmberError:  # a row without a kernel here: the op path refuses it by name
            return NOT_COMPILED
        return cls(plan, list(input_metas.items()), outputs, kept, [known[o] for o in kept], need, overhead)

    def replay(self, table, base: int, inputs: tuple) -> bool:
        """Run the plan on the tensors of ``table`` and keep its outputs there, or leave everything as
        it was and answer False: the caller then runs the records op by op."""
        if table.sent or base < 0:
            return False
        tensors, metas, sizes = table.tensors, table.metas, table.sizes
        values = []
        for ref, meta in self.inputs:
            tid = tensor_of(ref, base, inputs)
            value = tensors.get(tid) if type(tid) is int else None
            if value is None or metas.get(tid) != meta:  # missing, failed (no meta), or another shape or dtype
                return False
            values.append(value)
        for ref in self.outputs:
            if base + ref in sizes:  # in use, or being fetched: the op path writes over it
                return False
        need, quota = self.need, table.quota
        inline = quota.fits(need)
        if not inline and quota.reserve(need, len(self.kept)) is not None:  # no room: the op path refuses the op
            return False                                                    # that does not fit
        try:
            results = self.plan.run(values)
        except Exception:
            quota.give(need)
            return False
        kept = self.kept  # most runs keep their last output alone: a new id (checked above), its size the held bytes
        if len(kept) != 1 or not table.add(base + kept[0], results[0], self.metas[0], self.held):
            table.keep([base + ref for ref in kept], results, self.metas, self.held, True, self.sizes)
        if need > self.held:  # what the outputs let go held while the plan ran; reserved inline, the ceiling stays
            # right (the kept ids raised used by their overhead at least, net); through reserve, it is set again
            (quota.give_back if inline else quota.give)(need - self.held)
        return True
