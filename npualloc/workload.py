"""A built-in workload model: a transformer training loop, as the caching allocator sees it.

:func:`transformer_events` lists the tensor allocations and frees of a few training steps of a decoder-only
transformer (mixed precision: fp32 master weights, gradients and Adam state, bf16 activations):

- weights, allocated once; Adam's two moment buffers, allocated at the first optimizer step;
- the forward pass: per layer, activations kept for the backward pass (layer-norm outputs, the QKV projection,
  attention probabilities and the dropout mask, the MLP's hidden activations, residual outputs) and
  temporaries freed right away (attention scores, projections before the residual add);
- the loss: logits and an fp32 log-softmax over the vocabulary;
- the backward pass, last layer first: activation gradients passed down the layers, weight gradients
  (allocated each step: ``zero_grad(set_to_none=True)``), the saved activations released as each layer is done,
  and gradient buckets for the all-reduce on a second (communication) stream;
- the optimizer step (foreach Adam: temporaries per parameter), then the gradients and buckets are freed and the
  next batch is prefetched.

The sequence length changes from step to step (seeded), which is what fragments a caching allocator.

:func:`transformer_trace` turns the events into a memory snapshot in PyTorch's format (``segments``,
``device_traces``, ``allocator_settings``) by running them through a replay session with the memory history
on: the same dict ``_dump_snapshot`` pickles, so :mod:`npualloc.replay` (and torch's memory viewer) read it.
Recording starts at ``record_from_step`` (default 1), like a real trace recorded mid-run: what was allocated
before (the weights, Adam's state, the prefetched batch) appears only as frees of unknown addresses and as blocks
in the final segments.  With ``record_from_step=0`` everything is recorded, the weights too.
"""
import random
from array import array

from . import _C

__all__ = ["SIZES", "TransformerConfig", "transformer_events", "transformer_trace"]

COMM_STREAM = 0x5A5A0000  # the communication stream's handle in the generated trace (0 = the default stream)
TIME_BASE_US = 1_700_000_000_000_000

SIZES = {
    # a few hundred events: for tests
    "tiny": dict(layers=2, hidden=256, heads=4, vocab=2048, batch=2, seq_choices=(48, 64, 96), steps=3),
    # ~3k events
    "small": dict(layers=4, hidden=512, heads=8, vocab=8192, batch=4, seq_choices=(128, 192, 256), steps=4),
    # ~12k events (10k recorded), a ~5.7 GiB peak
    "default": dict(layers=12, hidden=1024, heads=16, vocab=32000, batch=8, seq_choices=(256, 320, 384, 448, 512),
                    steps=8),
}


