"""Every input checked in one place, before any process is forked or any collective runs.

    check_fields(*configs)        each field of a config dataclass (01-05's demo and trainer configs,
                                  GPTConfig, SampleConfig): its type and its range (FIELDS below)
    check_config(cfg, tc, world)  the relations between fields: the layout (tp x dp x pp = world,
                                  layers per stage, microbatches per interleaving group, 06's
                                  zero-bubble schedules, 07's vocabulary passes), the batch,
                                  the model's shapes, the learning rates, the flags that need others
    check_device(tc, device)      what needs a GPU (CUDA graphs, forced CUDA kernels)
    check_paths(tc)               --save, --metrics, --trace: writable, of the right kind
    check_memory(cfg, tc, device) the run's own estimate of its weights, gradients and optimizer
                                  state against the memory of this machine or GPU
    preflight(cfg, tc, world, device)   all of the above for 05, then the data, the checkpoint to
                                  resume from and the save directory; returns what they resolve to
    acceleration(tc, device)      fused kernels on? CUDA graphs per stage, of the whole step, or off?

Each error is a ValueError that names the flag (or the file), the value and the constraint.
05 runs preflight in the launching process, so that bad input fails before any fork, and again on
every rank before the first collective (under torchrun there is no launching process of ours);
01-04 check their demo's flags before launching.
"""
import dataclasses
import math
import os
import typing

MAX_TIMEOUT_S = 3600  # a collective stuck this long is a hang; beyond it the guard is no guard


def _at_least(n):
    return lambda v: v >= n, f"at least {n}"


_POSITIVE = (lambda v: v > 0, "positive")
_FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")
_SEED = (lambda v: 0 <= v < 2**31, "in [0, 2**31)")
_ANY = (lambda v: True, "")  # text: paths are checked by check_paths and where they are read

# Every field of every config, by name (a name means the same thing in every file): the constraint
# on its value, beyond its type. tests/test_bad_input.py checks that no field is missing here.
FIELDS = {
    # the model (01's GPTConfig)
    "vocab_size": _at_least(1), "block_size": _at_least(1), "n_layer": _at_least(1),
    "n_head": _at_least(1), "n_embd": _at_least(1), "dropout": _FRACTION,
    # the layout and the batch (every file)
    "tp": _at_least(1), "pp": _at_least(1), "dp": _at_least(1), "virtual_stages": _at_least(1),
    "batch_size": _at_least(1), "microbatches": _at_least(1), "seq_len": _at_least(1),
    "sequence_parallel": _ANY, "schedule": _ANY, "seed": _SEED, "trace": _ANY, "vocab_barriers": _ANY,
    "large_vocab": _at_least(1),
    # training (04's demo and 05)
    "steps": _at_least(1), "lr": _POSITIVE, "min_lr": _at_least(0), "warmup_steps": _at_least(0),
    "weight_decay": _at_least(0), "grad_clip": _POSITIVE, "bucket_numel": _at_least(1),
    "zero1": _ANY, "scatter_gather": _ANY, "recompute": _ANY, "dtype": _ANY,
    "overlap_grad_reduce": _ANY, "overlap_param_gather": _ANY, "overlap_input_grad": _ANY,
    "merge_loss_reductions": _ANY, "background_sends": _ANY,
    "eval_every": _at_least(0), "eval_batches": _at_least(1), "data": _ANY, "metrics": _ANY,
    "timeout_s": (lambda v: 0 < v <= MAX_TIMEOUT_S, f"positive and at most {MAX_TIMEOUT_S} (seconds)"),
    "max_skipped_steps": _at_least(1),
    "hang_s": (lambda v: 0 <= v <= MAX_TIMEOUT_S, f"0 (off) or positive, at most {MAX_TIMEOUT_S} (seconds)"),
    "straggler_every": _at_least(0), "rehearse_fault": _ANY, "watch": _ANY,
    "save": _ANY, "save_every": _at_least(0), "keep": _at_least(1),
    "save_timeout_s": (lambda v: 0 < v <= 24 * 3600, "positive and at most 86400 (seconds)"), "async_save": _ANY,
    "snapshot_every": _at_least(0), "snapshot_dir": _ANY, "restarts": _at_least(0), "resume": _ANY, "init_from": _ANY,
    "fused_kernels": _ANY, "kernel_path": _ANY, "flash_attention": _ANY, "cuda_graphs": _ANY,
    "graph_scope": _ANY,
    # sampling (plumbing/sample.py)
    "sample": _ANY, "max_new_tokens": _at_least(1),
    "temperature": (lambda v: v > 0, "positive (for greedy decoding use --top-k 1)"), "top_k": _at_least(0),
}


