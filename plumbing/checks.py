"""Every input checked in one place, before any process is forked or any collective runs.

    check_fields(*configs)        each field of a config dataclass (01-05's demo and trainer configs,
                                  GPTConfig, SampleConfig): its type and its range (FIELDS below)
    check_config(cfg, tc, world)  the relations between fields: the layout (tp x dp x pp = world,
                                  layers per stage, microbatches per interleaving group, 06's
                                  zero-bubble schedules, 07's vocabulary passes), the batch,
                                  the model's shapes, the learning rates, the flags that need others
    check_device(tc, device)      what needs a GPU (CUDA graphs, forced CUDA kernels)
    check_paths(tc)               --save, --metrics, --trace: writable, of the right kind
    check_outputs(tc, resumed)    every file the run writes against every file it reads, each
                                  other and the checkpoints (plumbing/paths.py), before any is written
    check_action(args, given)     the one action a command asks for, and no flag it would ignore
    check_model_flags(...)        model flags given beside weights that carry their own model
    check_memory(cfg, tc, device) the run's own estimate of its weights, gradients and optimizer
                                  state against the memory of this machine or GPU
    preflight(cfg, tc, world, device)   all of the above for 05, then the data, the checkpoint to
                                  resume from and the save directory; returns what they resolve to
    acceleration(tc, device)      fused kernels on? CUDA graphs per stage, of the whole step, or off?
    check_context, check_experts  08's and 09's flags' relations (their configs' check_relations)

Each error is a ValueError that names the flag (or the file), the value and the constraint. A value
passes only if the run can use it: a learning rate that would make every weight infinite, a timeout
no collective can meet, a batch whose activations cannot fit, are refused here and not found later.
05 runs preflight in the launching process, so that bad input fails before any fork, and again on
every rank before the first collective (under torchrun there is no launching process of ours);
01-04 check their demo's flags before launching.
"""
import dataclasses
import math
import os
import stat
import typing

from plumbing import paths

MAX_TIMEOUT_S = 3600  # a collective stuck this long is a hang; beyond it the guard is no guard
MAX_NEW_TOKENS = 1_000_000  # --max-new-tokens: more is a run that never ends, not a sample


def _at_least(n):
    return lambda v: v >= n, f"at least {n}"


_POSITIVE = (lambda v: v > 0, "positive")
_FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")
_SEED = (lambda v: 0 <= v < 2**31, "in [0, 2**31)")
_ANY = (lambda v: True, "")  # text: paths are checked by check_paths and where they are read
_A_SECOND = (lambda v: v >= 1, "at least 1 (seconds; no collective completes sooner, so every run would time out)")

# Every field of every config, by name (a name means the same thing in every file): the constraint
# on its value, beyond its type, or a list of them checked in order (the first one broken is said).
# tests/test_bad_input.py checks that no field is missing here.
FIELDS = {
    # the model (01's GPTConfig)
    "vocab_size": _at_least(1), "block_size": _at_least(1), "n_layer": _at_least(1),
    "n_head": _at_least(1), "n_embd": _at_least(1), "dropout": _FRACTION,
    # the layout and the batch (every file)
    "tp": _at_least(1), "pp": _at_least(1), "dp": _at_least(1), "virtual_stages": _at_least(1),
    "batch_size": _at_least(1), "microbatches": _at_least(1), "seq_len": _at_least(1),
    "sequence_parallel": _ANY, "schedule": _ANY, "seed": _SEED, "trace": _ANY, "vocab_barriers": _ANY,
    "large_vocab": _at_least(1), "cp": _at_least(1), "cp_schedule": _ANY, "cp_attention": _ANY,
    # training (04's demo and 05)
    "steps": _at_least(1), "min_lr": _at_least(0), "warmup_steps": _at_least(0),
    # AdamW moves each weight by about lr per step: beyond 1 a weight of GPT-2's scale (0.02) is lost
    # at once, and lr 1e308 makes every weight infinite. (weight decay: check_config, with lr)
    "lr": [_POSITIVE, (lambda v: v <= 1, "at most 1 (AdamW moves each weight by about lr per step)")],
    "weight_decay": _at_least(0), "grad_clip": _POSITIVE, "bucket_numel": _at_least(1),
    "zero1": _ANY, "scatter_gather": _ANY, "recompute": _ANY, "dtype": _ANY, "loss_normalization": _ANY,
    "overlap_grad_reduce": _ANY, "overlap_param_gather": _ANY, "overlap_input_grad": _ANY,
    "background_sends": _ANY,
    "eval_every": _at_least(0), "eval_batches": _at_least(1), "data": _ANY, "loss_mask": _ANY, "metrics": _ANY,
    # Below a second not even the groups' own set-up completes: every run would fail at its first collective.
    "timeout_s": [(lambda v: 0 < v <= MAX_TIMEOUT_S, f"positive and at most {MAX_TIMEOUT_S} (seconds)"), _A_SECOND],
    "max_skipped_steps": _at_least(1),
    # Below a second a healthy run's ordinary waits (a stage's receive while its neighbour computes) look hung.
    "hang_s": (lambda v: v == 0 or 1 <= v <= MAX_TIMEOUT_S, f"0 (off), or at least 1 and at most {MAX_TIMEOUT_S} "
                                                            f"(seconds)"),
    "straggler_every": _at_least(0), "rehearse_fault": _ANY, "watch": _ANY, "check": _ANY,
    "save": _ANY, "save_every": _at_least(0), "keep": _at_least(1),
    "save_timeout_s": [(lambda v: 0 < v <= 24 * 3600, "positive and at most 86400 (seconds)"), _A_SECOND],
    "async_save": _ANY, "snapshot_every": _at_least(0), "snapshot_dir": _ANY, "restarts": _at_least(0),
    "resume": _ANY, "init_from": _ANY, "overwrite": _ANY, "data_changed_ok": _ANY,
    "fused_kernels": _ANY, "kernel_path": _ANY, "flash_attention": _ANY, "cuda_graphs": _ANY,
    "graph_scope": _ANY,
    # 09's experts (the model's and the layout's); top_k is sampling's, below, and the router's
    "num_experts": _at_least(1), "moe_every": _at_least(1), "capacity_factor": _POSITIVE,
    "aux_loss_coeff": _at_least(0), "aux_loss_counts_all": _ANY, "ep": _at_least(1), "etp": _at_least(1),
    # sampling (plumbing/sample.py)
    # Tokens are printed as they come; a million is hours of a CPU's sampling, 10**9 would never end.
    "sample": _ANY, "max_new_tokens": [_at_least(1), (lambda v: v <= MAX_NEW_TOKENS, f"at most {MAX_NEW_TOKENS:,}")],
    "temperature": (lambda v: v > 0, "positive (for greedy decoding use --top-k 1)"), "top_k": _at_least(0),
}