class TransformerConfig:
    """The model and loop.  Sizes: fp32 = 4 bytes for weights, gradients, optimizer state; bf16 = 2 for
    activations."""

    def __init__(self, layers=12, hidden=1024, heads=16, ffn_mult=4, vocab=32000, batch=8,
                 seq_choices=(256, 320, 384, 448, 512), steps=8, record_from_step=1, seed=0, comm_stream=True,
                 bucket_layers=2):
        counts = dict(layers=layers, hidden=hidden, heads=heads, ffn_mult=ffn_mult, vocab=vocab, batch=batch,
                      steps=steps, bucket_layers=bucket_layers, record_from_step=record_from_step, seed=seed)
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if min(layers, hidden, heads, ffn_mult, vocab, batch, steps) < 1:
            raise ValueError("layers, hidden, heads, ffn_mult, vocab, batch and steps must be positive")
        seq_choices = tuple(seq_choices)
        if not seq_choices or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in seq_choices):
            raise ValueError(f"seq_choices must be positive ints, at least one, not {seq_choices!r}")
        if not 0 <= record_from_step < steps:
            raise ValueError(f"record_from_step must be in [0, steps), got {record_from_step}")
        self.layers, self.hidden, self.heads, self.ffn_mult = layers, hidden, heads, ffn_mult
        self.vocab, self.batch, self.seq_choices, self.steps = vocab, batch, seq_choices, steps
        self.record_from_step, self.seed = record_from_step, seed
        self.comm_stream, self.bucket_layers = comm_stream, max(1, bucket_layers)

    @classmethod
    def of_size(cls, size="default", **overrides):
        """The configuration of a named size in :data:`SIZES` ("tiny", "small" or "default"), with
        ``overrides`` (keyword arguments of the constructor) replacing its values; ValueError for another name."""
        if size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, not {size!r}")
        kw = dict(SIZES[size])
        kw.update(overrides)
        return cls(**kw)

    def to_dict(self):
        """The settings as a JSON-ready dict (``seq_choices`` as a list)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}


class _Events:
    """Collects (action, tensor id, size, stream, time_us, name); ids stand for addresses."""

    def __init__(self):
        self.action, self.tid, self.size, self.stream, self.time, self.name = [], [], [], [], [], []
        self.next_id = 1
        self.clock = 0
        self.record_start = None  # index of the first recorded event

    def alloc(self, nbytes, name, stream=0):
        t = self.next_id
        self.next_id += 1
        self.clock += 2 + nbytes // (64 << 20)  # a little time passes, more for big tensors
        for lst, v in ((self.action, 0), (self.tid, t), (self.size, int(nbytes)), (self.stream, stream),
                       (self.time, self.clock), (self.name, name)):
            lst.append(v)
        return t

    def free(self, t, stream=0):
        if t is None:
            return
        self.clock += 1
        for lst, v in ((self.action, 1), (self.tid, t), (self.size, 0), (self.stream, stream), (self.time, self.clock),
                       (self.name, None)):
            lst.append(v)

    def __len__(self):
        return len(self.action)


def transformer_events(cfg):
    """The events of the loop described by ``cfg`` (a :class:`TransformerConfig`): an ``_Events`` with parallel
    lists (action 0 = alloc / 1 = free, tensor id, size, stream, time, name) and ``record_start``."""
    rng = random.Random(cfg.seed)
    ev = _Events()
    h, L, V, B = cfg.hidden, cfg.layers, cfg.vocab, cfg.batch
    f = cfg.ffn_mult * h
    comm = COMM_STREAM if cfg.comm_stream else 0
    fp32, bf16 = 4, 2
    # parameters: per layer ln1 (w, b), qkv (w, b), out (w, b), ln2 (w, b), fc1 (w, b), fc2 (w, b)
    layer_params = [("ln1.weight", h), ("ln1.bias", h), ("attn.qkv.weight", 3 * h * h), ("attn.qkv.bias", 3 * h),
                    ("attn.out.weight", h * h), ("attn.out.bias", h), ("ln2.weight", h), ("ln2.bias", h),
                    ("mlp.fc1.weight", f * h), ("mlp.fc1.bias", f), ("mlp.fc2.weight", h * f), ("mlp.fc2.bias", h)]
    params = [("embedding.weight", V * h)]
    for l in range(L):
        params += [(f"layers.{l}.{n}", c) for n, c in layer_params]
    params += [("ln_f.weight", h), ("ln_f.bias", h)]
    if cfg.record_from_step == 0:
        ev.record_start = 0  # everything is recorded, the weights too
    weights = {n: ev.alloc(c * fp32, f"{n} (weight)") for n, c in params}
    adam = {}
    next_batch = None
    for step in range(cfg.steps):
        if step == cfg.record_from_step and step > 0:
            ev.record_start = len(ev)
        s = rng.choice(cfg.seq_choices)
        tok = B * s
        batch = next_batch if next_batch is not None else ev.alloc(tok * 8, f"step {step} input ids")
        next_batch = None
        # ---- forward ----
        saved = []
        x = ev.alloc(tok * h * bf16, f"step {step} embeddings")
        for l in range(L):
            keep = []
            p = f"step {step} layer {l}"
            ln1 = ev.alloc(tok * h * bf16, f"{p} ln1 output")
            keep.append(ev.alloc(tok * 2 * fp32, f"{p} ln1 mean/rstd"))
            qkv = ev.alloc(tok * 3 * h * bf16, f"{p} qkv")
            scores = ev.alloc(B * cfg.heads * s * s * bf16, f"{p} attention scores")
            probs = ev.alloc(B * cfg.heads * s * s * bf16, f"{p} attention probs")
            ev.free(scores)
            mask = ev.alloc(B * cfg.heads * s * s, f"{p} attention dropout mask")
            ctx = ev.alloc(tok * h * bf16, f"{p} attention context")
            proj = ev.alloc(tok * h * bf16, f"{p} attention out-projection")
            x1 = ev.alloc(tok * h * bf16, f"{p} residual 1")
            ev.free(proj)
            ln2 = ev.alloc(tok * h * bf16, f"{p} ln2 output")
            keep.append(ev.alloc(tok * 2 * fp32, f"{p} ln2 mean/rstd"))
            fc1 = ev.alloc(tok * f * bf16, f"{p} mlp fc1")
            act = ev.alloc(tok * f * bf16, f"{p} mlp gelu")
            fc2 = ev.alloc(tok * h * bf16, f"{p} mlp fc2")
            x2 = ev.alloc(tok * h * bf16, f"{p} residual 2")
            ev.free(fc2)
            keep += [ln1, qkv, probs, mask, ctx, x1, ln2, fc1, act, x]
            saved.append(keep)
            x = x2
        lnf = ev.alloc(tok * h * bf16, f"step {step} final layer norm")
        logits = ev.alloc(tok * V * bf16, f"step {step} logits")
        logp = ev.alloc(tok * V * fp32, f"step {step} log-softmax (fp32)")
        loss = ev.alloc(4, f"step {step} loss")
        # ---- backward ----
        ev.free(loss)
        g_logits = ev.alloc(tok * V * bf16, f"step {step} grad logits")
        ev.free(logp)
        ev.free(logits)
        grads = {"embedding.weight": None}
        grads["ln_f.weight"] = ev.alloc(h * fp32, "ln_f.weight (grad)")
        grads["ln_f.bias"] = ev.alloc(h * fp32, "ln_f.bias (grad)")
        gx = ev.alloc(tok * h * bf16, f"step {step} grad hidden")
        ev.free(g_logits)
        ev.free(lnf)
        ev.free(x)
        buckets, pending = [], []
        for l in reversed(range(L)):
            p = f"step {step} layer {l}"
            for n, c in layer_params:
                name = f"layers.{l}.{n}"
                grads[name] = ev.alloc(c * fp32, f"{name} (grad)")
            # grads of the MLP, then attention; temporaries the size of the activations
            t1 = ev.alloc(tok * f * bf16, f"{p} grad gelu")
            t2 = ev.alloc(tok * f * bf16, f"{p} grad fc1")
            ev.free(t1)
            t3 = ev.alloc(tok * h * bf16, f"{p} grad ln2")
            ev.free(t2)
            g_scores = ev.alloc(B * cfg.heads * s * s * bf16, f"{p} grad attention scores")
            t4 = ev.alloc(tok * 3 * h * bf16, f"{p} grad qkv")
            ev.free(g_scores)
            t5 = ev.alloc(tok * h * bf16, f"{p} grad ln1")
            ev.free(t4)
            ev.free(t3)
            for t in reversed(saved[l]):
                ev.free(t)
            new_gx = ev.alloc(tok * h * bf16, f"{p} grad hidden")
            ev.free(gx)
            ev.free(t5)
            gx = new_gx
            pending.append(l)
            if len(pending) == cfg.bucket_layers or l == 0:
                nbytes = sum(c for _, c in layer_params) * fp32 * len(pending)
                buckets.append(ev.alloc(nbytes, f"step {step} grad bucket layers {min(pending)}-{max(pending)}", comm))
                pending = []
        grads["embedding.weight"] = ev.alloc(V * h * fp32, "embedding.weight (grad)")
        ev.free(gx)
        ev.free(batch)
        # ---- optimizer (foreach Adam) ----
        for n, c in params:
            if n not in adam:
                adam[n] = (ev.alloc(c * fp32, f"{n} (adam exp_avg)"), ev.alloc(c * fp32, f"{n} (adam exp_avg_sq)"))
        for n, c in params:
            t1 = ev.alloc(c * fp32, f"{n} (adam temporary)")
            t2 = ev.alloc(c * fp32, f"{n} (adam denominator)")
            ev.free(t1)
            ev.free(t2)
        for b in buckets:
            ev.free(b, comm)
        for n, _ in params:
            ev.free(grads.get(n))
        next_batch = ev.alloc(B * rng.choice(cfg.seq_choices) * 8, f"step {step + 1} input ids (prefetch)")
    del weights
    return ev


_BLOCK_STATES = {0: "inactive", 1: "active_allocated", 2: "active_pending_free"}


def _segment_dict(seg, names):
    addr, total, allocated, active, requested, stream, is_small, is_exp, blocks = seg
    out_blocks = []
    for baddr, size, req, state in blocks:
        st = _BLOCK_STATES.get(state, "inactive")
        frames = [_frame(names[baddr])] if st != "inactive" and baddr in names else []
        out_blocks.append({"address": baddr, "size": size, "requested_size": req, "state": st, "frames": frames})
    return {"device": 0, "address": addr, "total_size": total, "allocated_size": allocated, "active_size": active,
            "requested_size": requested, "stream": stream, "segment_type": "small" if is_small else "large",
            "segment_pool_id": (0, 0), "is_expandable": bool(is_exp), "frames": [], "blocks": out_blocks}


def _frame(name):
    return {"filename": "npualloc/workload.py", "line": 0, "name": name}


_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "snapshot", "oom")


def transformer_trace(size="default", seed=0, conf="", device_memory=80 << 30, **overrides):
    """A memory snapshot (a dict in PyTorch's ``_snapshot()`` format) of the transformer loop, recorded
    through npualloc's allocator (NPU rounding) under ``conf``.  Deterministic for a given seed.

    ``size``: "tiny", "small" or "default" (see :data:`SIZES`); ``device_memory``: the recording device's
    capacity, bytes or a size string ("80GiB"); ``overrides`` set any
    :class:`TransformerConfig` field (e.g. ``steps=4``, ``record_from_step=0`` to record from the start).
    """
    from .replay import _device_memory

    device_memory = _device_memory(device_memory)
    cfg = TransformerConfig.of_size(size, seed=seed, **overrides)
    ev = transformer_events(cfg)
    n = len(ev)
    action = bytes(ev.action)
    tid = array("Q", ev.tid)
    sizes = array("Q", ev.size)
    streams = array("Q", ev.stream)
    # Ids stand in for addresses: ids are unique, so the session's map never sees a reuse.
    session = _C.replay.Session(conf or None, int(device_memory), 0, _C.replay.PAD_NPU, 0.0, False, 16,
                                4, 4 * n + 64)
    start = ev.record_start or 0
    if start:
        session.feed(action, tid, sizes, streams, 0, start)
        skip = len(session.snapshot()[1])
    else:
        skip = 0
    session.feed(action, tid, sizes, streams, start, n - start)
    result = session.result()
    if result["ooms"]:
        raise RuntimeError(f"the workload does not fit in {device_memory} bytes of device memory")
    segments, traces = session.snapshot()
    # Map the history back to the events: alloc and free_requested entries follow the events one to one
    # (no OOM, no ignored event), so each entry takes its event's time, name and the tensor's address.
    names_by_tid = {}
    addr_by_tid = {}
    entries = []
    j = 0
    time = ev.time
    for k, (act, addr, size, stream, _t) in enumerate(traces):
        a = _ACTIONS[act] if 0 <= act < len(_ACTIONS) else "snapshot"
        if a == "alloc":
            t = ev.tid[j]
            names_by_tid[t] = ev.name[j]
            addr_by_tid[t] = addr
            frames = [_frame(ev.name[j])]
            when = time[j]
            j += 1
        elif a == "free_requested":
            frames = [_frame(names_by_tid.get(ev.tid[j], "tensor allocated before recording"))]
            when = time[j]
            j += 1
        elif a == "free_completed":
            frames = []
            when = time[j - 1] if j else 0
        else:
            frames = []
            when = time[j] if j < n else (time[-1] if n else 0)
        if k >= skip:
            entries.append({"action": a, "addr": addr, "size": size, "stream": stream,
                            "time_us": TIME_BASE_US + when, "frames": frames})
    live_names = {addr_by_tid[t]: names_by_tid[t] for t in addr_by_tid}
    return {
        "segments": [_segment_dict(s, live_names) for s in segments],
        "device_traces": [entries],
        "allocator_settings": session.allocator_settings(),  # what a snapshot under conf reports
        "external_annotations": [],
        "npualloc_workload": {"model": "transformer training loop", "size": size, **cfg.to_dict(),
                              "events": n, "recorded_events": n - start},
    }

