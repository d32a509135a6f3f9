"""Checks of 05's config, all before any process group exists, and what unset flags resolve to.

    check_config(cfg, tc, world)   the sizes, the layout (tp x dp x pp = world, layers per stage,
                                   microbatches per interleaving group), the batch, the flags' pairs
    check_device(tc, device)       what needs a GPU (CUDA graphs, forced CUDA kernels)
    acceleration(tc, device)       fused kernels on? CUDA graphs per stage, of the whole step, or off?

05 runs them in the launching process, so that bad input fails before any fork, and again on
every rank before the first collective (under torchrun there is no launching process of ours).
"""
import importlib

import kernels

pipeline = importlib.import_module("02_pipeline_1f1b")
interleaved = importlib.import_module("03_interleaved")


def check_config(cfg, tc, world):
    """Everything that can be wrong with a GPTConfig and a TrainConfig for a world of ranks."""
    for name in ("tp", "pp", "dp", "virtual_stages", "batch_size", "microbatches", "seq_len",
                 "steps", "bucket_numel", "eval_batches"):
        if getattr(tc, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(tc, name)}")
    if not (tc.lr > 0 and tc.min_lr >= 0 and tc.grad_clip > 0 and tc.weight_decay >= 0):
        raise ValueError(f"need lr > 0, min_lr >= 0, grad_clip > 0, weight_decay >= 0; got "
                         f"{tc.lr}, {tc.min_lr}, {tc.grad_clip}, {tc.weight_decay}")
    if tc.tp * tc.dp * tc.pp != world:
        raise ValueError(f"the world size {world} does not match tp={tc.tp} x dp={tc.dp} x pp={tc.pp}")
    pipeline.split_layers(cfg.n_layer, tc.pp * tc.virtual_stages)
    if tc.batch_size % (tc.dp * tc.microbatches):
        raise ValueError(f"the global batch of {tc.batch_size} sequences is not divisible by "
                         f"dp x m = {tc.dp} x {tc.microbatches}")
    interleaved.check_interleaving(tc.pp, tc.microbatches, tc.virtual_stages)
    if cfg.n_embd % cfg.n_head or cfg.n_head % tc.tp:
        raise ValueError(f"need n_embd={cfg.n_embd} divisible by n_head={cfg.n_head}, and n_head "
                         f"divisible by tp={tc.tp}")
    if tc.seq_len > cfg.block_size:
        raise ValueError(f"seq_len={tc.seq_len} exceeds block_size={cfg.block_size}")
    if tc.sequence_parallel and tc.seq_len % tc.tp:
        raise ValueError(f"sequence parallelism needs seq_len={tc.seq_len} divisible by tp={tc.tp}")
    if tc.save_every < 0 or tc.keep < 1 or (tc.save_every and not tc.save):
        raise ValueError(f"need --save-every >= 0 (with --save) and --keep >= 1; got "
                         f"save_every={tc.save_every}, keep={tc.keep}, save={tc.save!r}")
    if tc.dtype not in ("auto", "float32", "float64", "bfloat16"):
        raise ValueError(f"--dtype must be auto, float32, float64 or bfloat16, got {tc.dtype!r}")
    if tc.kernel_path not in kernels.build.MODES:
        raise ValueError(f"--kernel-path must be one of {kernels.build.MODES}, got {tc.kernel_path!r}")
    if tc.graph_scope not in ("auto", "stage", "step"):
        raise ValueError(f"--graph-scope must be auto, stage or step, got {tc.graph_scope!r}")
    if tc.graph_scope == "step" and tc.tp * tc.pp * tc.dp > 1:
        raise ValueError(f"--graph-scope step captures one rank's whole step: it needs tp = pp = dp = 1, "
                         f"got tp={tc.tp}, pp={tc.pp}, dp={tc.dp}")
    if tc.cuda_graphs and (tc.tp > 1 or tc.recompute):
        raise ValueError(f"--cuda-graphs captures whole stages, which here needs tp=1 (a stage with tp > 1 "
                         f"holds all-reduces) and no --recompute; got tp={tc.tp}, recompute={tc.recompute}")


def check_device(tc, device):
    """What the device decides: CUDA graphs and forced kernels need a GPU (checked on every rank
    before the first collective)."""
    if tc.cuda_graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a GPU: CUDA graphs record GPU kernel launches, and this "
                         f"run is on {device.type}. Drop the flag, or run under torchrun on GPUs.")
    if tc.fused_kernels is not False and tc.kernel_path == "cuda" and device.type != "cuda":
        raise ValueError(f"--kernel-path cuda forces the CUDA kernels, and this run is on {device.type}; "
                         f"use --kernel-path reference (same math, PyTorch) or auto")


def acceleration(tc, device):
    """(fused kernels on?, CUDA graphs: None, "stage" or "step"), unset flags resolved: both on on
    a GPU, graphs where the layout allows them; the whole step is one graph at tp = pp = dp = 1."""
    gpu = device.type == "cuda"
    fused = gpu if tc.fused_kernels is None else tc.fused_kernels
    graphs = (gpu and tc.tp == 1 and not tc.recompute) if tc.cuda_graphs is None else tc.cuda_graphs
    if not graphs:
        return fused, None
    if tc.graph_scope != "auto":
        return fused, tc.graph_scope
    return fused, "step" if tc.tp == tc.pp == tc.dp == 1 else "stage"
