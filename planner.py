"""The planner: what a model costs on a cluster, from closed forms only, allocating nothing.

    python3 05_3d_gpt.py --plan 1T --gpus 3072           # Table 1's 1T model on 3072 A100s
    python3 05_3d_gpt.py --plan custom --n-layer 24 --n-embd 2048 --n-head 16 --gpus 64 --plan-batch 512

It is the arithmetic of the papers, each formula a function below, in the papers' own symbols:
l layers, h hidden size, a heads, V vocabulary, s sequence, B global batch, b micro-batch,
t, p, d the tensor-, pipeline- and data-parallel sizes, n GPUs, T training tokens, X FLOP/s per GPU.

    parameters        P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))            Narayanan eq. 2
    FLOPs/iteration   F = 96 B s l h^2 (1 + s/(6 h) + V/(16 l h))                Narayanan eq. 3
                      (with full recomputation: forward, backward, forward again)
    training time     8 T P / (n X)   (6 T P / (n X) without recomputation)     Narayanan eq. 4
    bubble            (p - 1) / (v m), m = B / (b d) microbatches per pipeline  Narayanan 2.2
    activations       s b h (10 + 24/t + 5 a s/(h t)) bytes per layer           Korthikanti Table 2
                      s b h (34/t + 5 a s/(h t)) with sequence parallelism
                      2 s b h (/ t with sequence parallelism) with full recomputation
    memory per GPU    2 + 4 + 12 bytes per parameter (bf16 weights, fp32 gradients, fp32 master
                      and two Adam moments; the optimizer's 12 / d under ZeRO-1), plus activations
                      for the layers in flight (Korthikanti 4.2.3)

The throughput estimate on top (estimate_iteration) is a model with stated constants (Cluster);
05's start-up summary uses the same formulas for the run at hand. Mixed precision as in Megatron;
GB = 1e9 bytes.
"""
import argparse
import re
from collections import namedtuple
from dataclasses import dataclass

PAPER_VOCAB, PAPER_SEQ = 51200, 2048  # every row of Table 1
# tflops: the achieved teraFLOP/s per GPU, counted with eq. 3 (recomputation included).
PaperRow = namedtuple("PaperRow", "billions n_head n_embd n_layer tp pp n_gpus batch tflops")
ModelSpec = namedtuple("ModelSpec", "n_layer n_embd n_head vocab_size seq_len",
                       defaults=(PAPER_VOCAB, PAPER_SEQ))

# Narayanan et al. 2021, Table 1 (weak scaling on A100s).
PAPER_CONFIGS = {f"{r[0]}B": PaperRow(*r) for r in [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]}