ZERO_BUBBLE = ("zb-h1", "zb-v", "v-half", "v-min", "dualpipev")  # 06's --schedule values
V_SHAPED = ("zb-v", "v-half", "v-min", "dualpipev")  # those of them with two chunks per rank in a V


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
            problem = None if value is None or isinstance(value, (str, bool, list)) else range_problem(f.name, value)
            if problem:
                raise ValueError(f"{flag(f.name)} must be {problem}, got {value!r}")


def range_problem(name, value):
    """The constraint of FIELDS[name] that value breaks, in words, or None."""
    rules = FIELDS[name] if isinstance(FIELDS[name], list) else [FIELDS[name]]
    return next((constraint for ok, constraint in rules if not ok(value)), None)


def value_problem(cls, name, value):
    """Why value cannot be cls's field `name` (its type, then its range), in words, or None: for the
    fields of a file that claims to hold a config (a manifest, a .pt's _config)."""
    kind = typing.get_type_hints(cls)[name]
    wrong = _type_problem(value, kind)
    if wrong:
        return wrong
    return None if value is None or isinstance(value, (str, bool, list)) else range_problem(name, value)


def layout_sizes(tc):
    """The layout's sizes in the rank grid's order, fastest first, as [(name, size)]: 05's tp, dp and
    pp, or the list a later chapter's config gives as its GRID (a size the config lacks is 1)."""
    return [(k, getattr(tc, k, 1)) for k in getattr(tc, "GRID", ("tp", "dp", "pp"))]


def world_size(tc):
    """The ranks tc's layout takes: the product of its sizes."""
    return math.prod(n for _, n in layout_sizes(tc))


def check_config(cfg, tc, world=None):
    """Every field, then the relations between them. cfg is a GPTConfig; tc any of the files'
    configs (a size it lacks counts as 1): 05's TrainConfig, or a demo's flags."""
    check_fields(cfg, tc)
    tp, pp, dp, v, m = (getattr(tc, k, 1) for k in ("tp", "pp", "dp", "virtual_stages", "microbatches"))
    if world is not None and world_size(tc) != world:
        raise ValueError(f"the world size {world} does not match {' x '.join(f'{k}={n}' for k, n in layout_sizes(tc))}")
    stages = pp * v
    if cfg.n_layer % stages:  # also when there are more stages than layers
        raise ValueError(f"--n-layer: n_layer={cfg.n_layer} is not divisible by {stages} pipeline stages "
                         f"(pp x v = {pp} x {v}); uneven splits are not supported")
    schedule = getattr(tc, "schedule", "")
    if schedule in ZERO_BUBBLE and v > 1:
        raise ValueError(f"--virtual-stages {v}: --schedule {schedule} places its own chunks (ZB-H1 one per rank, "
                         f"ZB-V two in a V); leave --virtual-stages at 1")
    if schedule in V_SHAPED and cfg.n_layer % (2 * pp):
        raise ValueError(f"--schedule {schedule} runs two chunks per rank in a V: --n-layer {cfg.n_layer} is not "
                         f"divisible by its 2 x pp = {2 * pp} stages; uneven splits are not supported")
    if schedule == "dualpipev" and m < 2 * pp:
        raise ValueError(f"--microbatches {m}: --schedule dualpipev needs at least as many microbatches as its "
                         f"2 x pp = {2 * pp} stages (m >= 2pp)")
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
        parse_faults(tc.rehearse_fault, world_size(tc), getattr(tc, "steps", None))
    if getattr(tc, "snapshot_every", 0) and not tc.snapshot_dir:
        raise ValueError(f"--snapshot-every {tc.snapshot_every} needs --snapshot-dir DIR (node-local, e.g. "
                         f"/dev/shm/snapshots)")
    if getattr(tc, "weight_decay", 0) * getattr(tc, "lr", 0) >= 1:  # decoupled decay: w -= lr * wd * w
        raise ValueError(f"--weight-decay {tc.weight_decay:g} with --lr {tc.lr:g}: AdamW multiplies every weight "
                         f"by 1 - lr x weight_decay = {1 - tc.lr * tc.weight_decay:.3g} each step, which must stay "
                         f"above 0; lower --weight-decay (GPT-2's is 0.1)")
    check_one_start(tc)
    if getattr(tc, "save_every", 0) and not tc.save:
        raise ValueError(f"--save-every {tc.save_every} needs --save DIR")
    if getattr(tc, "graph_scope", "auto") == "step" and world_size(tc) > 1:
        sizes = sorted(layout_sizes(tc), key=lambda kn: ("tp", "pp", "dp").index(kn[0]) if kn[0] in ("tp", "pp", "dp") else 3)
        raise ValueError(f"--graph-scope step captures one rank's whole step: it needs {' = '.join(k for k, _ in sizes)} "
                         f"= 1, got {', '.join(f'{k}={n}' for k, n in sizes)}")
    if getattr(tc, "graph_scope", "auto") == "step" and v > 1:
        raise ValueError(f"--graph-scope step captures one model chunk: it needs --virtual-stages 1, got {v}")
    if getattr(tc, "cuda_graphs", None) and (tp > 1 or tc.recompute != "none"):
        raise ValueError(f"--cuda-graphs captures whole stages, which here needs tp=1 (a stage with tp > 1 "
                         f"holds all-reduces) and --recompute none; got tp={tp}, recompute={tc.recompute}")
    if hasattr(tc, "check_relations"):  # a later chapter's config: the relations of its own flags to the others
        tc.check_relations(cfg, world)


