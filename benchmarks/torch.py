"""The PyTorch front end's benchmark (``ember.torch``): a Transformer encoder's training step, unchanged.

The model: an Embedding (vocabulary 1,000), two ``nn.TransformerEncoderLayer`` (width 128, 4
heads, feed-forward 512, dropout 0.1), a LayerNorm and a Linear head over the sequence's mean;
batch 32, sequence 64, ``torch.optim.AdamW`` (foreach), cross-entropy, ``loss.item()`` each step.

(a) the step on a ``torch:cpu`` peer over loopback vs torch eager in this process (target ≤ 1.3×);
    the same step on the local numpy device for contrast;
(b) the per-op cost of the front end: ``a + b`` of two small ember tensors (``ember.torch`` on the
    numpy device, through ``__torch_dispatch__`` and its lowering) vs ember's own eager ``em.add``;
(c) the step through a delay line of 10 ms each way (benchmarks/delayline.py) to the same peer: what
    the line adds to the step straight to it, in multiples of the line's round trip as a raw TCP echo
    measures it (target ≤ 1.2 RTT), with the round trips counted; and the whole step in RTTs, which
    here is mostly compute (the client's dispatch and the peer's kernels share this machine).

``torch.compile(backend=ember.torch.backend(...))`` is not built yet: its row says so.
"""

from __future__ import annotations

from ember.remote.spawn import PeerProcess

from .delayline import DelayLine
from .rawsocket import RawPeer
from .timing import Report, Row, medians

DELAY = 0.010  # seconds each way: a 20 ms round trip
SIZES = {"vocabulary": 1000, "width": 128, "heads": 4, "layers": 2, "batch": 32, "length": 64, "classes": 10}
QUICK_SIZES = {**SIZES, "batch": 8, "length": 16}


def _stepper(device, sizes: dict):
    """A training step of the encoder on ``device`` (None: torch eager), as a function of no arguments that
    returns the loss read, and what it counted: ``trips`` of its last call where the device is ember's."""
    import torch
    from torch import nn

    import ember as em
    import ember.torch as et

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            width = sizes["width"]
            self.embed = nn.Embedding(sizes["vocabulary"], width)
            layer = nn.TransformerEncoderLayer(width, sizes["heads"], 4 * width, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, sizes["layers"], enable_nested_tensor=False)
            self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, sizes["classes"])

        def forward(self, tokens):
            return self.head(self.norm(self.encoder(self.embed(tokens))).mean(dim=1))

    torch.manual_seed(0)
    model = Encoder()
    tokens = torch.randint(0, sizes["vocabulary"], (sizes["batch"], sizes["length"]))
    labels = torch.randint(0, sizes["classes"], (sizes["batch"],))
    if device is not None:  # the one line that differs
        model, tokens, labels = et.to_device(model, device), et.to_device(tokens, device), et.to_device(labels, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    counted = {}

    def step():
        before = em.stats(device)["round_trips"] if device is not None and device.kind == "remote" else None
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(tokens), labels)
        loss.backward()
        optimizer.step()
        value = loss.item()
        if before is not None:
            counted["trips"] = em.stats(device)["round_trips"] - before
        return value
    step.counted = counted
    return step


def _per_op(repeats: int):
    """(b): seconds per ``a + b`` through the front end and through ember alone, on the numpy device."""
    import numpy as np
    import torch

    import ember as em
    import ember.torch as et

    host = np.ones(16, np.float32)
    a, b = em.asarray(host), em.asarray(host)
    ta, tb = et.to_device(torch.from_numpy(host), "numpy"), et.to_device(torch.from_numpy(host), "numpy")
    ops = 200

    def front_end():
        for _ in range(ops):
            ta + tb

    def ember_alone():
        for _ in range(ops):
            a + b
    t = medians({"front end": front_end, "ember": ember_alone}, repeats)
    return t["front end"] / ops, t["ember"] / ops, t.stolen


def run(quick: bool = False) -> Report:
    """Measure (a)–(c); ``quick``: batch 8, sequence 16 and fewer repeats."""
    report = Report("torch")
    try:
        import torch  # noqa: F401
    except ImportError:
        report.notes.append("skipped: PyTorch is not installed: pip install 'ember[torch]'")
        return report
    import ember as em

    sizes = QUICK_SIZES if quick else SIZES
    repeats = 3 if quick else 7
    with PeerProcess("--device", "torch:cpu") as peer, DelayLine(DELAY) as line:
        remote = em.device(peer.url())
        far = em.device(f"ember://{line.route(peer.address)}/0")
        steps = {"eager": _stepper(None, sizes), "peer": _stepper(remote, sizes), "numpy": _stepper(em.device("numpy"), sizes)}
        t = medians(steps, repeats, warmup=2)
        report.add(Row("(a) Transformer-encoder AdamW step, torch:cpu peer", t["peer"], "torch eager", t["eager"], "≤ 1.30x",
                       round_trips=steps["peer"].counted["trips"], stolen=t.stolen))
        report.add(Row("(a) the same step, numpy device", t["numpy"], "torch eager", t["eager"], "reported", stolen=t.stolen))
        report.notes.append("(a) compiled, torch.compile(backend=ember.torch.backend(...)): not built yet")

        front, alone, stolen = _per_op(repeats * 3)
        report.add(Row("(b) one op through ember.torch, numpy", front, "ember's own op", alone, "reported", stolen=stolen))

        echo = RawPeer(through=line.route)
        try:
            echo.start_echo(64)
            distant = _stepper(far, sizes)
            t = medians({"echo": echo.echo, "far": distant, "near": steps["peer"]}, repeats, warmup=2)
        finally:
            echo.close()
        report.add(Row("(c) the line's cost: step through it less the step straight", t["far"] - t["near"], "RTT",
                       t["echo"], "≤ 1.20x", round_trips=distant.counted["trips"], stolen=t.stolen))
        report.add(Row("(c) the step through the line, whole", t["far"], "RTT", t["echo"], "reported", stolen=t.stolen))
    report.notes.append(f"model: width {sizes['width']}, {sizes['layers']} layers, {sizes['heads']} heads, batch "
                        f"{sizes['batch']}, sequence {sizes['length']}, AdamW (foreach); eager uses "
                        f"{torch.get_num_threads()} intra-op threads, as the peer does")
    return report