@dataclass(frozen=True)
class Layout:
    """One way to run the model: the three sizes, the batch cut and the memory-saving options."""
    tp: int
    pp: int
    dp: int
    batch: int  # B, global, in sequences
    b: int = 1  # micro-batch size
    v: int = 1  # virtual stages per pipeline rank
    recompute: bool = True  # full activation recomputation, as in the paper's runs
    sequence_parallel: bool = False  # shard LayerNorm and dropout activations along T (Korthikanti)
    zero1: bool = False
    scatter_gather: bool = True  # Narayanan Section 4.1: pp messages split over the tp ranks

    @property
    def m(self):  # at least 1, so that a refused layout can still be described
        return max(1, self.batch // (self.b * self.dp))


@dataclass(frozen=True)
class Cluster:
    """The machine the throughput model assumes: Narayanan's A100 cluster (Section 5)."""
    peak_tflops: float = 312.0  # A100 bf16 dense tensor cores
    # Of peak, reached by the layers' GEMMs before bubble and communication: chosen so that the
    # paper's 1T layout comes out near its measured 163 TFLOP/s (small models land above theirs).
    efficiency: float = 0.6
    nvlink_gbs: float = 300.0  # per GPU per direction, inside a node (carries tp)
    ib_gbs: float = 25.0  # per GPU per direction, across nodes (carries pp and dp)
    gpu_mem_gb: float = 80.0  # 80e9 B: an "80 GB" A100 has 85.9e9, the rest is left as headroom
    gpus_per_node: int = 8


def model_spec(name_or_spec):
    """A ModelSpec from a ModelSpec, a GPTConfig (seq_len = block_size) or a Table 1 name."""
    c = name_or_spec
    if isinstance(c, ModelSpec):
        return c
    if hasattr(c, "block_size"):
        return ModelSpec(c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.block_size)
    row = paper_row(name_or_spec)
    return ModelSpec(row.n_layer, row.n_embd, row.n_head)


def paper_row(name):
    """The Table 1 row within 2% of name ("145.6B", "1T", "1008B"), or ValueError."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([bBtT])\s*", str(name))
    if match:
        billions = float(match[1]) * (1000 if match[2] in "tT" else 1)
        row = min(PAPER_CONFIGS.values(), key=lambda r: abs(r.billions - billions))
        if abs(row.billions - billions) <= 0.02 * row.billions:  # so "1T" finds 1008.0B
            return row
    raise ValueError(f"unknown model {name!r}: give one of {', '.join(PAPER_CONFIGS)} or 1T")


def params_eq2(m):
    """Narayanan eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))."""
    l, h = m.n_layer, m.n_embd
    return 12 * l * h * h * (1 + 13 / (12 * h) + (m.vocab_size + m.seq_len) / (12 * l * h))


def params_exact(m):
    """Exactly 01's GPT-2 (V unpadded): eq. 2 expanded, plus the final LayerNorm's 2h."""
    l, h = m.n_layer, m.n_embd
    return 12 * l * h * h + 13 * l * h + (m.vocab_size + m.seq_len) * h + 2 * h


def flops_per_iteration(m, batch, recompute=True):
    """Narayanan eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation."""
    l, h, s, V = m.n_layer, m.n_embd, m.seq_len, m.vocab_size
    # A layer's forward is 24 B s h^2 (1 + s/(6h)); backward is twice that and recomputation one
    # more forward (4x, 3x without); the logit layer (2 B s h V) is never recomputed: always 3x.
    # So without recomputation the last term is V/(12 l h), not the paper's V/(16 l h).
    k = 4 if recompute else 3
    return 24 * k * batch * s * l * h * h * (1 + s / (6 * h) + 6 * V / (24 * k * l * h))


def training_days(tokens, params, n_gpus, tflops, recompute=True):
    """Narayanan eq. 4: 8 T P / (n X) seconds (6 T P / (n X) without recomputation), in days."""
    return (8 if recompute else 6) * tokens * params / (n_gpus * tflops * 1e12) / 86400


def bubble_fraction(pp, m, v=1):
    """Narayanan Section 2.2: the pipeline bubble (pp-1)/(v m) of the ideal compute time."""
    return (pp - 1) / (v * m)


def params_per_gpu(m, L):
    """The fullest GPU's parameters: the first stage's l/pp layers plus the embeddings, over tp."""
    h = m.n_embd
    # The replicated LayerNorms and row-parallel biases (a few h per layer) are counted as split.
    # The last stage holds the tied output copy (V h) instead of the position table (s h) and ln_f.
    embed = (m.vocab_size + m.seq_len) * h + (2 * h if L.pp == 1 else 0)
    return (m.n_layer / L.pp * (12 * h * h + 13 * h) + embed) / L.tp


def activation_bytes_per_layer(m, L):
    """Korthikanti Table 2: one layer's stored activations for one microbatch on one tp rank."""
    s, b, h, a, t = m.seq_len, L.b, m.n_embd, m.n_head, L.tp
    if L.recompute:  # only the layer's bf16 input, replicated over tp unless sequence-parallel
        return 2 * s * b * h / (t if L.sequence_parallel else 1)
    if L.sequence_parallel:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))  # LayerNorms, dropout masks replicated


def layers_in_flight(m, L):
    """Layers' worth of activations the first stage holds at its peak (Korthikanti 4.2.3)."""
    # 1F1B: pp microbatches of l/pp layers = l. Megatron's interleaved schedule warms up
    # (v+1) pp - 1 chunks of l/(pp v) layers = l (1 + (pp-1)/(pp v)). Fewer if m is small.
    chunks = min(L.m * L.v, L.pp if L.v == 1 else (L.v + 1) * L.pp - 1)
    return chunks * m.n_layer / (L.pp * L.v)


def memory_per_gpu(m, L):
    """Bytes on the fullest GPU: bf16 weights, fp32 gradients, fp32 Adam state, activations."""
    n = params_per_gpu(m, L)
    # Embedding and output-layer activations are left out (Korthikanti 4.3: small for pp > 1).
    mem = dict(params=n, weights=2 * n, gradients=4 * n,
               optimizer=12 * n / (L.dp if L.zero1 else 1),  # fp32 master + 2 Adam moments
               activations=activation_bytes_per_layer(m, L) * layers_in_flight(m, L))
    mem["total"] = mem["weights"] + mem["gradients"] + mem["optimizer"] + mem["activations"]
    return mem