ZERO_BUBBLE = ("zb-h1", "zb-v")  # 06's --schedule values


def flag(name):
    return "--" + name.replace("_", "-")


def _type_problem(value, kind):
    """Why value is not of the annotated kind, or None."""
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        if not isinstance(value, list):
            return "a list"
        return next((f"a list of {_type_problem(v, item)}" for v in value if _type_problem(v, item)), None)
    options = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, type(int | None)) else (kind,)
    if typing.get_origin(kind) is typing.Literal:
        return None if value in typing.get_args(kind) else f"one of {', '.join(map(repr, typing.get_args(kind)))}"
    for k in options:
        if k is type(None) and value is None or k is bool and isinstance(value, bool) \
                or k is str and isinstance(value, str) \
                or k is int and isinstance(value, int) and not isinstance(value, bool) \
                or k is float and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            return None
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "text",
             type(None): "unset"}
    return " or ".join(names.get(k, str(k)) for k in options)


def check_fields(*configs):
    """Each field's type and range, for config dataclasses (or any object with their fields)."""
    for config in configs:
        hints = typing.get_type_hints(type(config))
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            wrong = _type_problem(value, hints[f.name])
            if wrong:
                raise ValueError(f"{flag(f.name)} must be {wrong}, got {value!r}")
            ok, constraint = FIELDS[f.name]
            if value is not None and not isinstance(value, (str, bool, list)) and not ok(value):
                raise ValueError(f"{flag(f.name)} must be {constraint}, got {value!r}")


def check_config(cfg, tc, world=None):
    """Every field, then the relations between them. cfg is a GPTConfig; tc any of the files'
    configs (a size it lacks counts as 1): 05's TrainConfig, or a demo's flags."""
    check_fields(cfg, tc)
    tp, pp, dp, v, m = (getattr(tc, k, 1) for k in ("tp", "pp", "dp", "virtual_stages", "microbatches"))
    if world is not None and tp * dp * pp != world:
        raise ValueError(f"the world size {world} does not match tp={tp} x dp={dp} x pp={pp}")
    stages = pp * v
    if cfg.n_layer % stages:  # also when there are more stages than layers
        raise ValueError(f"--n-layer: n_layer={cfg.n_layer} is not divisible by {stages} pipeline stages "
                         f"(pp x v = {pp} x {v}); uneven splits are not supported")
    schedule = getattr(tc, "schedule", "")
    if schedule in ZERO_BUBBLE and v > 1:
        raise ValueError(f"--virtual-stages {v}: --schedule {schedule} places its own chunks (ZB-H1 one per rank, "
                         f"ZB-V two in a V); leave --virtual-stages at 1")
    if schedule == "zb-v" and cfg.n_layer % (2 * pp):
        raise ValueError(f"--schedule zb-v runs two chunks per rank in a V: --n-layer {cfg.n_layer} is not divisible "
                         f"by its 2 x pp = {2 * pp} stages; uneven splits are not supported")
    barriers = getattr(tc, "vocab_barriers", None)  # 07's vocabulary parallelism
    if barriers and v > 1:
        raise ValueError(f"--virtual-stages {v}: --vocab-barriers puts its passes into 1F1B or 06's schedules "
                         f"(--schedule), not into interleaved 1F1B; leave --virtual-stages at 1")
    if barriers and getattr(tc, "cuda_graphs", None):
        raise ValueError(f"--cuda-graphs: --vocab-barriers {barriers} runs the vocabulary passes' collectives on a "
                         f"thread of their own, which a captured graph cannot; drop the flag")
    for name in ("fused_kernels", "cuda_graphs"):
        if schedule in ZERO_BUBBLE and getattr(tc, name, None):
            raise ValueError(f"{flag(name)}: --schedule {schedule} splits each linear layer's backward in two (I "
                             f"and W), which the fused layer and the captured graphs do not; drop the flag")
    if tc.batch_size % (dp * m):
        raise ValueError(f"--batch-size: the global batch of {tc.batch_size} sequences is not divisible by "
                         f"dp x m = {dp} x {m}")
    if v > 1 and m % pp:
        raise ValueError(f"--microbatches: interleaving sends microbatches through the chunks in groups of "
                         f"pp: m={m} must be divisible by pp={pp}")
    if cfg.n_embd % cfg.n_head or cfg.n_head % tp:
        raise ValueError(f"--n-head: need n_embd={cfg.n_embd} divisible by n_head={cfg.n_head}, and n_head "
                         f"divisible by tp={tp}")
    if tc.seq_len > cfg.block_size:
        raise ValueError(f"--seq-len {tc.seq_len} exceeds --block-size {cfg.block_size}")
    if getattr(tc, "sequence_parallel", False) and tc.seq_len % tp:
        raise ValueError(f"--sequence-parallel needs --seq-len {tc.seq_len} divisible by tp={tp}")
    if hasattr(tc, "min_lr") and tc.min_lr > tc.lr:
        raise ValueError(f"--min-lr {tc.min_lr:g} is above --lr {tc.lr:g}: the schedule decays from lr to min_lr")
    if getattr(tc, "hang_s", None) and tc.hang_s >= tc.timeout_s:
        raise ValueError(f"--hang-s {tc.hang_s:g} must be below --timeout-s {tc.timeout_s:g}: the hang report "
                         f"comes before the collective timeout ends the run (or --hang-s 0 turns it off)")
    if getattr(tc, "rehearse_fault", None):
        from plumbing.watch import parse_faults
        parse_faults(tc.rehearse_fault, tp * dp * pp)
    if getattr(tc, "snapshot_every", 0) and not tc.snapshot_dir:
        raise ValueError(f"--snapshot-every {tc.snapshot_every} needs --snapshot-dir DIR (node-local, e.g. "
                         f"/dev/shm/snapshots)")
    if getattr(tc, "save_every", 0) and not tc.save:
        raise ValueError(f"--save-every {tc.save_every} needs --save DIR")
    if getattr(tc, "graph_scope", "auto") == "step" and tp * pp * dp > 1:
        raise ValueError(f"--graph-scope step captures one rank's whole step: it needs tp = pp = dp = 1, "
                         f"got tp={tp}, pp={pp}, dp={dp}")
    if getattr(tc, "graph_scope", "auto") == "step" and v > 1:
        raise ValueError(f"--graph-scope step captures one model chunk: it needs --virtual-stages 1, got {v}")
    if getattr(tc, "cuda_graphs", None) and (tp > 1 or tc.recompute != "none"):
        raise ValueError(f"--cuda-graphs captures whole stages, which here needs tp=1 (a stage with tp > 1 "
                         f"holds all-reduces) and --recompute none; got tp={tp}, recompute={tc.recompute}")


