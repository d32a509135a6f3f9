"""Golden values for a system that cannot import us: a tiny GPT-2's float64 loss and per-parameter gradient
figures as plain JSON, and golden directories of 05's trainer at a layout (safetensors and JSON; the
section "Golden files across layouts" below):

    python3 -m megatron_scratch.golden --layout tp2pp2dp2 --config small --steps 3 --out DIR
    python3 -m megatron_scratch.golden check DIR --grads FILE [--losses FILE]

The JSON file (json.load reads it; no pickle, nothing executed on load) serves our own tests too
(tests/test_reference.py recomputes tests/golden/tiny_gpt2.json serially and at tp=2).

    python3 -m megatron_scratch.golden --config tiny --out tests/golden/tiny_gpt2.json [--overwrite]

regenerates it, deliberately: an existing file is refused without --overwrite, so a change in what
the model computes shows as a failing test first and a new file only by choice.

What the file holds: the config, the seed of the weights (megatron_scratch.reference.init_weights),
the tokens and targets themselves (two positions masked with ignore_index), the loss, and for every
parameter its gradient's norm and its dot product with a fixed probe, cos(0.7 j) over its elements j
in row-major order (a norm alone would not see a gradient permuted or of the wrong sign).

The tolerance, RTOL = 1e-12, and why: every figure is float64. Another machine (its BLAS, its SIMD
width, its thread count) or another layout (tp=2 splits the matmuls' sums over ranks) adds the same
terms in another order, ~1e-15 relative for a model this small; 1e-12 leaves three orders of
magnitude for that and is still six below what any real mistake does (a missing all-reduce, a wrong
shard or mask moves a loss or a gradient norm by 1e-4 or more). Each figure is compared on its own
scale: the loss and a norm relative to themselves, a probe's dot relative to its largest possible
size, |g| |probe| (Cauchy-Schwarz), so a gradient that is 0 in math (the key bias's: softmax is
shift-invariant; its figures are 1e-17 noise) passes with both sides' noise, as testing.assert_close's
floor does.
"""
import argparse
import json
import math
import os
import shlex
import sys

import torch

RTOL = 1e-12
CONFIGS = {"tiny": dict(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32)}
SEED, BATCH, SEQ, DATA_SEED, IGNORE_INDEX = 0, 2, 8, 1, -100


def probe(numel):
    """The fixed probe a gradient is dotted with: cos(0.7 j), j = 0 .. numel-1, float64."""
    return torch.cos(0.7 * torch.arange(numel, dtype=torch.float64))