def comm_bytes_per_gpu(m, L):
    """Bytes one GPU sends per iteration for tp all-reduce, pp point-to-point and dp reduction."""
    t, d, act = L.tp, L.dp, 2 * L.b * m.seq_len * m.n_embd  # one microbatch's bf16 hidden state
    # 2 forward + 2 backward all-reduces per layer per microbatch, +2 when the forward is rerun; a
    # ring moves 2 (t-1)/t of the data per GPU, as do sequence parallelism's all-gather and
    # reduce-scatter that replace each all-reduce (Korthikanti 4.2.2).
    tp_bytes = (6 if L.recompute else 4) * L.m * m.n_layer / L.pp * act * 2 * (t - 1) / t
    # An activation forward and a gradient backward per microbatch, at each of a rank's v chunks.
    split = t if (L.scatter_gather or L.sequence_parallel) else 1
    pp_bytes = 0.0 if L.pp == 1 else 2 * L.m * L.v * act / split
    n = params_per_gpu(m, L)
    # fp32 gradients are all-reduced; ZeRO-1 reduce-scatters them and all-gathers the updated bf16
    # weights (as Megatron's distributed optimizer does), so it sends 6 (d-1)/d B/param, not 8.
    dp_bytes = (d - 1) / d * n * (4 + 2 if L.zero1 else 2 * 4)
    return dict(tp=tp_bytes, pp=pp_bytes, dp=dp_bytes)


def estimate_iteration(m, L, n_gpus, c=Cluster()):
    """Seconds per iteration, by part, and TFLOP/s per GPU under THROUGHPUT_MODEL."""
    flops, comm = flops_per_iteration(m, L.batch, L.recompute), comm_bytes_per_gpu(m, L)
    t = dict(compute=flops / (n_gpus * c.peak_tflops * 1e12 * c.efficiency))
    t["bubble"] = t["compute"] * bubble_fraction(L.pp, L.m, L.v)
    t["tp"] = comm["tp"] / (c.nvlink_gbs * 1e9)  # on the critical path: nothing to hide it behind
    t["pp"] = comm["pp"] / (c.ib_gbs * 1e9)
    # Gradients are final only after the last microbatch's backward, so the dp reduction can hide
    # behind that one backward (3/4 of a microbatch's work with recomputation, 2/3 without).
    hidden = t["compute"] / L.m * (0.75 if L.recompute else 2 / 3)
    t["dp"] = max(0.0, comm["dp"] / (c.ib_gbs * 1e9) - hidden)
    t["total"] = sum(t.values())
    t["tflops"] = flops / (n_gpus * t["total"]) / 1e12
    return t


THROUGHPUT_MODEL = ("time = F/(n peak eff) (1 + bubble) + tp bytes/NVLink + pp bytes/IB"
                    " + dp bytes/IB less the last microbatch's backward")


def layout_problems(m, L, n_gpus, c=Cluster()):
    """Why layout L cannot run model m on n_gpus: a list of reasons, empty if it can."""
    checks = [(L.tp * L.pp * L.dp == n_gpus, f"tp*pp*dp != {n_gpus} GPUs"),
              (L.tp <= c.gpus_per_node, f"tp={L.tp} spans nodes ({c.gpus_per_node} GPUs each)"),
              (m.n_head % L.tp == 0, f"{m.n_head} heads not divisible by tp={L.tp}"),
              (m.n_layer % (L.pp * L.v) == 0, f"{m.n_layer} layers not divisible by pp*v"),
              (L.batch % (L.dp * L.b) == 0, f"B={L.batch} not divisible by dp*b={L.dp * L.b}"),
              (L.v == 1 or (L.pp > 1 and L.m % L.pp == 0), "interleaving needs pp > 1, pp | m"),
              (not L.sequence_parallel or m.seq_len % L.tp == 0, "sequence parallelism: tp | s")]
    bad = [why for ok, why in checks if not ok]
    total = memory_per_gpu(m, L)["total"] if not bad else 0
    if total > c.gpu_mem_gb * 1e9:
        bad.append(f"needs {total / 1e9:.1f} GB of {c.gpu_mem_gb:g} GB")
    return bad