def check_device(tc, device):
    """What the device decides: CUDA graphs and forced kernels need a GPU (checked on every rank
    before the first collective)."""
    if tc.cuda_graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a GPU: CUDA graphs record GPU kernel launches, and this "
                         f"run is on {device.type}. Drop the flag, or run under torchrun on GPUs.")
    if tc.fused_kernels is not False and tc.kernel_path == "cuda" and device.type != "cuda":
        raise ValueError(f"--kernel-path cuda forces the CUDA kernels, and this run is on {device.type}; "
                         f"use --kernel-path reference (same math, PyTorch) or auto")


def check_paths(tc, writer=True):
    """--save must be a directory this process can write in (made if missing); --metrics and
    --trace files whose directory exists and that are not directories. Probed by writing, since a
    permission bit does not tell (root, read-only mounts, full quotas); the files only by the
    process that will write them (writer), so that ranks sharing a path never race on it."""
    if getattr(tc, "save", ""):
        if os.path.exists(tc.save) and not os.path.isdir(tc.save):
            raise ValueError(f"--save {tc.save}: it is a file, not a directory for checkpoints")
        probe = os.path.join(tc.save, f".write_test_{os.getpid()}_{os.uname().nodename}")
        try:
            os.makedirs(tc.save, exist_ok=True)
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"--save {tc.save}: cannot write checkpoints there ({e.strerror or e})") from None
    for name in ("metrics", "trace"):
        path = getattr(tc, name, "")
        if not path:
            continue
        if os.path.isdir(path):
            raise ValueError(f"{flag(name)} {path}: it is a directory; give a file name")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"{flag(name)} {path}: the directory {folder} does not exist")
        if not writer:
            continue
        existed = os.path.exists(path)
        try:
            with open(path, "a"):
                pass
            if not existed:
                os.remove(path)
        except OSError as e:
            raise ValueError(f"{flag(name)} {path}: cannot write it ({e.strerror or e})") from None