def batch(cfg):
    """(tokens, targets), (BATCH, SEQ) each, from DATA_SEED; targets[0, :2] = IGNORE_INDEX (not counted)."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    tokens, targets = torch.randint(cfg.vocab_size, (2, BATCH, SEQ), generator=gen)
    targets[0, :2] = IGNORE_INDEX
    return tokens, targets


def figures(result):
    """{"loss": float, "grads": {name: {"norm": float, "probe": float}}} of a LossAndGrads."""
    grads = {}
    for name, g in result.grads.items():
        g = g.double().reshape(-1)
        grads[name] = {"norm": g.norm().item(), "probe": torch.dot(g, probe(g.numel())).item()}
    return {"loss": result.loss.item(), "grads": grads}


def compute(config="tiny", tp=1):
    """The golden file's contents, computed now: serially (tp=1) or by 01's tensor parallelism (tp > 1)."""
    from megatron_scratch import reference
    if config not in CONFIGS:
        raise ValueError(f"--config {config!r}: the golden configs are {', '.join(CONFIGS)}")
    cfg = reference.gpt_config(**CONFIGS[config], tp=tp)
    full = reference.init_weights(cfg, seed=SEED)
    tokens, targets = batch(cfg)
    if tp == 1:
        result = reference.serial_loss_and_grads(cfg, full, tokens, targets, ignore_index=IGNORE_INDEX)
    else:
        result = reference.tp_loss_and_grads(cfg, full, tokens, targets, tp=tp, ignore_index=IGNORE_INDEX)
    return {"about": "megatron_scratch's golden values: float64 loss and gradient figures of a tiny GPT-2 "
                     "(megatron_scratch/golden.py says what each is and how it is compared)",
            "command": f"python3 -m megatron_scratch.golden --config {config} --out FILE",
            "torch": torch.__version__, "dtype": "float64", "rtol": RTOL,
            "config": CONFIGS[config], "seed": SEED,
            "weights": "megatron_scratch.reference.init_weights(cfg, seed=seed): float64, random_all=True",
            "ignore_index": IGNORE_INDEX, "tokens": tokens.tolist(), "targets": targets.tolist(),
            **figures(result)}


def differences(got, want, rtol=RTOL):
    """Sentences, the worst first, for every figure of got (a golden dict) beyond rtol of want's on its
    own scale (the module docstring); [] when all agree. Keys missing on either side are differences."""
    out = []

    def check(what, g, w, scale):
        bad = abs(g - w) - rtol * scale
        if not (bad <= 0):  # NaN too
            out.append((bad if bad == bad else math.inf,
                        f"{what}: got {g!r}, golden {w!r} (|diff| {abs(g - w):.3g} > rtol {rtol:g} x {scale:.3g})"))

    check("loss", got["loss"], want["loss"], abs(want["loss"]))
    for name in sorted(set(got["grads"]) | set(want["grads"])):
        if name not in got["grads"] or name not in want["grads"]:
            out.append((math.inf, f"{name}: {'missing from the computed' if name in want['grads'] else 'not in the golden'} "
                                  f"gradients"))
            continue
        g, w = got["grads"][name], want["grads"][name]
        numel = math.prod(_shape(want, name))
        check(f"{name} gradient norm", g["norm"], w["norm"], w["norm"])
        check(f"{name} gradient probe", g["probe"], w["probe"], w["norm"] * probe(numel).norm().item())
    return [s for _, s in sorted(out, key=lambda x: -x[0])]


def _shape(golden, name):
    from megatron_scratch import tensor_parallel
    cfg = tensor_parallel.GPTConfig(**golden["config"])
    return dict(tensor_parallel.GPT(cfg, device="meta").named_parameters())[name].shape


def load(path):
    """The golden dict of a file: json.load, nothing else (no pickle, no code)."""
    with open(path) as f:
        return json.load(f)



# ----------------------------------------------------------------------------------------------
# Golden files across layouts: a directory of plain files (safetensors and JSON) for a system that
# cannot import us (JAX, Megatron, one's own framework), written by 05's trainer itself at a layout.
#
#     python3 -m megatron_scratch.golden --layout tp2pp2dp2 --config small --steps 3 --out DIR [--overwrite]
#     python3 -m megatron_scratch.golden check DIR --grads FILE [--losses FILE] [--rtol R] [--atol A]
#
# DIR holds (FILES): config.json (the model, the layout, the training recipe, the names' convention),
# weights.safetensors (the initial full weights, float64), batches.safetensors (every step's global
# batch: step{i}.tokens and step{i}.targets, int64 (B, T), IGNORE_INDEX marks a target not counted),
# losses.json (every step's loss and global gradient norm, float64, as Python's repr: exact), grads.safetensors
# (every parameter's gradient of step 0's loss, before the first update, float64, full shapes) and
# manifest.json (the exact command, the versions, each file's sha256). The run is 05's machine (build,
# train_step: 02's executor, 04's buckets, every speed flag on) on tp x pp x dp gloo CPU ranks, on
# weights loaded from weights.safetensors; its losses are checked against the serial model trained by
# torch's AdamW on the same batches before anything is written (LAYOUT_RTOL), so a directory that exists
# is one whose layout agreed with serial. Everything is float64 and every sum's order is fixed (gloo's
# reductions included), so a second run writes the same bytes (manifest.json's command aside, which
# names its own --out).
#
# The recipe (config.json says it too): the global batch BATCH_ROWS sequences of SEQ_ROWS tokens, m = BATCH_ROWS / dp
# microbatches of one sequence per replica, each counted target of the global batch weighing 1/(their
# count) ("token" normalization, docs/LOSS.md); AdamW at a constant LR, betas BETAS, weight decay WD on
# the 2-D weights only (biases and LayerNorms none), eps 1e-8, no clipping, no dropout.
#
# Names and layout of every tensor: our full state dict's (megatron_scratch.reference's docstring):
# GPT2LMHeadModel's parameter names, nn.Linear's (out, in) weights (HF's Conv1D holds (in, out):
# megatron_scratch.convert.from_hf / to_hf), c_attn's rows [q; k; v], lm_head tied to
# transformer.wte.weight and not a key; wte's gradient is the sum of both its uses.

CONFIGS["small"] = dict(vocab_size=97, block_size=16, n_layer=4, n_head=4, n_embd=32)
BATCH_ROWS, SEQ_ROWS, LR, BETAS, WD, MAX_STEPS, MAX_WORLD = 8, 16, 3e-3, (0.9, 0.95), 0.1, 20, 16
LAYOUT_RTOL = 1e-12  # the layout's losses against serial: float64 sums in another order, ~1e-15 (RTOL's reasoning)
FILES = ("config.json", "weights.safetensors", "batches.safetensors", "losses.json", "grads.safetensors",
         "manifest.json")
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def write_safetensors(path, tensors, metadata=None):
    """Write {name: tensor} in the safetensors format, written here (the package is not a dependency):
    an 8-byte little-endian header length N, N bytes of JSON ({name: {"dtype", "shape", "data_offsets":
    [begin, end] into the data}}, "__metadata__": {str: str}; padded with spaces to a multiple of 8),
    then every tensor's raw little-endian bytes, row-major, in sorted name order. The same tensors write
    the same bytes. CPU tensors of _ST_DTYPES' types only; a ValueError names any other."""
    import struct
    if sys.byteorder != "little":
        raise ValueError("write_safetensors: this machine is big-endian; safetensors' bytes are little-endian")
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.dtype not in _ST_DTYPES:
            raise ValueError(f"write_safetensors: {name}: a {getattr(t, 'dtype', type(t).__name__)} where a tensor of "
                             f"{', '.join(map(str, _ST_DTYPES))} is needed")
        blob = bytes(t.detach().cpu().contiguous().clone().untyped_storage())  # clone: exactly its own elements
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path):
    """({name: tensor}, metadata {str: str}) of a safetensors file (write_safetensors's format, or the
    safetensors package's): nothing but the header's JSON and raw bytes is read, nothing executed. A
    ValueError names a header or a tensor that does not fit the file."""
    import struct
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: {len(data)} bytes, not a safetensors file (8 bytes of header length first)")
    n = struct.unpack("<Q", data[:8])[0]
    if 8 + n > len(data):
        raise ValueError(f"{path}: a header of {n} bytes in a file of {len(data)}: not a safetensors file")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: the header is not JSON ({e})") from None
    metadata, body, out = header.pop("__metadata__", {}) or {}, memoryview(data)[8 + n:], {}
    dtypes = {v: k for k, v in _ST_DTYPES.items()}
    for name, info in header.items():
        dtype, shape, (begin, end) = dtypes.get(info.get("dtype")), info.get("shape"), info.get("data_offsets", (0, -1))
        if dtype is None or not 0 <= begin <= end <= len(body) or \
                (end - begin) != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{path}: {name}: dtype {info.get('dtype')!r}, shape {shape}, data_offsets "
                             f"{info.get('data_offsets')} do not fit the file's {len(body)} bytes of data")
        chunk = bytearray(body[begin:end])  # a copy: the tensor owns its memory
        out[name] = (torch.frombuffer(chunk, dtype=dtype) if chunk else torch.empty(0, dtype=dtype)).reshape(shape)
    return out, metadata