def check_one_start(tc):
    """--init-from and --resume are two starting points: a run takes one."""
    if getattr(tc, "init_from", "") and getattr(tc, "resume", ""):
        raise ValueError(f"--init-from {tc.init_from} and --resume {tc.resume} both give the starting weights: "
                         f"--resume continues a checkpoint (weights, optimizer state, step), --init-from starts "
                         f"afresh from GPT-2 weights; give one of them")


def check_device(tc, device):
    """What the device decides: CUDA graphs and forced kernels need a GPU (checked on every rank
    before the first collective)."""
    if tc.cuda_graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a GPU: CUDA graphs record GPU kernel launches, and this "
                         f"run is on {device.type}. Drop the flag, or run under torchrun on GPUs.")
    if tc.fused_kernels is not False and tc.kernel_path == "cuda" and device.type != "cuda":
        raise ValueError(f"--kernel-path cuda forces the CUDA kernels, and this run is on {device.type}; "
                         f"use --kernel-path reference (same math, PyTorch) or auto")
    if tc.fused_kernels is not False and tc.kernel_path == "simt" and device.type != "cpu":
        raise ValueError(f"--kernel-path simt runs the CUDA kernels' source on the CPU (kernels/simt), and this "
                         f"run is on {device.type}; use --kernel-path cuda or auto")


def check_paths(tc, writer=True):
    """--save (and --snapshot-dir) must be a directory this process can write in (made if missing),
    not inside a checkpoint; --metrics and --trace files whose directory exists and that are not directories,
    FIFOs or devices. Probed by writing, since a permission bit does not tell (root, read-only
    mounts, full quotas); the files only by the process that will write them (writer), so that
    ranks sharing a path never race on it. What the files may replace: check_outputs."""
    for name in ("save", "snapshot_dir"):  # checkpoints, and 05's snapshots (the same protocol)
        root = getattr(tc, name, "")
        if not root:
            continue
        try:  # one look: another rank may be making the directory at this very moment
            is_dir = stat.S_ISDIR(os.stat(root).st_mode)
        except OSError:  # nothing there (or a parent is a file: the probe below says so)
            is_dir = None
        if is_dir is False:
            raise ValueError(f"{flag(name)} {root}: it is {paths.describe(root) or 'a file'}, not a directory for "
                             f"checkpoints")
        paths.refuse_source_directory(root, flag(name))
        inside = paths.enclosing_checkpoint(os.path.join(root, "step"))
        if inside:
            where = "is" if os.path.realpath(root) == inside else "lies inside"
            raise ValueError(f"{flag(name)} {root}: it {where} the checkpoint {inside}; checkpoints are saved beside "
                             f"each other, not inside one: give the directory that holds them")
        probe = os.path.join(root, f".write_test_{os.getpid()}_{os.uname().nodename}")
        try:
            os.makedirs(root, exist_ok=True)
            with paths.create_new(probe, "w"):  # never a file or link planted under its name
                pass
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"{flag(name)} {root}: cannot write checkpoints there ({e.strerror or e})") from None
    for name in ("metrics", "trace"):
        path = getattr(tc, name, "")
        if not path:
            continue
        what = paths.describe(path)
        if what:  # a FIFO would block the open below until something reads it
            raise ValueError(f"{flag(name)} {path}: it is {what}; give a file name")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"{flag(name)} {path}: the directory {folder} does not exist")
        if not writer:
            continue
        try:  # made now (or locked, if it is there): a second run started with it is refused, not interleaved
            paths.claim(path, flag(name))
        except OSError as e:
            raise ValueError(f"{flag(name)} {path}: cannot write it ({e.strerror or e})") from None