def rank_layouts(m, n_gpus, batch, c=Cluster(), **options):
    """Every runnable (tp, pp, dp) for n_gpus, best estimated throughput first: [(Layout, est)]."""
    divisors = [k for k in range(1, n_gpus + 1) if n_gpus % k == 0]
    layouts = [Layout(tp, pp, n_gpus // (tp * pp), batch, **options)
               for tp in divisors for pp in divisors if (n_gpus // tp) % pp == 0]
    ranked = [(L, estimate_iteration(m, L, n_gpus, c)) for L in layouts
              if not layout_problems(m, L, n_gpus, c)]
    return sorted(ranked, key=lambda r: -r[1]["tflops"])


def _si(x, unit):
    """1.23e19 FLOP -> '12.3 EFLOP'."""
    prefix, scale = next((p, k) for p, k in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9),
                                             ("M", 1e6), ("", 1)) if x >= k or k == 1)
    return f"{x / scale:.3g} {prefix}{unit}"


def plan_report(name_or_spec, n_gpus, layout=None, batch=None, tokens=300e9, tflops=None,
                c=Cluster(), top=5, **options):
    """The text --plan prints. layout: (tp, pp, dp), or None for the best-ranked; options: Layout's
    b, v, recompute, sequence_parallel, zero1, scatter_gather; batch defaults to Table 1's."""
    m = model_spec(name_or_spec)
    row = paper_row(name_or_spec) if isinstance(name_or_spec, str) else None
    batch = batch or (row and row.batch)
    if not batch:
        raise ValueError("the global batch size B is needed for a model not in Table 1")
    ranked = rank_layouts(m, n_gpus, batch, c, **options)
    if layout is None and not ranked:
        return f"no layout of {n_gpus} GPUs can run {m} with B={batch}"
    L = Layout(*layout, batch, **options) if layout else ranked[0][0]
    P, mem, comm = params_eq2(m), memory_per_gpu(m, L), comm_bytes_per_gpu(m, L)
    est, problems = estimate_iteration(m, L, n_gpus, c), layout_problems(m, L, n_gpus, c)
    gb = lambda x: f"{x / 1e9:9.1f} GB"  # noqa: E731
    out = [f"model: {f'{row.billions}B of Table 1, ' if row else ''}l={m.n_layer} h={m.n_embd} "
           f"a={m.n_head} V={m.vocab_size} s={m.seq_len}; {n_gpus} GPUs of {c.gpu_mem_gb:g} GB, "
           f"{c.gpus_per_node} per node",
           f"parameters: {P / 1e9:,.1f} B (eq. 2); 01's GPT-2 has exactly {params_exact(m):,}",
           f"layout ({'given' if layout else 'best-ranked'}): tp={L.tp} pp={L.pp} dp={L.dp} "
           f"v={L.v} b={L.b} B={batch} -> m={L.m} microbatches per pipeline",
           f"  recompute={L.recompute} sequence_parallel={L.sequence_parallel} zero1={L.zero1} "
           f"scatter_gather={L.scatter_gather}"]
    out += [f"  CANNOT RUN: {'; '.join(problems)}"] if problems else []
    out += ["memory on the fullest GPU (the first stage):",
            f"  parameters  {mem['params'] / 1e9:9.2f} B    l/pp layers + embeddings, / tp",
            f"  weights     {gb(mem['weights'])}   bf16, 2 B/param",
            f"  gradients   {gb(mem['gradients'])}   fp32, 4 B/param",
            f"  optimizer   {gb(mem['optimizer'])}   fp32 master + 2 Adam moments, 12 B/param"
            + (" / dp (ZeRO-1)" if L.zero1 else ""),
            f"  activations {gb(mem['activations'])}   Korthikanti Table 2: "
            f"{activation_bytes_per_layer(m, L) / 1e6:,.1f} MB/layer"
            f" x {layers_in_flight(m, L):g} held",
            f"  total       {gb(mem['total'])}   of {c.gpu_mem_gb:g} GB",
            f"FLOPs per iteration (eq. 3): "
            f"{_si(flops_per_iteration(m, batch, L.recompute), 'FLOP')}",
            f"pipeline bubble (pp-1)/(v m) = {L.pp - 1}/{L.v * L.m} = "
            f"{bubble_fraction(L.pp, L.m, L.v):.1%}",
            "communication sent per GPU per iteration:",
            f"  tp all-reduce {gb(comm['tp'])}   "
            f"{6 if L.recompute else 4} per layer and microbatch",
            f"  pp p2p        {gb(comm['pp'])}   act + grad per microbatch per chunk"
            + (" / tp" if L.scatter_gather or L.sequence_parallel else ""),
            f"  dp gradients  {gb(comm['dp'])}   " + ("reduce-scatter fp32 + all-gather bf16"
                                                    if L.zero1 else "all-reduce fp32"),
            f"estimated iteration: {est['total']:.2f} s = compute {est['compute']:.2f} + bubble "
            f"{est['bubble']:.2f} + tp {est['tp']:.2f} + pp {est['pp']:.2f} + exposed dp "
            f"{est['dp']:.2f} -> {est['tflops']:.0f} TFLOP/s per GPU"]
    rates = [("estimated", est["tflops"]), ("Table 1's", row and row.tflops), ("given", tflops)]
    out.append(f"training time for {tokens / 1e9:g}B tokens (eq. 4): " + ", ".join(
        f"{training_days(tokens, P, n_gpus, x, L.recompute):.1f} days at {how} {x:.0f} TFLOP/s"
        for how, x in rates if x))
    out += [f"best {min(top, len(ranked))} of {len(ranked)} runnable layouts (tp <= "
            f"{c.gpus_per_node}, fitting in memory), by estimated throughput:",
            f"  {THROUGHPUT_MODEL};",
            f"  eff={c.efficiency:g} of {c.peak_tflops:g} TFLOP/s, NVLink {c.nvlink_gbs:g} GB/s "
            f"and InfiniBand {c.ib_gbs:g} GB/s per GPU",
            "     tp    pp    dp      m  bubble       memory   iteration  TFLOP/s"]
    out += [f"  {r.tp:5d} {r.pp:5d} {r.dp:5d} {r.m:6d} {bubble_fraction(r.pp, r.m, r.v):7.1%} "
            f"{gb(memory_per_gpu(m, r)['total'])} {e['total']:9.2f} s {e['tflops']:8.0f}"
            for r, e in ranked[:top]]
    return "\n".join(out)


def add_plan_args(parser):
    """--plan NAME|custom, --gpus N and --plan-* options; model flags the parser has (05's
    --n-layer etc. from GPTConfig) are reused for `custom`, not added twice."""
    g = parser.add_argument_group("planner: --plan prints estimates and exits, allocating nothing")
    g.add_argument("--plan", metavar="NAME", help=f"a model of Table 1 ({', '.join(PAPER_CONFIGS)}, "
                   f"or 1T), or custom (the model flags)")
    g.add_argument("--gpus", type=int, default=None, help="n GPUs (default: Table 1's for the model)")
    for flag in ("--n-layer", "--n-embd", "--n-head", "--vocab-size", "--seq-len"):
        if flag not in parser._option_string_actions:
            g.add_argument(flag, type=int, default=None, help="model size for --plan custom")
    g.add_argument("--plan-layout", metavar="TP,PP,DP", help="estimate this layout (default: the best-ranked)")
    g.add_argument("--plan-batch", type=int, help="global batch B in sequences (default: Table 1's)")
    g.add_argument("--plan-micro-batch", type=int, default=1, help="micro-batch size b")
    g.add_argument("--plan-v", type=int, default=1, help="virtual stages per pipeline rank")
    for name, what in (("recompute", "full activation recomputation"),
                       ("sequence-parallel", "sequence parallelism"),
                       ("zero1", "the ZeRO-1 distributed optimizer"),
                       ("scatter-gather", "scatter/gather of pipeline messages over tp")):
        g.add_argument(f"--plan-{name}", default=name in ("recompute", "scatter-gather"),
                       action=argparse.BooleanOptionalAction, help=f"assume {what}")
    g.add_argument("--plan-tokens", type=float, default=300e9, help="training tokens T for eq. 4")
    g.add_argument("--plan-tflops", type=float, help="also give the training time at this many "
                   "TFLOP/s per GPU")
    g.add_argument("--plan-gpu-mem", type=float, default=80.0, help="GB of memory per GPU")


def plan_from_args(args):
    """plan_report for the options of add_plan_args (custom: seq_len, else block_size)."""
    spec = args.plan
    if spec == "custom":
        spec = ModelSpec(args.n_layer, args.n_embd, args.n_head, args.vocab_size,
                         getattr(args, "seq_len", None) or args.block_size)
    n = args.gpus or (paper_row(spec).n_gpus if isinstance(spec, str) else None)
    if not n:
        raise ValueError("--plan custom needs --gpus")
    layout = tuple(int(k) for k in args.plan_layout.split(",")) if args.plan_layout else None
    return plan_report(spec, n, layout, args.plan_batch, args.plan_tokens, args.plan_tflops,
                       Cluster(gpu_mem_gb=args.plan_gpu_mem), b=args.plan_micro_batch,
                       v=args.plan_v, recompute=args.plan_recompute, zero1=args.plan_zero1,
                       sequence_parallel=args.plan_sequence_parallel,
                       scatter_gather=args.plan_scatter_gather)


# The GPUs whose dense bf16 peak an MFU figure divides by (the trainer shows MFU on these).
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}