def machine_bytes(device):
    """The memory a run can use: the GPU's, or this machine's RAM (None if unknown)."""
    if device.type == "cuda":
        import torch
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(cfg, tc, device, ranks_here):
    """Refuse a run whose weights, gradients and AdamW state alone (activations not counted) would
    not fit: on a GPU, the fullest rank's share (planner.params_per_gpu: the first stage) against the
    device; on CPU, ranks_here ranks of that share against this machine's RAM."""
    import planner
    spec = planner.ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size)
    params, zero1 = planner.params_exact(spec), getattr(tc, "zero1", False)
    fullest = planner.params_per_gpu(spec, planner.Layout(tc.tp, tc.pp, tc.dp, tc.batch_size))  # the first stage
    elt = {"float64": 8, "bfloat16": 2}.get(tc.dtype, 2 if tc.dtype == "auto" and device.type == "cuda" else 4)
    grad = max(elt, 4)  # low-precision weights keep fp32 gradients, masters and moments
    state = 2 * grad + (4 if elt < 4 else 0)  # AdamW's two moments (and fp32 masters): 1/dp of them with ZeRO-1
    per_rank = fullest * (elt + grad + state / (tc.dp if zero1 else 1))
    total = per_rank if device.type == "cuda" else per_rank * ranks_here
    have = machine_bytes(device)
    if have and total > have:
        where = f"the GPU's {have / 2**30:.1f} GiB" if device.type == "cuda" else \
            f"this machine's {have / 2**30:.1f} GiB of memory ({ranks_here} ranks)"
        raise ValueError(f"--n-layer {cfg.n_layer} --n-embd {cfg.n_embd} --vocab-size {cfg.vocab_size}: "
                         f"{params:,} parameters need about {total / 2**30:.1f} GiB of weights, gradients "
                         f"and optimizer state, more than {where}; use more tp x pp or a smaller model")


def preflight(cfg, tc, world, device, say=None, ranks_here=None, writer=True):
    """Everything 05 can refuse before a process group exists, in the order a user would fix it.
    writer: this process writes --metrics and --trace (rank 0, or the launching process).
    Returns (train tokens, eval tokens, the checkpoint to resume or None, the steps it holds)."""
    # Imported here: 01-04 import this module for check_config, and these import 01.
    from plumbing.checkpoint import check_save_dir, check_shards, latest_checkpoint, read_manifest
    from plumbing.data import load_tokens, split_tokens
    check_config(cfg, tc, world)
    check_device(tc, device)
    check_paths(tc, writer)
    check_memory(cfg, tc, device, world if ranks_here is None else ranks_here)
    train_tokens, eval_tokens = split_tokens(load_tokens(tc.data, cfg.vocab_size, tc.seq_len), tc.seq_len)
    path = latest_checkpoint(tc.resume, say) if tc.resume else None
    manifest = read_manifest(path, cfg, tc, say) if path else dict(step=0)
    if path:
        check_shards(path, manifest)
    start = manifest["step"]
    for root in (tc.save, getattr(tc, "snapshot_dir", "")):
        if root:  # a restart picks the newest step there: none of another run's may be later
            check_save_dir(root, start, resuming_from=path)
    return train_tokens, eval_tokens, path, start


def acceleration(tc, device):
    """(fused kernels on?, CUDA graphs: None, "stage" or "step"), unset flags resolved: both on on
    a GPU, graphs where the layout allows them; the whole step is one graph at tp = pp = dp = 1 and
    v = 1 (its graph holds one chunk: with v > 1 each chunk is captured on its own)."""
    gpu = device.type == "cuda" and getattr(tc, "schedule", "") not in ZERO_BUBBLE  # 06 runs 01's layers
    fused = gpu if tc.fused_kernels is None else tc.fused_kernels
    graphs = (gpu and tc.tp == 1 and tc.recompute == "none" and not getattr(tc, "vocab_barriers", None)) \
        if tc.cuda_graphs is None else tc.cuda_graphs  # 07's collectives run on a thread: no graphs
    if not graphs:
        return fused, None
    if tc.graph_scope != "auto":
        return fused, tc.graph_scope
    return fused, "step" if tc.tp == tc.pp == tc.dp == tc.virtual_stages == 1 else "stage"