def read_paths(tc, resumed=None):
    """[(flag, path)] of every file a run of tc reads: the data, its sidecar and its mask, --init-from's
    files, the checkpoint it resumes (resumed: its directory)."""
    reads = []
    if getattr(tc, "data", ""):
        reads.append(("--data", tc.data))
        if tc.data.endswith(".bin"):
            reads.append(("--data's sidecar", tc.data[: -len(".bin")] + ".json"))
    if getattr(tc, "loss_mask", ""):
        reads.append(("--loss-mask", tc.loss_mask))
    init = getattr(tc, "init_from", "")
    if init:
        names = ("config.json", "model.safetensors", "pytorch_model.bin") if os.path.isdir(init) else ("",)
        reads += [("--init-from", os.path.join(init, n) if n else init) for n in names]
    if resumed:
        reads += [("--resume", os.path.join(resumed, n)) for n in sorted(os.listdir(resumed))]
    return reads


def check_outputs(tc, resumed=None, writer=True):
    """Every file the run writes (--metrics, --trace, and the step directories of --save and
    --snapshot-dir) checked against every file it reads, against each other and against
    checkpoints, links followed (plumbing/paths.py): none may replace an input or lie inside a
    checkpoint, whatever the flags, and none may replace a file this run did not write unless
    --overwrite. A resumed run's metrics and trace are its own when the checkpoint's manifest names
    them as the files of the run that wrote it (a manifest from before it did: when 05 wrote their
    contents): metrics are then appended to. writer: see paths.check_outputs."""
    writes = [("--metrics", getattr(tc, "metrics", "")), ("--trace", getattr(tc, "trace", ""))]
    protected = [("--resume", resumed, None)] if resumed else []
    for name in ("save", "snapshot_dir"):
        if getattr(tc, name, ""):
            protected.append((flag(name), getattr(tc, name), r"step_\d+(\.tmp)?"))
    own = set()
    if resumed:  # a continued run: its earlier metrics and trace are its own
        from plumbing.checkpoint import outputs_of
        written = outputs_of(resumed)
        for name, looks_like in (("metrics", paths.looks_like_metrics), ("trace", paths.looks_like_trace)):
            path = getattr(tc, name, "")
            if path and (os.path.realpath(path) == written.get(name) if written is not None else looks_like(path)):
                own.add(flag(name))
    paths.check_outputs(writes, read_paths(tc, resumed), protected, getattr(tc, "overwrite", False), own, writer)


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
    """Refuse a run whose weights, gradients, AdamW state and activations would not fit: on a GPU,
    the fullest rank's share (planner.params_per_gpu: the first stage) against the device; on CPU,
    ranks_here ranks of that share against this machine's RAM. The message names the flags that
    make it large: the model's (and which part of it), or the batch's."""
    import planner
    spec = planner.ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.block_size)
    params, zero1 = planner.params_exact(spec), getattr(tc, "zero1", False)
    fullest = planner.params_per_gpu(spec, planner.Layout(tc.tp, tc.pp, tc.dp, tc.batch_size))  # the first stage
    elt = {"float64": 8, "bfloat16": 2}.get(tc.dtype, 2 if tc.dtype == "auto" and device.type == "cuda" else 4)
    grad = max(elt, 4)  # low-precision weights keep fp32 gradients, masters and moments
    state = 2 * grad + (4 if elt < 4 else 0)  # AdamW's two moments (and fp32 masters): 1/dp of them with ZeRO-1
    weights = fullest * (elt + grad + state / (tc.dp if zero1 else 1))
    # Activations: Korthikanti's Table 2 for the layers in flight on the first stage (2-byte
    # activations, rescaled), one microbatch's fp32 logits, and the global batch's ids (int64,
    # inputs and targets), which every rank cuts from.
    T, b = tc.seq_len, max(1, tc.batch_size // (tc.dp * tc.microbatches))
    # A rank's activations and logits are its own tokens': a config that splits each sequence over
    # ranks says over how many (08's cp, its sequence_split); the global batch's ids are every rank's.
    run = planner.ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, T // getattr(tc, "sequence_split", 1))
    lay = planner.Layout(tc.tp, tc.pp, tc.dp, tc.batch_size, b=b, v=tc.virtual_stages, recompute=tc.recompute,
                         sequence_parallel=tc.sequence_parallel)
    logits, ids = b * run.seq_len * cfg.vocab_size / tc.tp * 4, 2 * tc.batch_size * (T + 1) * 8
    acts = planner.activation_bytes_per_layer(run, lay) * planner.layers_in_flight(run, lay) * elt / 2 + logits + ids
    total = (weights + acts) * (1 if device.type == "cuda" else ranks_here)
    have = machine_bytes(device)
    if not have or total <= have:
        return
    where = f"the GPU's {have / 2**30:.1f} GiB" if device.type == "cuda" else \
        f"this machine's {have / 2**30:.1f} GiB of memory ({ranks_here} ranks)"
    # Name what makes it large: the biggest of the weights' parts (with their gradients and optimizer
    # state) and the activations' parts, each with the flags that size it.
    L, h, V = cfg.n_layer, cfg.n_embd, cfg.vocab_size
    share = weights / max(params, 1)  # bytes per parameter, on the fullest rank
    batch = f"--batch-size {tc.batch_size} --seq-len {T}"
    parts = [(12 * L * h * h * share, f"--n-layer {L} --n-embd {h}", "the layers' weights"),
             (V * h * share, f"--vocab-size {V} --n-embd {h}", "the token embedding's weights"),
             (cfg.block_size * h * share, f"--block-size {cfg.block_size} --n-embd {h}",
              "the position embedding's weights"),
             (acts - logits - ids, batch, f"the activations of microbatches of b = batch / (dp x m) = {b:,} sequences"),
             (logits, f"--vocab-size {V} {batch}",
              f"the logits of a microbatch, b x T x V / tp = {b:,} x {run.seq_len} x {V} / {tc.tp}"),
             (ids, batch, "the global batch's token ids")]
    _, flags, what = max(parts)
    advice = "use more --microbatches or a smaller batch" if flags.startswith("--batch") else \
        "use more tp x pp or a smaller model"
    raise ValueError(f"{flags}: {what} are most of the {total / 2**30:,.1f} GiB this run needs (its {params:,} "
                     f"parameters' weights, gradients and optimizer state, and its activations), more than {where}; "
                     f"{advice}")


# ----------------------------------------------------------------------------------------------
# 05's actions: what each uses, so that a flag given to one that ignores it is refused


SAMPLING = ("max_new_tokens", "temperature", "top_k")
MODEL_SHAPE = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")  # what weights decide
ACTIONS = ("print_layout", "self_check", "sample", "export_hf", "export_state_dict", "verify")
USES = {  # besides the action's own flag
    "print_layout": {"tp", "pp", "dp", "schedule"},
    "self_check": {"tp", "pp", "dp", "timeout_s", "rehearse_fault"},
    "sample": {"resume", "init_from", "seed", *MODEL_SHAPE, *SAMPLING},
    "export": {"resume", "overwrite", "export_hf", "export_state_dict"},
    "verify": set(),
}
PATH_FLAGS = {"data": "file to train on", "loss_mask": "mask file (one byte, 0 or 1, per token of --data)",
              "resume": "checkpoint directory to resume from",
              "init_from": "GPT-2 directory or .pt to start from", "metrics": "file to write",
              "trace": "file to write", "save": "directory to save into", "snapshot_dir": "directory to snapshot into",
              "export_hf": "directory to write", "export_state_dict": "file to write",
              "verify": "checkpoint directory to check", "resume_if_present": "checkpoint directory to resume from"}
WHY = {"print_layout": "it prints the rank grid of --tp, --pp and --dp and starts nothing",
       "self_check": "it tries every rank, group and link of --tp, --pp and --dp and trains nothing",
       "sample": "it samples on one process from the weights, which decide the model",
       "export": "it writes --resume's newest checkpoint and trains nothing",
       "verify": "it checks the checkpoint it names and loads nothing into a model"}


# Training flags that do nothing without another: (is the other on?, the other, why). Given
# without it, each is refused rather than silently ignored (--save-every without --save: check_config).
_SAVES = lambda a: bool(a.save or a.snapshot_every)  # noqa: E731  (checkpoints, or snapshots: a Saver each)
_SAVING = "needs --save DIR (or --snapshot-every N), whose saves it {}; without either it would be ignored: drop it"
_WATCH = "is the watch's, which --no-watch turns off ({}); it would be ignored: drop one of the two"
DEPENDS = {
    "keep": (lambda a: bool(a.save), "needs --save DIR: only --save's checkpoints are kept or removed; without it "
                                     "it would be ignored: drop it, or add --save DIR"),
    "async_save": (_SAVES, _SAVING.format("writes in the background")),
    "save_timeout_s": (_SAVES, _SAVING.format("bounds")),
    "snapshot_dir": (lambda a: bool(a.snapshot_every), "needs --snapshot-every N: without it no snapshot is taken, "
                                                       "and it would be ignored: drop it, or add --snapshot-every N"),
    "straggler_every": (lambda a: a.watch, _WATCH.format("the straggler report")),
    "hang_s": (lambda a: a.watch, _WATCH.format("the hang report")),
    "data_changed_ok": (lambda a: bool(a.resume or getattr(a, "resume_if_present", None)), "needs --resume DIR: only a resumed checkpoint's data is compared "
                                                  "with --data; without it it would be ignored: drop it"),
    "loss_mask": (lambda a: bool(a.data), "needs --data FILE: the mask has one byte per token of a data file, and the "
                                          "built-in corpus has no mask; add --data FILE, or drop --loss-mask"),
}


def check_action(args, given, layout=("tp", "dp", "pp"), sampling=SAMPLING):
    """The action a command of 05 asks for ("print_layout", "sample", "export" or None: train),
    refusing two at once (--export-hf and --export-state-dict together are one: both are written),
    an empty path, --init-from with --resume, and any flag the action would silently ignore.
    given: the names of the flags on the command line (cli.given); layout: the names of the
    layout's sizes, which --print-layout and --self-check use (layout_sizes); sampling: the flags
    that only sampling reads (a later chapter may own one of SAMPLING's names: 09's --top-k)."""
    for name, what in PATH_FLAGS.items():  # given, but empty: not the same as not given
        if name in given and not str(getattr(args, name, None) or "").strip():
            raise ValueError(f"{flag(name)}: the path is empty; give the {what}")
    chosen = [a for a in ACTIONS if getattr(args, a, None) not in (None, False)]
    kinds = list(dict.fromkeys("export" if a.startswith("export") else a for a in chosen))
    if len(kinds) > 1:
        raise ValueError(f"{' and '.join(flag(a) for a in chosen)} are {len(kinds)} actions; give one of them")
    action = kinds[0] if kinds else None
    check_one_start(args)
    if action is None:
        ignored = [n for n in sampling if n in given]
        if ignored:
            raise ValueError(f"{', '.join(map(flag, ignored))}: {'it applies' if len(ignored) == 1 else 'they apply'} "
                             f"to --sample only, and this command trains; drop {'it' if len(ignored) == 1 else 'them'}")
        for name, (on, why) in DEPENDS.items():
            if name in given and not on(args):
                value = getattr(args, name)
                shown = "" if isinstance(value, bool) else f" {value:g}" if isinstance(value, float) else f" {value}"
                raise ValueError(f"{flag(name)}{shown} {why}")
        return None
    uses = USES[action] | (set(layout) if action in ("print_layout", "self_check") else set())
    ignored = sorted(given - uses - set(ACTIONS) - {"plan"})
    if ignored:
        names = ", ".join(map(flag, ignored))
        raise ValueError(f"{flag(chosen[0])} does not use {names}: {WHY[action]}; drop "
                         f"{'it' if len(ignored) == 1 else 'them'}")
    return action


def check_plan_flags(given, model_flags):
    """--plan uses its own flags (--gpus, --plan-*) and, for --plan custom, the model's size
    (model_flags: the dests it reads); any other flag would be silently ignored: refused."""
    ignored = sorted(n for n in given if n not in ("plan", "gpus", *model_flags) and not n.startswith("plan_"))
    if ignored:
        raise ValueError(f"--plan does not use {', '.join(map(flag, ignored))}: it prints the papers' estimates "
                         f"and starts nothing; drop {'it' if len(ignored) == 1 else 'them'}")


def check_model_flags(given, cfg, weights_cfg, source):
    """Model flags given beside weights that carry their own model (a checkpoint's manifest, a
    GPT-2 config.json, a .pt's _config) must agree with it: the weights decide the model, and a
    flag that said otherwise would be ignored."""
    differ = [f"{flag(k)} {getattr(cfg, k)} (it has {getattr(weights_cfg, k)})" for k in MODEL_SHAPE
              if k in given and getattr(cfg, k) != getattr(weights_cfg, k)]
    if differ:
        raise ValueError(f"{', '.join(differ)}: the model is {source}'s, which these flags contradict; drop them "
                         f"(the weights decide the model's size)")


def preflight(cfg, tc, world, device, say=None, ranks_here=None, writer=True):
    """Everything 05 can refuse before a process group exists, in the order a user would fix it.
    writer: this process writes --metrics and --trace (rank 0, or the launching process); it also
    reads every tensor of the checkpoint to resume, and locks the --save directory.
    Returns (train tokens, eval tokens, the checkpoint to resume or None, the steps it holds)."""
    # Imported here: 01-04 import this module for check_config, and these import 01.
    from plumbing.checkpoint import check_save_dir, check_shards, hold, latest_checkpoint, read_manifest
    from plumbing.data import load_tokens, split_tokens
    check_config(cfg, tc, world)
    check_device(tc, device)
    path = latest_checkpoint(tc.resume, say, flag="--resume") if tc.resume else None
    path = hold(path) if path else None  # read under a shared lock: another run's --keep leaves it
    check_outputs(tc, path, writer)
    check_paths(tc, writer)
    check_memory(cfg, tc, device, world if ranks_here is None else ranks_here)
    tokens = load_tokens(tc.data, cfg.vocab_size, tc.seq_len, getattr(tc, "loss_mask", ""))  # Masked with a mask
    train_tokens, eval_tokens = split_tokens(tokens, tc.seq_len, tc.data)
    manifest = read_manifest(path, cfg, tc, say) if path else dict(step=0)
    if path:
        check_shards(path, manifest, tensors=writer)
    start = manifest["step"]
    for name in ("save", "snapshot_dir"):
        root = getattr(tc, name, "")
        if root:  # a restart picks the newest step there: none of another run's may be later
            check_save_dir(root, start, resuming_from=path, name=flag(name))
            if writer:  # then again under the lock: nothing can have appeared since
                paths.lock_save_dir(root, flag(name))
                check_save_dir(root, start, resuming_from=path, name=flag(name))
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
    return fused, "step" if world_size(tc) == tc.virtual_stages == 1 else "stage"


# ----------------------------------------------------------------------------------------------
# The library's own arguments, refused by name where torch would compute something else silently:
# 08's context-parallel splits, 09's router, 01's model sizes and device.


def check_split(sched, T, where):
    """Refuse T tokens that 08's split sched does not cut into equal blocks: T // n would drop the
    last T mod n tokens without a word."""
    if T % sched.n:
        raise ValueError(f"{where}: T={T} tokens do not split into the {sched.name} split's {sched.n} equal blocks "
                         f"(cp={sched.cp}); T must be a multiple of {sched.n}")


def check_rows(sched, rank, q, k, v, where):
    """q, k and v (B, nh, rows, hs) of one rank of 08's split: the same rows, which split into the rank's
    blocks (rank given), or which make a T the split cuts (rank None: every rank holds as many)."""
    rows = q.shape[2]
    if k.shape[2] != rows or v.shape[2] != rows:
        raise ValueError(f"{where}: q, k and v hold {rows}, {k.shape[2]} and {v.shape[2]} rows; they must be the same")
    if rank is None:
        return check_split(sched, rows * sched.cp, where)
    if rows % len(sched.split[rank]):
        raise ValueError(f"{where}: rank {rank}'s {rows} rows do not split into its {len(sched.split[rank])} blocks of "
                         f"the {sched.name} split; T must be a multiple of {sched.n}")


def check_router(logits, weight, x):
    """Refuse router logits that hold NaN or inf (09's route): top-k of NaN picks any expert, with NaN
    weights. Names where it came from: the router's weight, or the tokens."""
    import torch
    if not bool(torch.isfinite(logits).all()):
        where = "the router's weight" if not bool(torch.isfinite(weight).all()) else "the tokens x"
        raise FloatingPointError(f"route: the router's logits hold NaN or inf (from {where}; weight "
                                 f"{tuple(weight.shape)}, x {tuple(x.shape)}): no expert can be chosen for such a token")


MODEL_SIZES = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")


def check_model(cfg, tp=1, device="cpu"):
    """01's GPT: every size a whole number of at least 1 (naming the field: torch would say "negative
    dimension"), heads that split over C (hs = C / nh) and over the tp ranks, and a CUDA device only
    where torch has one (its own error is a generator's). Returns tp."""
    import torch
    for name in MODEL_SIZES:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"GPTConfig.{name}={value!r} must be a whole number, at least 1")
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd={cfg.n_embd} must be divisible by n_head={cfg.n_head}")
    if cfg.n_head % tp:
        raise ValueError(f"n_head={cfg.n_head} must be divisible by tp={tp}")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}: this machine has no GPU that torch can use (torch.cuda.is_available() "
                         f"is False: no CUDA device or driver, or a CPU-only build of torch); use device='cpu'")
    return tp