def parse_layout(layout):
    """(tp, pp, dp) of a --layout such as tp2pp2dp2 (each size at least 1, in that order); a ValueError
    naming the value and the form otherwise."""
    import re
    m = re.fullmatch(r"tp(\d+)pp(\d+)dp(\d+)", layout) if isinstance(layout, str) else None
    sizes = tuple(int(x) for x in m.groups()) if m else ()
    if not m or min(sizes) < 1:
        raise ValueError(f"--layout {layout!r}: the form is tp<T>pp<P>dp<D>, each a whole number of at least 1 "
                         f"(e.g. tp2pp2dp2, tp1pp1dp1 for serial)")
    return sizes


def check_layout_args(layout, config, steps):
    """(tp, pp, dp, cfg dict) once --layout, --config and --steps are possible together; a ValueError
    naming the flag, its value and the rule otherwise."""
    tp, pp, dp = parse_layout(layout)
    if config not in CONFIGS:
        raise ValueError(f"--config {config!r}: the golden configs are {', '.join(sorted(CONFIGS))}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"--steps {steps!r}: a whole number of steps from 1 to {MAX_STEPS}")
    c = CONFIGS[config]
    for ok, rule in ((c["n_head"] % tp == 0, f"tp={tp} must divide the config's n_head={c['n_head']}"),
                     (c["n_layer"] % pp == 0, f"pp={pp} must divide the config's n_layer={c['n_layer']}"),
                     (BATCH_ROWS % dp == 0, f"dp={dp} must divide the global batch of {BATCH_ROWS} sequences"),
                     (tp * pp * dp <= MAX_WORLD, f"tp x pp x dp = {tp * pp * dp} ranks, at most {MAX_WORLD} on this machine")):
        if not ok:
            raise ValueError(f"--layout {layout} --config {config}: {rule}")
    return tp, pp, dp, c


def layout_batches(cfg, steps):
    """Every step's global batch, [(tokens, targets)], (BATCH_ROWS, SEQ_ROWS) int64 each, from DATA_SEED: the
    same for every layout. Some targets are IGNORE_INDEX: the first three of row 0, and a step-dependent
    run of the last row, so the replicas and microbatches count unequal numbers."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    out = []
    for step in range(steps):
        tokens, targets = torch.randint(cfg.vocab_size, (2, BATCH_ROWS, SEQ_ROWS), generator=gen)
        targets[0, :3] = IGNORE_INDEX
        targets[-1, SEQ_ROWS - 2 - 3 * (step % 4):] = IGNORE_INDEX
        out.append((tokens, targets))
    return out


def serial_training(cfg, full, batches):
    """The serial model (01's GPT at tp=1) trained on batches by torch's AdamW with the recipe: (every
    step's loss, {name: gradient} of step 0). What the layouts' losses are checked against."""
    from megatron_scratch import reference
    model = reference._serial(cfg, full)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, weight_decay=WD)
    losses, grads = [], None
    for idx, targets in batches:
        opt.zero_grad()
        loss = model(idx, targets, ignore_index=IGNORE_INDEX)[1]
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return losses, grads


def compute_layout(layout, config, steps):
    """What a golden directory holds, computed now: {"config", "weights", "batches", "losses", "norms",
    "grads", "serial_losses"}: 05's machine at the layout on tp x pp x dp gloo ranks (the serial
    layout tp1pp1dp1 too: one rank of it). A ValueError if its losses are not within LAYOUT_RTOL of the
    serial model's (a bug: nothing is written then)."""
    from megatron_scratch import reference
    tp, pp, dp, c = check_layout_args(layout, config, steps)
    cfg = reference.gpt_config(**c, tp=tp)
    full = reference.init_weights(cfg, seed=SEED)
    batches = layout_batches(cfg, steps)
    run = reference.gpt3d_training(cfg, full, batches, tp=tp, pp=pp, dp=dp, microbatches=BATCH_ROWS // dp, lr=LR,
                                   weight_decay=WD)
    losses, norms, grads = run.losses, run.grad_norms, run.grads
    serial_losses, _ = serial_training(cfg, full, batches)
    bad = [(i, a, b) for i, (a, b) in enumerate(zip(losses, serial_losses)) if not abs(a - b) <= LAYOUT_RTOL * abs(b)]
    if bad or set(grads) != set(full):
        raise ValueError(f"golden --layout {layout}: 05's machine disagrees with serial (a bug, nothing written): "
                         f"steps (i, layout, serial) {bad[:3]}, gradients missing {sorted(set(full) - set(grads))[:3]}")
    return dict(config=dict(model=c, layout=layout, tp=tp, pp=pp, dp=dp, steps=steps), weights=full,
                batches=batches, losses=losses, norms=norms, grads={n: grads[n] for n in full},
                serial_losses=serial_losses)


def _recipe(data):
    return dict(data["config"], config_name=None, batch_size=BATCH_ROWS, seq_len=SEQ_ROWS,
                microbatches_per_replica=BATCH_ROWS // data["config"]["dp"], micro_batch_size=1,
                loss="mean cross-entropy over the counted targets of the global batch (token normalization)",
                ignore_index=IGNORE_INDEX, optimizer="AdamW", lr=LR, betas=list(BETAS), eps=1e-8, weight_decay=WD,
                weight_decay_on="2-D weights only (not biases, not LayerNorms)", grad_clip=None, dropout=0.0,
                seed=SEED, data_seed=DATA_SEED, dtype="float64",
                names="our full state dict: GPT2LMHeadModel's names, nn.Linear (out, in) weights, c_attn rows "
                      "[q; k; v], lm_head tied to transformer.wte.weight (not a key)")


def write_layout(out, layout, config, steps, overwrite=False, command=None):
    """Compute (compute_layout) and write a golden directory at out (FILES); an existing out is refused
    unless overwrite (and a file at out always). command: the manifest's (default: this process's argv).
    Returns compute_layout's dict."""
    import hashlib
    import platform
    check_layout_args(layout, config, steps)  # before anything is computed
    check_out(out, overwrite)
    data = compute_layout(layout, config, steps)
    os.makedirs(out, exist_ok=True)
    recipe = dict(_recipe(data), config_name=config)

    def dump(name, obj):
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")

    dump("config.json", recipe)
    write_safetensors(os.path.join(out, "weights.safetensors"), data["weights"], {"what": "initial full weights"})
    write_safetensors(os.path.join(out, "batches.safetensors"),
                      {f"step{i}.{k}": t for i, b in enumerate(data["batches"]) for k, t in zip(("tokens", "targets"), b)},
                      {"what": "every step's global batch", "ignore_index": IGNORE_INDEX})
    dump("losses.json", {"losses": data["losses"], "grad_norms": data["norms"], "serial_losses": data["serial_losses"],
                         "about": "losses: 05's machine at the layout, step by step; serial_losses: the serial model's "
                                  f"(within {LAYOUT_RTOL:g} relative of losses, checked before writing); grad_norms: "
                                  "the global gradient norm of each step"})
    write_safetensors(os.path.join(out, "grads.safetensors"), data["grads"],
                      {"what": "every gradient of step 0's loss, before the first update"})
    from importlib import metadata
    try:
        version = metadata.version("megatron_scratch")
    except metadata.PackageNotFoundError:
        version = "not installed (a checkout)"
    sums = {}
    for name in FILES[:-1]:
        with open(os.path.join(out, name), "rb") as f:
            sums[name] = hashlib.sha256(f.read()).hexdigest()
    dump("manifest.json", {"command": command or shlex.join(["python3", "-m", "megatron_scratch.golden", *sys.argv[1:]]),
                           "versions": {"megatron_scratch": version, "torch": torch.__version__,
                                        "python": platform.python_version(), "platform": platform.platform()},
                           "sha256": sums, "files": list(FILES),
                           "about": "megatron_scratch/golden.py's module comment says what each file holds"})
    return data


def check_out(out, overwrite):
    """A ValueError naming --out when it cannot be written: an existing path without overwrite, a file."""
    if os.path.isfile(out) or (os.path.exists(out) and not os.path.isdir(out)):
        raise ValueError(f"--out {out}: a file, not a directory: the golden files are a directory")
    if os.path.exists(out) and not overwrite:
        raise ValueError(f"--out {out} exists: regenerating golden values is deliberate, add --overwrite")
    up = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):  # before anything is computed, as the rest
        raise ValueError(f"--out {out}: cannot be written ({up} is a file, not a directory)")


def read_dir(path):
    """A golden directory as {"config", "weights", "batches" [(tokens, targets)], "losses", "grads",
    "manifest"}; a ValueError names a missing file."""
    missing = [n for n in FILES if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise ValueError(f"{path}: not a golden directory: {', '.join(missing)} missing")
    def load_json(name):
        with open(os.path.join(path, name)) as f:
            return json.load(f)

    batches = read_safetensors(os.path.join(path, "batches.safetensors"))[0]
    return dict(config=load_json("config.json"), weights=read_safetensors(os.path.join(path, "weights.safetensors"))[0],
                batches=[(batches[f"step{i}.tokens"], batches[f"step{i}.targets"]) for i in range(len(batches) // 2)],
                losses=load_json("losses.json")["losses"], grads=read_safetensors(os.path.join(path, "grads.safetensors"))[0],
                manifest=load_json("manifest.json"))


def check(path, grads=None, losses=None, rtol=1e-10, atol=1e-12):
    """Check one's own output against the golden directory at path: grads ({name: tensor}, or a
    safetensors file of them: step 0's gradients, our names and shapes), losses (a list of floats, or a
    JSON file holding one, or {"losses": [...]}: the first len(losses) steps'). Returns a list of
    sentences, [] when everything agrees: testing.compare_state's report for the gradients (each element
    within atol + rtol |golden|; missing and extra names listed), one sentence per loss beyond rtol.
    The defaults are float64's (two float64 implementations differ by ~1e-15 relative); a float32 or
    bf16 system passes its own (testing.tolerances, or megatron_grad_tolerance)."""
    from megatron_scratch.testing import compare_state
    want, problems = read_dir(path), []
    if grads is None and losses is None:
        raise ValueError("check: give grads or losses (or both) to check")
    if isinstance(grads, (str, os.PathLike)):
        grads = read_safetensors(grads)[0]
    if grads is not None:
        report = compare_state({k: v.double() for k, v in grads.items()}, want["grads"], rtol=rtol, atol=atol, check=False)
        if not report.ok:
            problems.append(str(report))
    if isinstance(losses, (str, os.PathLike)):
        with open(losses) as f:
            losses = json.load(f)
    if isinstance(losses, dict):
        losses = losses["losses"]
    if losses is not None:
        if len(losses) > len(want["losses"]):
            problems.append(f"losses: {len(losses)} given, the golden directory has {len(want['losses'])} steps")
        for i, (g, w) in enumerate(zip(losses, want["losses"])):
            if not abs(g - w) <= atol + rtol * abs(w):
                problems.append(f"step {i} loss: got {g!r}, golden {w!r} (|diff| {abs(g - w):.3g} > {atol:g} + {rtol:g} x |golden|)")
    return problems


def check_main(argv):
    ap = argparse.ArgumentParser(prog="python3 -m megatron_scratch.golden check",
                                 description="Check one's gradients (and losses) against a golden directory; "
                                             "exit 0 when they agree, 1 with the report otherwise.")
    ap.add_argument("dir", help="the golden directory (python3 -m megatron_scratch.golden --layout ... --out DIR)")
    ap.add_argument("--grads", help="a safetensors file of step 0's gradients, our names and full shapes")
    ap.add_argument("--losses", help="a JSON file: a list of every step's loss (or {\"losses\": [...]})")
    ap.add_argument("--rtol", type=float, default=1e-10, help="relative tolerance (default 1e-10: float64's)")
    ap.add_argument("--atol", type=float, default=1e-12, help="absolute floor (default 1e-12: float64's)")
    args = ap.parse_args(argv)
    if args.grads is None and args.losses is None:
        ap.error("give --grads FILE or --losses FILE (or both)")
    for flag, p in (("--grads", args.grads), ("--losses", args.losses)):
        if p is not None and not os.path.isfile(p):
            ap.error(f"{flag} {p}: no such file")
    try:
        problems = check(args.dir, args.grads, args.losses, args.rtol, args.atol)
    except ValueError as e:
        ap.error(str(e))
    if problems:
        print("FAIL\n" + "\n".join(problems))
        return 1
    print(f"PASS: {args.dir} agrees with {' and '.join(p for p in (args.grads, args.losses) if p)} "
          f"(rtol {args.rtol:g}, atol {args.atol:g})")
    return 0


def main(argv=None):
    """python3 -m megatron_scratch.golden: the tiny JSON file (no --layout), a golden directory
    (--layout), or `check DIR ...` (check_main)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check"]:
        return check_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python3 -m megatron_scratch.golden", description=__doc__.split("\n\n")[0],
                                 epilog="python3 -m megatron_scratch.golden check DIR --grads FILE: check one's own "
                                        "gradients against a golden directory (check --help)")
    ap.add_argument("--config", default="tiny", help=f"the model: {', '.join(sorted(CONFIGS))}")
    ap.add_argument("--out", required=True, help="the JSON file to write (tests/golden/tiny_gpt2.json), or with "
                                                 "--layout the directory")
    ap.add_argument("--layout", help="write a golden directory of 05's trainer at this layout: tp<T>pp<P>dp<D>, "
                                     "e.g. tp2pp2dp2 (megatron_scratch/golden.py's comment says what it holds)")
    ap.add_argument("--steps", type=int, help=f"with --layout: training steps, 1 to {MAX_STEPS} (default 3)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing file (a deliberate regeneration)")
    args = ap.parse_args(argv)
    if args.layout is not None:
        steps = 3 if args.steps is None else args.steps
        try:
            write_layout(args.out, args.layout, args.config, steps, args.overwrite,
                         command=shlex.join(["python3", "-m", "megatron_scratch.golden", *argv]))
        except ValueError as e:
            ap.error(str(e))
        except OSError as e:  # a parent that is a file, no permission: said, not a traceback
            ap.error(f"--out {args.out}: cannot be written ({e.strerror or e})")
        print(f"wrote {args.out}: {', '.join(FILES)} (05's trainer at {args.layout}, {steps} steps, its losses "
              f"equal to serial's within {LAYOUT_RTOL:g})")
        return 0
    if args.steps is not None:
        ap.error("--steps: only with --layout (the JSON file is one forward and backward)")
    if args.config not in CONFIGS:
        ap.error(f"--config {args.config!r}: the golden configs are {', '.join(sorted(CONFIGS))}")
    if os.path.exists(args.out) and not args.overwrite:
        ap.error(f"--out {args.out} exists: regenerating golden values is deliberate, add --overwrite")
    data = compute(args.config)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: loss {data['loss']!r}, {len(data['grads'])} gradients")


if __name__ == "__main__":
    sys.exit(main())