# ----------------------------------------------------------------------------------------------
# 08's and 09's flags: the relations their configs' check_relations (called by check_config above) ask
# for, each refused in a sentence before anything starts. 08 and 09 re-export them.


def check_context(tc, cfg, splits):
    """The relations of 08's flags (its TrainConfig: --cp, --cp-schedule, --cp-attention, --recompute
    lightseq) to the others; splits: 08's SPLITS, each split's blocks for the sequence length."""
    for name, default in (("cp_schedule", "megatron"), ("cp_attention", "ring")):
        if tc.cp == 1 and getattr(tc, name) != default:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(tc, name)} with --cp 1: one rank holds the "
                             f"whole sequence, so it would change nothing; drop it, or give --cp 2 or more")
    ring = tc.cp > 1 or tc.recompute == "lightseq"
    n = splits[tc.cp_schedule](tc.cp).n * (tc.tp if tc.sequence_parallel else 1)
    if ring and tc.seq_len % n:
        parts = f"{splits[tc.cp_schedule](tc.cp).n} blocks" + (
            f", each split again over tp={tc.tp} by --sequence-parallel" if tc.sequence_parallel else "")
        raise ValueError(f"--seq-len {tc.seq_len}: --cp {tc.cp} with --cp-schedule {tc.cp_schedule} cuts "
                         f"each sequence into {parts}: it must be divisible by {n}")
    if ring and cfg.dropout:
        raise ValueError(f"--dropout {cfg.dropout:g} with --cp {tc.cp}: context parallelism's attention "
                         f"computes the probabilities block by block and drops none of them, which would differ "
                         f"from --dropout's model; give --dropout 0 (or --cp 1)")
    if tc.cp_attention == "ulysses" and (cfg.n_head // tc.tp) % tc.cp:
        raise ValueError(f"--cp-attention ulysses gives each of the cp={tc.cp} ranks 1/cp of the "
                         f"n_head / tp = {cfg.n_head} / {tc.tp} heads a rank holds: {cfg.n_head // tc.tp} "
                         f"is not divisible by --cp {tc.cp}")
    if tc.recompute == "lightseq" and tc.cp_attention == "ulysses":
        raise ValueError("--recompute lightseq keeps ring attention's output and log-sum-exp; --cp-attention "
                         "ulysses has neither: use --recompute full or selective with it")
    if ring and tc.fused_kernels and not tc.flash_attention:
        raise ValueError(f"--no-flash-attention with --cp {tc.cp}: it chooses the fused kernels' attention "
                         f"core, which context parallelism replaces (the other fused kernels stay); drop the flag")
    if tc.cuda_graphs and tc.cp > 1:
        raise ValueError(f"--cuda-graphs with --cp {tc.cp}: a captured stage cannot hold the ring's "
                         f"point-to-point exchanges; drop the flag")


def check_experts(flags, n_embd):
    """The relations of 09's experts' flags (its demo's or its trainer's), each refused in a sentence before
    anything starts (check_config calls it, as the config's check_relations); for the trainer, the one pair
    not composed: 06's split backward (--schedule zb-*) with 08's executor (--cp, --recompute lightseq)."""
    tp, cp, dp, pp, ep, etp = (getattr(flags, k, 1) for k in ("tp", "cp", "dp", "pp", "ep", "etp"))
    E, k = flags.num_experts, flags.top_k
    if k < 1 or k > E:
        raise ValueError(f"--top-k {k}: each token goes to between 1 and --num-experts {E} experts")
    if E % ep:
        raise ValueError(f"--num-experts {E} is not divisible by --ep {ep}: each expert-parallel rank holds E / ep "
                         f"experts")
    if (tp * cp * dp) % (ep * etp):
        stage = f"tp x cp x dp = {tp} x {cp} x {dp}" if cp > 1 else f"tp x dp = {tp} x {dp}"
        raise ValueError(f"--ep {ep} x --etp {etp} = {ep * etp} does not divide {stage}: the experts' grid folds onto a "
                         f"pipeline stage's ranks, (world / pp = {tp * cp * dp * pp} / {pp})")
    if 4 * n_embd % etp:
        raise ValueError(f"--etp {etp} does not divide an expert's 4 x n_embd hidden units")
    if tp > 1 and not getattr(flags, "sequence_parallel", False) and flags.seq_len % (tp * cp):
        by = f"tp={tp}" + (f" x cp={cp}" if cp > 1 else "")
        raise ValueError(f"--seq-len {flags.seq_len} is not divisible by {by}: without --sequence-parallel each tp "
                         f"rank routes T/tp of the tokens{' of its cp rank' if cp > 1 else ''}")
    if getattr(flags, "cuda_graphs", None):
        raise ValueError("--cuda-graphs: the dispatcher's all-to-all sizes are read on the host each step, which a "
                         "captured graph cannot; drop the flag")
    schedule, recompute = getattr(flags, "schedule", "1f1b"), getattr(flags, "recompute", "none")  # the trainer's
    if (cp > 1 or recompute == "lightseq") and schedule != "1f1b":
        why = f"--cp {cp}" if cp > 1 else "--recompute lightseq"
        raise ValueError(f"--schedule {schedule} with {why}: 08's ring runs in 05's 1F1B and interleaved "
                         f"1F1B, whose executor weights each rank's share of the loss; 06's executor of I and W "
                         f"does not, so the two are not composed here; give --schedule 1f1b")


def check_expert_demo(flags, cfg):
    """09's demo's flags: check_experts; with cp, what 08's split and the exact comparison with serial need."""
    check_experts(flags, cfg.n_embd)
    n = 2 * flags.cp * (flags.tp if flags.sequence_parallel else 1)
    if flags.cp > 1 and flags.seq_len % n:
        raise ValueError(f"--seq-len {flags.seq_len}: --cp {flags.cp} cuts each sequence into Megatron's 2 cp = "
                         f"{2 * flags.cp} blocks{' (each split again over tp by --sequence-parallel)' if n > 2 * flags.cp else ''}: "
                         f"it must be divisible by {n}")
    if flags.cp > 1 and cfg.dropout:
        raise ValueError(f"--dropout {cfg.dropout:g} with --cp {flags.cp}: ring attention drops no probability, "
                         f"and the demo compares with the serial model exactly; give --dropout 0")
    if cfg.dropout:
        raise ValueError(f"--dropout {cfg.dropout:g}: the demo compares the lesson and the expert-parallel model "
                         f"with the serial one exactly, and each rank would draw other masks; give --dropout 0")
    world = flags.tp * flags.cp * flags.dp
    if flags.batch_size % world:
        raise ValueError(f"--batch-size {flags.batch_size} is not divisible by tp x cp x dp = {world}: the demo's "
                         f"lesson runs every rank as a replica of the dense model on B / {world} of the rows")
    if flags.cp > 1 and flags.capacity_factor:
        raise ValueError(f"--capacity-factor {flags.capacity_factor:g} with --cp {flags.cp}: the demo's serial "
                         f"reference drops by the rule over the runs of a sequence the tp ranks hold; 08's split "
                         f"gives a rank two blocks apart, which it does not reproduce; give --cp 1 (the trainer "
                         f"takes both, and drops per rank)")


# ----------------------------------------------------------------------------------------------
# 02's pipeline demo (re-exported by 02; 03, 06 and the exercises call them through it).


def check_world(pp, world_size):
    if pp != world_size:
        raise ValueError(f"the world size {world_size} does not match pp={pp} (one stage per rank)")


def split_batch(idx, targets, m):
    """Cut the global batch (B, T) into m microbatches of B/m rows."""
    B = idx.shape[0]
    if m < 1:
        raise ValueError(f"the number of microbatches m={m} must be at least 1")
    if B % m:
        raise ValueError(f"the global batch of {B} sequences is not divisible by m={m} microbatches")
    return list(zip(idx.chunk(m), targets.chunk(m)))
