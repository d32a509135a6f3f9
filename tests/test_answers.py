"""docs/ANSWERS.md against docs/GUIDE.md and the code: every question of the guide has an answer,
under its file's heading and number; every answer cites the code by name; and every figure or fact
an answer states is what the code computes today.

The facts are checked as tests/test_docs.py checks the docs' prose (its CLAIMS): each Claim is a
pattern over one answer (whitespace collapsed), whose groups are the figures, and a function that
gets them from the code: a pure function of a numbered file (a schedule's lists, the simulator, the
validator, the rank grid), what a demo prints today (conftest.script_output: the same runs as
test_docs.py's, once per session), or a small run on CPU ranks (launches of one, two and four ranks,
each once per session). Where a question is about a chapter's lesson (the code on its read-first
list), its facts come from the lesson run: 02's, 03's, 05's, 06's and 07's loops on four ranks, watched
from outside (lesson_runs: what each rank ran, in order, and every blocking message call it made; 07's
output layers' collectives), 04's DDP and ZeRO1, 06's SplitLinear; a planted variant of a lesson (a
warm-up, W at once, W replacing the gradient) comes from exercises/checks_0N.py or is wrapped in from
outside, never by editing a chapter. Nothing is copied from an output. A doc that says another figure,
or stops saying it, fails; and every answer must have at least one Claim, so that an answer added
(08's, 09's) comes with its check.

Tolerances: float64 rounding is below 1e-12 for these small models (a mistake is O(1)); where an
answer says two losses differ, they differ by more than 1e-4.
"""
import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from conftest import PIPELINE_CFG, ROOT, load, pipeline_batch, script_output

ANSWERS_MD, GUIDE_MD = (ROOT / "docs" / "ANSWERS.md"), (ROOT / "docs" / "GUIDE.md")
tensor_parallel, pipeline, interleaved = load("01_tensor_parallel"), load("02_pipeline_1f1b"), load("03_interleaved")
data_parallel, gpt3d, zero_bubble, vocab = (load(n) for n in ("04_data_parallel", "05_3d_gpt", "06_zero_bubble",
                                                              "07_vocab_parallel"))
context = load("08_context_parallel")
experts = load("09_expert_parallel")
F64 = torch.float64


# ----------------------------------------------------------------------------------------------
# The two files, read


def sections(path):
    """{chapter "0N": its section}, each from its '## 0N_name.py' heading to the next heading."""
    parts = re.split(r"\n## (0\d)_[a-z0-9_]+\.py\b[^\n]*\n", path.read_text(encoding="utf-8"))
    return {ch: body.split("\n## ")[0] for ch, body in zip(parts[1::2], parts[2::2])}


def numbered(text):
    """{n: the text of item n} of the numbered list in text (items start '1. ' at a line's start)."""
    items = re.split(r"^(\d+)\. ", text, flags=re.M)
    return {int(n): " ".join(body.split()) for n, body in zip(items[1::2], items[2::2])}


def questions():
    """{"0N.k": question k of file 0N's section of GUIDE.md}."""
    out = {}
    for ch, section in sections(GUIDE_MD).items():
        block = re.search(r"\*\*Questions\.\*\*(.*?)(?=\n\*\*[A-Z]|\Z)", section, re.S)
        out.update({f"{ch}.{n}": q for n, q in numbered(block.group(1) if block else "").items()})
    return out


def answers():
    """{"0N.k": answer k of file 0N's section of ANSWERS.md}."""
    return {f"{ch}.{n}": a for ch, section in sections(ANSWERS_MD).items() for n, a in numbered(section).items()}


ANSWERS = answers()


# ----------------------------------------------------------------------------------------------
# What the code says, computed once per session


def demo(*args):
    proc = script_output(*args)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


TP_DEMO, SP_DEMO, DP_DEMO = ("01_tensor_parallel.py",), ("01_tensor_parallel.py", "--sequence-parallel"), \
    ("04_data_parallel.py",)


def collectives(*args):
    """01's list of collectives: (op, operator, layer, direction, shape, KiB) per line."""
    pattern = re.compile(r"^  (all-reduce \(max\)|all-reduce|all-gather|reduce-scatter) +(\S+) +(\S+) "
                         r"(forward|backward) +(\([\d, ]*\)) +([\d.]+) KiB$")
    return [m.groups() for m in map(pattern.match, demo(*args).splitlines()) if m]


def one(values):
    values = set(values)
    assert len(values) == 1, f"not one value: {values}"
    return values.pop()


def demo_loss_all_reduces():
    """01's demo's line on the machine's loss: how many all-reduces, the MAX's numbers and the sum's shape, (2, B T)."""
    line = re.search(r"the machine's loss sends (.*): 3 numbers a token", demo(*TP_DEMO))[1]
    shapes = re.findall(r"(all-reduce(?: \(max\))?) of \(([\d, ]+?),?\)", line)
    (top,), (summed,) = [[shape for o, shape in shapes if o == op] for op in ("all-reduce (max)", "all-reduce")]
    return str(len(shapes)), top, *summed.split(", ")


WORDS = {1: "one", 2: "two", 3: "three"}


@functools.cache
def two_ranks():
    """Facts that need two tp ranks: 01's row-parallel bias added before g, and 05's norm counts over tp
    ranks and stages."""
    from plumbing.launch import launch
    return launch(_two_ranks, 2, timeout_s=20, deadline_s=60)[0]


def _two_ranks(env):
    group, rank = tensor_parallel.new_tp_group(env, 2), env.rank
    out = {}
    # 01.2: RowParallelLinear against the same layer with its bias added on every rank before g.
    gen = torch.Generator().manual_seed(0)
    weight, bias, x = (torch.randn(*shape, generator=gen, dtype=F64) for shape in ((8, 6), (8,), (3, 6)))
    layer = tensor_parallel.RowParallelLinear(6, 8, group, dtype=F64)
    with torch.no_grad():
        layer.weight.copy_(weight.chunk(2, 1)[rank])
        layer.bias.copy_(bias)
    x_i = x.chunk(2, 1)[rank]
    right = layer(x_i)
    wrong = tensor_parallel.all_reduce(F.linear(x_i, layer.weight, layer.bias), group)
    out["bias_offset"] = float(((wrong - right) / bias).mean())
    out["row_parallel_vs_serial"] = float(tensor_parallel.max_rel_diff(right.detach(), F.linear(x, weight, bias)))
    # 05.3: the main job's model cut into 2 stages at tp = 2, on "meta": the elements each rank's norm counts.
    main = gpt3d.TrainConfig()
    model_cfg = tensor_parallel.GPTConfig(**gpt3d.MODEL_DEFAULTS)
    counted = own = 0
    for stage in range(main.pp):
        chunk = pipeline.build_chunks(model_cfg, main.pp, stage, 1, group, device="meta",
                                      vocab_divisible_by=gpt3d.VOCAB_DIVISIBLE_BY)[0]
        for p in chunk.parameters():
            own += p.numel()
            counted += p.numel() * gpt3d.counts_in_norm(p, chunk, group)
    out["norm"] = [int(x) for x in tensor_parallel.all_reduce(torch.tensor([counted, own]), group)]
    # 05.4: 04's replica_loss_weights (ptd_p_step's weights) for the check's counts, over these two ranks as dp.
    counts = [[0, 16, 16], [16, 16, 12]][rank]
    microbatches = [(None, torch.tensor([1] * c + [-100] * (16 - c))) for c in counts]
    weights = data_parallel.replica_loss_weights(microbatches, group)
    n = sum(sum(c) for c in [[0, 16, 16], [16, 16, 12]])
    every = tensor_parallel.all_reduce(torch.zeros(2, 3, dtype=F64).index_copy(0, torch.tensor([rank]),
                                                                                torch.tensor([weights], dtype=F64)), group)
    out["replica_weights"] = dict(by_76=[[round(float(w) * n) for w in row] for row in every], n=n,
                                  own=[1 / (2 * sum(c)) for c in [[0, 16, 16], [16, 16, 12]]])
    return out


@functools.cache
def one_rank():
    """Facts that need a process group of one rank: 02's loss weighting, 04's lesson DDP's bucket launches."""
    from plumbing.launch import launch
    return launch(_one_rank, 1, timeout_s=20, deadline_s=60)[0]


def _one_rank(env):
    import torch.distributed as dist
    out, cfg, m = {}, PIPELINE_CFG, 4
    full = tensor_parallel.init_state_dict(cfg, 5, dtype=F64, random_all=True)
    idx, targets = pipeline_batch(m)  # 5 targets ignored, all in the first microbatch
    micro = pipeline.split_batch(idx, targets, m)
    # 02.3: 02's executor on one stage against the serial model's loss and the mean of the means.
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=F64)
    serial.load_full_state_dict(full)
    schedule = pipeline.Schedule([pipeline.one_f_one_b(1, m, 0)])
    result = pipeline.pipeline_step(cfg, schedule, dist.group.WORLD, None, full, micro)[1]
    whole = serial(idx, targets)[1].detach()
    means = sum(serial(x, y)[1].detach() for x, y in micro) / m
    out["ignored"] = int((targets == -100).sum())
    out["weighted_vs_serial"] = float(tensor_parallel.max_rel_diff(result.loss, whole))
    stage = pipeline.stage_model(cfg, dist.group.WORLD, dtype=F64).load_full_state_dict(full)  # the lesson's
    lesson = pipeline.one_f_one_b_step(stage, micro, dist.group.WORLD).detach()
    out["lesson_vs_serial"] = float(tensor_parallel.max_rel_diff(lesson, whole))
    out["mean_of_means_vs_serial"] = float(abs(means - whole))
    # 04.3: the lesson's DDP, a step of 2 microbatches: its all-reduces launched after each backward and after finish.
    model = tensor_parallel.ParallelGPT(cfg, None, dtype=F64).load_full_state_dict(full)
    ddp = data_parallel.DDP(model.parameters(), dist.group.WORLD, 2000)
    launched = []
    for i, (x, y) in enumerate(micro[:2]):
        ddp.sync = i == 1  # as train_step sets it
        model(x, y)[1].backward()
        launched.append(len(ddp.works))
    ddp.finish()
    launched.append(len(ddp.works))
    out["bucketed"] = dict(launched=launched, buckets=len(ddp.buckets))
    # 04.1: the lesson's DDP at the demo's model and bucket size: the order its buckets' all-reduces launch in,
    # and how many have launched when backward returns.
    args = data_parallel.parser().parse_args([])
    demo_cfg = tensor_parallel.GPTConfig(**{k: getattr(args, k) for k in ("vocab_size", "block_size", "n_layer",
                                                                          "n_head", "n_embd", "dropout")})
    tokens = torch.randint(demo_cfg.vocab_size, (2, args.seq_len))

    def launches(forward_order=False):  # a fresh model each: a DDP's hooks stay on its parameters
        model = tensor_parallel.ParallelGPT(demo_cfg, None, dtype=F64).load_full_state_dict(
            tensor_parallel.init_state_dict(demo_cfg, 5, dtype=F64))
        params = list(model.parameters())[::-1] if forward_order else model.parameters()  # DDP reverses them
        ddp, order, real = data_parallel.DDP(params, dist.group.WORLD, args.bucket_numel), [], dist.all_reduce

        def all_reduce(t, *a, **k):  # which bucket: its first element's place in the flat buffer
            order.append((t.data_ptr() - ddp.grads.data_ptr()) // t.element_size())
            return real(t, *a, **k)
        dist.all_reduce = all_reduce
        try:
            model(tokens, tokens)[1].backward()
            at_return = len(ddp.works)
            ddp.finish()
        finally:
            dist.all_reduce = real
        starts = [lo for lo, _ in ddp.buckets]
        first = next(n for n, p in model.named_parameters() if p is ddp.params[0])
        return dict(order=[starts.index(o) for o in order], n=len(ddp.buckets), at_return=at_return, first=first)
    out["buckets"] = launches()
    # 04.1: the same DDP given the parameters in forward order: its hook still launches each full bucket at once.
    out["forward_buckets"] = launches(forward_order=True)
    return out


@functools.cache
def serial_facts():
    """Facts of the serial model (no process group): 01's loss under a shift, 04's gradient over dp,
    06's backward split against B."""
    cfg, out = PIPELINE_CFG, {}
    gen = torch.Generator().manual_seed(1)
    logits, target = torch.randn(64, cfg.vocab_size, generator=gen, dtype=F64), torch.randint(cfg.vocab_size, (64,),
                                                                                             generator=gen)
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, target, None, cfg.vocab_size)
    shifted = tensor_parallel.vocab_parallel_cross_entropy(logits + 7, target, None, cfg.vocab_size)
    out["shift"] = float(abs(loss - shifted))
    full = tensor_parallel.init_state_dict(cfg, 5, dtype=F64, random_all=True)

    def grads(idx, targets):
        model = tensor_parallel.GPT(cfg, None, init=False, dtype=F64)
        model.load_full_state_dict(full)
        model(idx, targets)[1].backward()
        return {n: p.grad for n, p in model.named_parameters()}

    idx, targets = torch.randint(cfg.vocab_size, (2, 16, 8), generator=gen).unbind(0)
    dp, serial = 4, grads(idx, targets)
    replicas = [grads(*data_parallel.shard_batch(idx, targets, dp, r)) for r in range(dp)]
    summed = {n: sum(g[n] for g in replicas) for n in serial}
    out["dp"] = dp
    out["sum_over_serial"] = one(round(float(summed[n].norm() / serial[n].norm()), 9) for n in serial)
    out["sum_over_dp_vs_serial"] = max(float(tensor_parallel.max_rel_diff(summed[n] / dp, serial[n])) for n in serial)
    # 06.1: the lesson's split (split_linears: I now, weight_grads later) against one B.
    model = tensor_parallel.ParallelGPT(cfg, dtype=F64).load_full_state_dict(full)
    kept = []
    zero_bubble.split_linears(model, kept)
    model(idx, targets)[1].backward()
    linears = [n for n, mod in model.named_modules() if isinstance(mod, (tensor_parallel.ColumnParallelLinear,
                                                                       tensor_parallel.RowParallelLinear))
               and n != "lm_head"]  # the tied output layer's weight is wte's, whose lookup has its gradient
    out["weights_after_I"] = {model.get_submodule(n).weight.grad is None for n in linears}
    zero_bubble.weight_grads(kept)
    out["split_vs_B"] = max(float(tensor_parallel.max_rel_diff(p.grad, serial[n])) for n, p in model.named_parameters())
    return out


def simulated(lists, t_f=1, t_b=2, schedule=pipeline.Schedule):
    return pipeline.simulate(schedule(lists), t_f, t_b)


def one_f_one_b(pp, m):
    return [pipeline.one_f_one_b(pp, m, s) for s in range(pp)]


def verdict(check):
    """'accepts it', or 'finds a deadlock' / 'finds a mismatch': what validate says of a schedule."""
    try:
        check()
    except pipeline.ScheduleError as e:
        return "finds a deadlock" if "deadlock" in str(e) else "finds a mismatch"
    return "accepts it"


def interleaved_with_warmup_factor_1(pp, m, v):
    """03's lists with (pp - r - 1) once in the warm-up, the rest as interleaved() orders it."""
    out = []
    for r in range(pp):
        good = interleaved.interleaved(pp, m, r, v)
        warmup = min(pp - r - 1 + (v - 1) * pp, m * v)
        fs, bs = [a for a in good if a.kind == "F"], [a for a in good if a.kind == "B"]
        acts = fs[:warmup]
        for f, b in zip(fs[warmup:], bs):
            acts += [pipeline.Action("F", f.mb, f.chunk, steady=True), pipeline.Action("B", b.mb, b.chunk, steady=True)]
        out.append(acts + bs[m * v - warmup:])
    return interleaved.InterleavedSchedule(out)


def microbatches_named_at(pp, m, v):
    """The microbatches 03's chunk_and_microbatch names for an m that check_interleaving refuses, beyond m."""
    named = {interleaved.chunk_and_microbatch(k, pp, v, forward)[1] for k in range(m * v) for forward in (True, False)}
    return " and ".join(str(i) for i in sorted(named - set(range(m))))


def refused(fn, *args):
    try:
        fn(*args)
    except ValueError:
        return True
    return False


def bucket_launches(out):
    """The bucketed mode's bucket launch times in 04's demo output, in bucket order, and its count line."""
    block = out.split("=== bucketed ===")[1].split("\n=== ")[0]
    times = [float(t) for t in re.findall(r"^bucket \d+ +\|.*\| launched ([\d.]+)", block, re.M)]
    return times, re.search(r"(\d+) of (\d+) launched before backward finished", block).groups()


def show(xs):
    return "[" + ", ".join(str(x) for x in xs) + "]"


# ----------------------------------------------------------------------------------------------
# The claims


@dataclass
class Claim:
    key: str  # "0N.k": the file and the question
    words: str  # a regular expression over the answer, whitespace collapsed; its groups are the figures
    value: object  # () -> what the code says those groups must be (a string, or a tuple of them)


@functools.cache
def ring_facts():
    """08.1, 08.2, 08.4: the lesson's OneRing on 4 CPU ranks at the demo's sizes (B, T, C, nh), each rank's
    block of one random q, k, v: which blocks block_scores scores in which order, what pass_on carries
    forward and backward, what forward saves, and the output and gradients against torch's causal attention."""
    from plumbing.launch import launch
    return launch(_ring, 4, timeout_s=20, deadline_s=60)


def _ring(env):
    import torch.distributed as dist
    args, cp, r = context.parser().parse_args([]), env.world_size, env.rank
    B, T, nh, hs = args.batch_size, args.seq_len, args.n_head, args.n_embd // args.n_head
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, nh, T, hs, generator=gen, dtype=F64) for _ in range(4))
    c, scored, hops = T // cp, [], []
    mine = [t[:, :, r * c:(r + 1) * c].clone().requires_grad_() for t in (q, k, v)]
    scores, pass_on = context.block_scores, context.pass_on
    context.block_scores = lambda q_, k_, own: scored.append(own) or scores(q_, k_, own)
    context.pass_on = lambda group, *ts: hops.append([t.numel() * t.element_size() for t in ts]) or pass_on(group, *ts)
    try:
        out = context.OneRing.apply(*mine, dist.group.WORLD)
        forward, saved, ahead = len(hops), out.grad_fn.saved_tensors, list(scored)  # forward's, before backward's
        out.backward(do[:, :, r * c:(r + 1) * c])
    finally:
        context.block_scores, context.pass_on = scores, pass_on
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*whole, is_causal=True)
    want.backward(do)
    diff = max([float(tensor_parallel.max_rel_diff(out.detach(), want.detach()[:, :, r * c:(r + 1) * c]))] +
               [float(tensor_parallel.max_rel_diff(m.grad, w.grad[:, :, r * c:(r + 1) * c])) for m, w in zip(mine, whole)])
    return dict(work=sum(Fraction(1, 2) if own else Fraction(1) for own in ahead), own_first=ahead[0],
                scored=len(ahead), forward_hops=forward, forward_bytes=sum(map(sum, hops[:forward])),
                backward_hops=len(hops) - forward, backward_tensors=[len(h) for h in hops[forward:]],
                saved=len(saved), largest_saved=max(t.numel() for t in saved) == mine[0].numel(), diff=diff,
                shape=(B, nh, c, hs))


def contiguous_forward_bytes(shape):
    """08.4: the bytes of the machine's contiguous split at cp = 4, forward, every exchange of one layer."""
    sched = context.contiguous(4)
    return sum(context.message_bytes(kind, shape, False, 8) for s in range(len(sched.steps[0]) + 1)
               for _, _, kind, _ in context.messages(sched, s))


@functools.cache
def ring_step_facts():
    """08.3: the lesson's ring_step at cp = 2 against the serial mean, and exercise 08.2's planted
    ring_step_local_mean and ring_step_grads_averaged (exercises/checks_08.py) beside it. Two CPU ranks."""
    from plumbing.launch import launch
    return launch(_ring_step, 2, timeout_s=20, deadline_s=60)[0]


def _ring_step(env):
    import torch.distributed as dist
    checks = load("exercises.checks_08")
    cfg, group = PIPELINE_CFG, dist.group.WORLD
    full = tensor_parallel.init_state_dict(cfg, 5, dtype=F64, random_all=True)
    idx, targets = pipeline_batch(2)  # 5 targets of the first row ignored: rank 0's block counts fewer
    serial = tensor_parallel.ParallelGPT(cfg, dtype=F64)
    serial.load_full_state_dict(full)
    whole = serial(idx, targets)[1]
    whole.backward()
    out = {}
    for name, step in (("lesson", context.ring_step), ("own_mean", checks._step_local_mean),
                       ("averaged", checks._step_grads_averaged)):
        model = context.ring_gpt(cfg, group, dtype=F64)
        model.load_full_state_dict(full)
        loss = step(model, idx, targets, group)
        ratios = {round(float((p.grad * serial.get_parameter(n).grad).sum() / serial.get_parameter(n).grad.norm() ** 2), 9)
                  for n, p in model.named_parameters()}
        out[name] = dict(loss=float(abs(loss - whole.detach())), value=loss.item(), serial=whole.item(), ratio=one(ratios) if len(ratios) == 1 else None,
                         grads=max(float(tensor_parallel.max_rel_diff(p.grad, serial.get_parameter(n).grad))
                                   for n, p in model.named_parameters()))
    return out


EP_DEMO, EP_CP_DEMO = ("09_expert_parallel.py",), ("09_expert_parallel.py", "--tp", "2", "--cp", "2", "--dp", "1")


def expert_demo(*args):
    """09's demo as it prints: E, ep and the world from its header; layer 0's routing table, each rank's
    pairs sent to each expert and rows received; the auxiliary loss, serial and expert-parallel."""
    out = demo(*args)
    E = int(re.search(r"MoEConfig\(num_experts=(\d+)", out)[1])
    ep, world = (int(x) for x in re.search(r"-> etp=\d+ ep=(\d+) .* world=(\d+) ", out).groups())
    rows = [[int(x) for x in m[1].split()] for m in re.finditer(r"^ +\d+ +((?:\d+ +){%d}\d+)$" % E, out, re.M)]
    aux = re.search(r"auxiliary loss .*: serial ([\d.]+) +expert-parallel ([\d.]+)", out).groups()
    return dict(E=E, ep=ep, world=world, sent=sum(sum(r[:E]) for r in rows), received=sum(r[E] for r in rows),
                ranks=len(rows), aux=aux)


def expert_groups():
    """09.3: 09's fold of the demo's grid (tp 2 x dp 2 -> ep 4), and of 08's at tp 2 x cp 2 -> ep 4."""
    d = experts.DemoConfig()
    plain = experts.fold(gpt3d.rank_grid(d.tp * d.dp, d.tp, d.dp), d.ep)
    folded = experts.fold(context.rank_grid(4, tp=2, cp=2, dp=1), ep=4)
    return d, plain, folded


def split_aux_loss():
    """09.4: `load_balancing_loss` of 4 tokens (E = 2, top-1) over the whole microbatch and over each half,
    the first half all to expert 0 (probabilities 0.75, 0.25), the second all to expert 1."""
    probs = torch.tensor([[0.75, 0.25], [0.75, 0.25], [0.25, 0.75], [0.25, 0.75]], dtype=F64)
    chosen = probs.argmax(-1, keepdim=True)
    whole = float(experts.load_balancing_loss(probs, chosen, None))
    halves = {float(experts.load_balancing_loss(p, c, None)) for p, c in zip(probs.chunk(2), chosen.chunk(2))}
    return f"{whole:.1f}", f"{one(halves):.1f}"


# ----------------------------------------------------------------------------------------------
# The lessons of 02 to 07, run on four CPU ranks and watched from outside (02.1, 02.4, 03.2, 03.4, 04.4,
# 05.2, 05.3, 06.1 to 06.4, 07.2 to 07.4): what each rank ran, in order, and every blocking message call it made


@functools.cache
def lesson_runs():
    """Per rank: 02's gpipe_step and one_f_one_b_step, exercise 02.2's planted warm-ups (exercises/checks_02.py),
    03's interleaved_step (v = 2) and 06's zb_h1_step (with checks_06's W-at-once loop beside it, and with W
    replacing the gradient), at pp = 4, m = 8, each recorded; 04's ZeRO1 at dp = 4; 05's ptd_p_step at tp 2 x
    pp 2 and at pp 2 x dp 2; 07's vocab_1f1b_step at pp 4 x tp 1, m = 8."""
    from plumbing.launch import launch
    return launch(_lessons, 4, timeout_s=30, deadline_s=120)


def _recorded(step, *args, micro, chunks=(), sent=None):
    """step(*args) with 02's lesson pieces, 03's exchange and 06's weight_grads wrapped: (its result, this rank's
    actions [(kind, chunk, mb)]: F, B (06's I) and W, its messages [[(direction, peer stage), ...] per blocking call], its peak count of
    microbatches in flight (chunks, with v > 1)). The tied embedding's sum is run but not recorded; sent:
    a list that gets each tensor sent forward (to stage s + 1)."""
    import torch.distributed as dist
    from exercises.autograder import installed
    real = {n: getattr(pipeline, n) for n in ("forward_step", "backward_step", "recv_from", "send_to", "send_recv",
                                             "sum_tied_grads")}
    real_exchange, actions, messages, outputs, on, flight = interleaved.exchange, [], [], {}, [True], [0, 0]

    def log(*items):
        if on[0] and items:
            messages.append(list(items))

    def forward_step(stage, mb, x, weight, losses):
        out = real["forward_step"](stage, mb, x, weight, losses)
        act = ("F", next((c for c, ch in enumerate(chunks) if ch is stage), 0), next((i for i, b in enumerate(micro) if b is mb), None))
        outputs[id(out[1])], flight[0] = act, flight[0] + 1
        flight[1] = max(flight)
        actions.append(act)
        return out

    def backward_step(x, y, dy):
        actions.append(("B", *outputs[id(y)][1:]))
        flight[0] -= 1
        return real["backward_step"](x, y, dy)

    def here(g):
        return dist.get_rank(g), dist.get_world_size(g)

    def recv_from(src, like, pp_group=None):
        log(*[("recv", src)] * (0 <= src < here(pp_group)[1]))
        return real["recv_from"](src, like, pp_group)

    def send_to(t, dst, pp_group=None):
        if 0 <= dst < here(pp_group)[1]:
            log(("send", dst))
            if sent is not None and dst == here(pp_group)[0] + 1 and on[0]:
                sent.append(t.detach().clone())
        return real["send_to"](t, dst, pp_group)

    def send_recv(t, peer, like, pp_group=None):
        if 0 <= peer < here(pp_group)[1]:
            log(("send", peer), ("recv", peer))
            if sent is not None and peer == here(pp_group)[0] + 1 and on[0]:
                sent.append(t.detach().clone())
        return real["send_recv"](t, peer, like, pp_group)

    def sum_tied_grads(stage, pp_group=None):
        on[0] = False
        try:
            return real["sum_tied_grads"](stage, pp_group)
        finally:
            on[0] = True

    def exchange(sends, receives, box, like):
        log(*[("send", msg[1] % dist.get_world_size()) for msg in sends], *[("recv", p) for p in receives.values()])
        return real_exchange(sends, receives, box, like)

    def weight_grads(kept):  # 06's W: the oldest deferred microbatch's
        actions.append(("W", 0, sum(a[0] == "W" for a in actions)))
        return real_weight_grads(kept)

    real_weight_grads = zero_bubble.weight_grads
    with installed(*[(pipeline, n, f) for n, f in (("forward_step", forward_step), ("backward_step", backward_step),
                                                   ("recv_from", recv_from), ("send_to", send_to),
                                                   ("send_recv", send_recv), ("sum_tied_grads", sum_tied_grads))],
                   (interleaved, "exchange", exchange), (zero_bubble, "weight_grads", weight_grads)):
        result = step(*args)
    return result, actions, messages, flight[1]


def _against_serial(stages, loss, serial, whole):
    """The largest relative difference of the loss (where this rank has it) and every gradient from serial's."""
    diffs = [float(tensor_parallel.max_rel_diff(p.grad, serial.get_parameter(n).grad))
             for st in stages for n, p in st.named_parameters()]
    return max(diffs + ([float(tensor_parallel.max_rel_diff(loss.detach(), whole))] if loss is not None else []))


def _lessons(env):
    import torch.distributed as dist
    checks = load("exercises.checks_02")
    world, rank, m, out = dist.group.WORLD, env.rank, 8, {}
    idx, targets = pipeline_batch(m)
    micro = list(zip(idx.chunk(m), targets.chunk(m)))
    for name, cfg in (("4", PIPELINE_CFG), ("8", dataclasses.replace(PIPELINE_CFG, n_layer=8))):
        full = tensor_parallel.init_state_dict(cfg, 5, dtype=F64, random_all=True)
        serial = tensor_parallel.ParallelGPT(cfg, dtype=F64).load_full_state_dict(full)
        whole = serial(idx, targets)[1]
        whole.backward()
        steps = {"gpipe": pipeline.gpipe_step, "1f1b": pipeline.one_f_one_b_step, "zb-h1": zero_bubble.zb_h1_step,
                 "short": checks._one_f_one_b_planted(lambda pp, s: pp - s - 2),
                 "long": checks._one_f_one_b_planted(lambda pp, s: pp - s)} if name == "4" else {}
        if name == "4":  # 06.3: each W run at once after its I, before the next (checks_06's planted loop)
            steps["zb-now"] = load("exercises.checks_06")._ws_not_deferred
        for key, step in steps.items():
            stage = pipeline.stage_model(cfg, world, dtype=F64).load_full_state_dict(full)
            loss, actions, messages, peak = _recorded(step, stage, micro, micro=micro)
            out[key] = dict(actions=actions, messages=messages, peak=peak,
                            diff=_against_serial([stage], loss, serial, whole.detach()))
        if name == "4":  # 06.4: zb_h1_step with W setting the weight's gradient to its dW instead of adding it
            out["zb-replaced"] = _w_replaced(cfg, full, micro, serial, whole.detach())
        if name == "8":
            chunks = [c.load_full_state_dict(full) for c in interleaved.chunk_models(cfg, 2, dtype=F64)]
            loss, actions, messages, peak = _recorded(interleaved.interleaved_step, chunks, micro, micro=micro,
                                                      chunks=chunks)
            out["interleaved"] = dict(actions=actions, messages=messages, peak=peak,
                                      diff=_against_serial(chunks, loss, serial, whole.detach()))
    # 04.4: ZeRO1 at dp = 4, against plain AdamW's state; every replica's weights after the step.
    cfg, dp = PIPELINE_CFG, 4
    full = tensor_parallel.init_state_dict(cfg, 5, dtype=F64, random_all=True)
    model = tensor_parallel.ParallelGPT(cfg, dtype=F64).load_full_state_dict(full)
    ddp = data_parallel.DDP(model.parameters(), world, 2000)
    opt = data_parallel.ZeRO1(ddp, lr=1e-3, weight_decay=0.1)
    rows = data_parallel.shard_batch(idx, targets, dp, rank)
    data_parallel.train_step(model, ddp, opt, list(zip(*(t.chunk(2) for t in rows))), world)
    plain = tensor_parallel.ParallelGPT(cfg, dtype=F64).load_full_state_dict(full)
    plain(*rows)[1].backward()
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1)
    adamw.step()

    def state_bytes(o):
        return sum(t.numel() * t.element_size() for s in o.state.values() for t in s.values() if t.dim())
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(weights) for _ in range(dp)]
    dist.all_gather(every, weights)
    out["zero1"] = dict(fraction=state_bytes(opt.adamw) / state_bytes(adamw),
                        same=all(torch.equal(w, every[0]) for w in every))
    # 05.2 and 05.3: ptd_p_step at tp 2 x pp 2 (dp 1), then at pp 2 x dp 2 (tp 1), on the check's kind of model.
    cfg = tensor_parallel.GPTConfig(vocab_size=97, block_size=8, n_layer=4, n_head=4, n_embd=16)
    full = tensor_parallel.init_state_dict(cfg, 5, dtype=F64, random_all=True)
    gen = torch.Generator().manual_seed(2)
    idx, targets = torch.randint(cfg.vocab_size, (2, 12, 8), generator=gen)
    for key, (tp, dp, pp) in (("tp2pp2", (2, 1, 2)), ("pp2dp2", (1, 2, 2))):
        groups = gpt3d.new_groups(env, gpt3d.rank_grid(4, tp, dp, pp))
        stage = pipeline.stage_model(cfg, groups.pp, group=groups.tp, dtype=F64).load_full_state_dict(full)
        sent = []
        _recorded(gpt3d.ptd_p_step, stage, gpt3d.adamw(stage.parameters()), idx, targets, groups, 3, micro=[None],
                  sent=sent)

        def same_over(group, t):
            got = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(got, t.contiguous(), group=group)
            return all(torch.equal(g, got[0]) for g in got)
        grads = {n: same_over(groups.tp if tp > 1 else groups.dp, p.grad) for n, p in stage.named_parameters()}
        out[key] = dict(names=set(grads), equal={n for n, same in grads.items() if same}, split={n for n, p in stage.named_parameters()
                                                                             if hasattr(p, "tp_dim")},
                        sent=[tuple(t.shape) for t in sent], tied=hasattr(stage, "lm_head") and not stage.pre_process,
                        sent_same=same_over(groups.tp, torch.stack(sent)) if sent and tp > 1 else None,
                        rows=idx.shape[0] // dp // 3)
        if key == "tp2pp2":  # the main job's model, cut as ptd_p_step cuts it, on "meta": the elements each rank holds
            main = pipeline.stage_model(tensor_parallel.GPTConfig(**gpt3d.MODEL_DEFAULTS), groups.pp, group=groups.tp,
                                        device="meta", vocab_divisible_by=gpt3d.VOCAB_DIVISIBLE_BY)
            held = torch.tensor([sum(p.numel() for p in main.parameters())])
            dist.all_reduce(held)
            out[key]["held"] = int(held)
    out.update(_vocab_lessons(env))
    return out


def _w_replaced(cfg, full, micro, serial, whole):
    """06.4: zb_h1_step run with 06's weight_grads wrapped from outside to set each weight's gradient to its dW
    (checks_06's planted `_w_replaces`): {parameter: (its difference from serial's, from the last microbatch's own
    loss-weighted gradient)}, and which parameters are the linear layers' weights (the tied output layer's aside)."""
    import torch.distributed as dist
    from exercises.autograder import installed
    stage = pipeline.stage_model(cfg, dist.group.WORLD, dtype=F64).load_full_state_dict(full)
    with installed((zero_bubble, "weight_grads", load("exercises.checks_06")._w_replaces)):
        zero_bubble.zb_h1_step(stage, micro)
    last = tensor_parallel.ParallelGPT(cfg, dtype=F64).load_full_state_dict(full)
    (last(*micro[-1])[1] * pipeline.loss_weights(micro)[-1]).backward()
    linear = {f"{n}.weight" for n, mod in stage.named_modules() if n != "lm_head" and isinstance(
        mod, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear))}
    diffs = {n: (float(tensor_parallel.max_rel_diff(p.grad, serial.get_parameter(n).grad)),
                 float(tensor_parallel.max_rel_diff(p.grad, last.get_parameter(n).grad)))
             for n, p in stage.named_parameters()}
    return dict(diffs=diffs, linear=linear)


def _vocab_lessons(env):
    """07's vocab_1f1b_step at pp = 4 x tp = 1 (the vocabulary over the four ranks), m = 8, on unequal_batch's
    microbatches (microbatch 0 counts no target), then on a batch that counts none, watched from outside:
    02's forward_step and backward_step, 07's output_layer, output_s_pass and output_t_pass, and inside an
    output layer every collective (01's all_reduce, dist.broadcast), each recorded in order."""
    import torch.distributed as dist
    from conftest import unequal_batch
    from exercises.autograder import installed
    cfg, m, out = PIPELINE_CFG, 8, {}
    groups = gpt3d.new_groups(env, {**gpt3d.rank_grid(4, 1, 1, 4), "vocab": [list(range(4))]})
    full = tensor_parallel.init_state_dict(cfg, 5, dtype=F64, random_all=True)
    idx, targets = unequal_batch(cfg, m)
    for key, batch in (("vocab", targets), ("vocab-none", torch.full_like(targets, -100))):
        micro = list(zip(idx.chunk(m), batch.chunk(m)))
        serial = tensor_parallel.GPT(cfg, None, init=False, dtype=F64).load_full_state_dict(full)
        whole = serial(idx, batch)[1]
        whole.backward()
        logits = serial(*micro[0])[0].detach()
        means = [float(F.cross_entropy(logits.flatten(0, 1), micro[0][1].flatten()))]  # microbatch 0's own mean
        stage = vocab.vocab_stage(cfg, groups, dtype=F64)
        stage.transformer.wte.weight.split_group = groups.vocab
        stage.load_full_state_dict(full)
        real = dict(forward_step=pipeline.forward_step, backward_step=pipeline.backward_step,
                    output_layer=vocab.output_layer, output_s_pass=vocab.output_s_pass,
                    output_t_pass=vocab.output_t_pass, all_reduce=tensor_parallel.all_reduce, broadcast=dist.broadcast)
        events, losses, inside = [], [], [False]

        def forward_step(stage_, mb, *rest):
            events.append(("F", next(i for i, b in enumerate(micro) if b is mb)))
            return real["forward_step"](stage_, mb, *rest)

        def backward_step(*args):
            events.append(("B", sum(e[0] == "B" for e in events)))  # 1F1B's: the oldest in flight
            return real["backward_step"](*args)

        def output_layer(*args):
            inside[0] = True
            try:
                loss, grad = real["output_layer"](*args)
            finally:
                inside[0] = False
            losses.append(float(loss))
            return loss, grad

        def output_s_pass(*args):
            events.append(("S", sum(e[0] == "S" for e in events)))
            return real["output_s_pass"](*args)

        def output_t_pass(*args):
            events.append(("T", sum(e[0] == "T" for e in events)))
            return real["output_t_pass"](*args)

        def all_reduce(x, group, op=dist.ReduceOp.SUM):
            if inside[0]:
                events.append(("all-reduce", "MAX" if op == dist.ReduceOp.MAX else "SUM", tuple(x.shape)))
            return real["all_reduce"](x, group, op)

        def broadcast(t, *args, **kwargs):
            if inside[0]:
                events.append(("broadcast", "", tuple(t.shape)))
            return real["broadcast"](t, *args, **kwargs)

        with installed((pipeline, "forward_step", forward_step), (pipeline, "backward_step", backward_step),
                       (vocab, "output_layer", output_layer), (vocab, "output_s_pass", output_s_pass),
                       (vocab, "output_t_pass", output_t_pass), (tensor_parallel, "all_reduce", all_reduce),
                       (dist, "broadcast", broadcast)):
            loss = vocab.vocab_1f1b_step(stage, micro, groups)
        grads = stage.full_grads()
        ref = {n: p.grad for n, p in serial.named_parameters()}
        out[key] = dict(events=events, losses=losses, loss=None if loss is None else float(loss),
                        serial=float(whole), means=means, counts=[int((t != -100).sum()) for _, t in micro],
                        diff=max([float(tensor_parallel.max_rel_diff(g, ref[n])) for n, g in grads.items()]
                                 + ([float(tensor_parallel.max_rel_diff(loss.detach(), whole.detach()))]
                                    if loss is not None else [])),
                        zero=all(float(g.abs().max()) == 0 for g in grads.values()))
    return out


def serial_parameters():
    """The main job's serial model's parameters (05.3)."""
    return sum(p.numel() for p in tensor_parallel.ParallelGPT(tensor_parallel.GPTConfig(**gpt3d.MODEL_DEFAULTS),
                                                              device="meta").parameters())


def lesson(key):
    """lesson_runs()'s record of lesson `key`, one entry per rank."""
    return [r[key] for r in lesson_runs()]


def lesson_lists(key):
    """The actions each rank of lesson `key` ran, in order, as 02's Actions: what 02's simulator replays."""
    return [[pipeline.Action(kind, mb, chunk) for kind, chunk, mb in r["actions"]] for r in lesson(key)]


def lesson_sends(key):
    """The messages lesson `key` sent, every rank's, the tied embedding's sum left out."""
    return sum(item[0] == "send" for r in lesson(key) for call in r["messages"] for item in call)


def rendezvous(key, split=False):
    """Lesson `key`'s blocking message calls, as each rank made them, replayed with every send waiting for its
    receive (as a large NCCL send does): None if every rank gets through, else the pairs of ranks that each wait
    to send to the other. split: each batch (send_recv's, exchange's) made as its sends, then its receives."""
    calls = []
    for r in lesson(key):
        mine = []
        for call in r["messages"]:
            parts = [[i for i in call if i[0] == "send"], [i for i in call if i[0] == "recv"]] if split else [list(call)]
            mine += [list(part) for part in parts if part]
        calls.append(mine)
    at = [0] * len(calls)
    now = lambda q: calls[q][at[q]] if at[q] < len(calls[q]) else []  # noqa: E731
    while any(a < len(c) for a, c in zip(at, calls)):
        progress = False
        for r in range(len(calls)):
            for item in [i for i in now(r) if i[0] == "send"]:
                if ("recv", r) in now(item[1]):
                    now(r).remove(item)
                    now(item[1]).remove(("recv", r))
                    progress = True
            if at[r] < len(calls[r]) and not now(r):
                at[r], progress = at[r] + 1, True
        if not progress:
            return sorted({(r, q) for r in range(len(calls)) for d, q in now(r) if d == "send" and r < q
                           and ("send", r) in now(q)})
    return None


def held(key):
    """Per rank of lesson `key` (06's loops): ([(microbatches in flight, Ws waiting) as each forward runs], the peak of
    in flight + waiting / 2 in M_B (M_W = M_B / 2), the most Ws waiting at any point), from its recorded F, I, W."""
    out = []
    for r in lesson(key):
        flight = waiting = most = 0
        at, peak = [], Fraction(0)
        for kind, _, _ in r["actions"]:
            flight += {"F": 1, "B": -1}.get(kind, 0)
            waiting += {"B": 1, "W": -1}.get(kind, 0)
            most, peak = max(most, waiting), max(peak, flight + Fraction(waiting, 2))
            at += [(flight, waiting)] * (kind == "F")
        out.append((at, peak, most))
    return out


def replayed(key):
    """The order lesson `key` ran (06's loops with I and W, or 02's 1F1B), replayed in 06's simulate."""
    lists = [[pipeline.Action("I" if k == "B" and key != "1f1b" else k, mb, chunk) for k, chunk, mb in r["actions"]]
             for r in lesson(key)]
    pipe = gpt3d.PipelineSchedule(lists) if key == "1f1b" else zero_bubble.ZeroBubbleSchedule(lists, times={"I": 1, "W": 1})
    return zero_bubble.simulate(pipe)[0]


def output_layers():
    """07's lesson: (the one sequence every output layer on every rank made: (kind, op, shape) or (S,) / (T,) marks,
    [how many output layers each rank ran])."""
    seqs, counts = set(), []
    for r in lesson("vocab"):
        calls = []
        for e in r["events"]:
            if e[0] == "broadcast":
                calls.append([])
            if e[0] not in ("F", "B"):
                calls[-1].append(e if len(e) == 3 else e[:1])
        seqs |= {tuple(c) for c in calls}
        counts.append(len(calls))
    return one(seqs), counts


def fbst(r):
    """07's lesson: this rank's F, B, S and T, in order, each with its microbatch."""
    return [e for e in r["events"] if e[0] in "FBST" and len(e) == 2]


def in_flight(events):
    """The most microbatches in flight (forwards not yet backward) in an F/B/S/T record."""
    live = peak = 0
    for kind, _ in events:
        live += {"F": 1, "B": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak


def before_first_backward(key):
    """[how many forwards each rank of lesson `key` ran before its first backward]."""
    return [next(i for i, a in enumerate(r["actions"]) if a[0] == "B") for r in lesson(key)]


TP, SP = TP_DEMO, SP_DEMO
CLAIMS = [
    # 01
    Claim("01.1", r"In the demo its (\d+) f's are all in (\w+) and its (\d+) g's \(the loss's among them\) all in (\w+)\.",
          lambda: (str(sum(r[1] == "f" for r in collectives(*TP))), one(r[3] for r in collectives(*TP) if r[1] == "f"),
                   str(sum(r[1] == "g" for r in collectives(*TP))), one(r[3] for r in collectives(*TP) if r[1] == "g"))),
    Claim("01.2", r"off by \(tp - 1\) b: at tp = (\d), (\w+) b too many",
          lambda: ("2", WORDS[round(two_ranks()["bias_offset"])] if two_ranks()["row_parallel_vs_serial"] < 1e-12
                   else "the layer is not serial's")),
    Claim("01.3", r"the demo's `layer 0: (\d+) forward and (\d+) backward collectives`",
          lambda: re.search(r"layer 0: (\d+) forward and (\d+) backward", demo(*TP)).groups()),
    Claim("01.3", r"layer 0 makes (\d+) all-gathers and (\d+) reduce-scatters in forward, and `layer 0: (\d+) forward "
                  r"and (\d+) backward collectives` in all, the (\d+) others the small all-reduces of `sp_param`",
          lambda: (*(str(sum(r[0] == op and r[2].startswith("transformer.h.0.") and r[3] == "forward"
                             for r in collectives(*SP))) for op in ("all-gather", "reduce-scatter")),
                   *re.search(r"layer 0: (\d+) forward and (\d+) backward", demo(*SP)).groups(),
                   str(sum(r[0] == "all-reduce" and r[2].startswith("transformer.h.0.") for r in collectives(*SP))))),
    Claim("01.3", r"its total grows from ([\d.]+) KiB to ([\d.]+) KiB",
          lambda: (re.search(r"in all, ([\d.]+) KiB", demo(*TP))[1], re.search(r"in all, ([\d.]+) KiB", demo(*SP))[1])),
    Claim("01.4", r"makes the machine's (\d+) loss all-reduces: a MAX of (\d+) numbers, one per token \(B T\), then a "
                  r"sum of \((\d+), (\d+)\)", lambda: demo_loss_all_reduces()),
    Claim("01.4", r"gives the (same) loss for logits \+ 7", lambda: "same" if serial_facts()["shift"] < 1e-12 else "another"),
    # 02
    Claim("02.1", r"run at pp = (\d), m = (\d) and watched from outside, its stages run (\[[\d, ]+\]) forwards before "
                  r"their first backward",
          lambda: ("4", "8", str(before_first_backward("1f1b")))),
    Claim("02.1", r"The machine's lists, `one_f_one_b`, hold the (same) order as the lesson runs",
          lambda: "same" if lesson_lists("1f1b") == one_f_one_b(4, 8) else "another"),
    Claim("02.1", r"clamped at 0.*?\), runs (\[[\d, ]+\]) forwards before the first backward\. .* replayed in 02's simulator \(t_b = 2 t_f\), has a bubble "
                  r"of (\S+) instead of (\S+)\. Every message still meets its partner, so the loss and every gradient "
                  r"are still serial's to (float64 rounding)",
          lambda: (str(before_first_backward("short")), str(simulated(lesson_lists("short")).bubble),
                   str(simulated(lesson_lists("1f1b")).bubble),
                   "float64 rounding" if max(r["diff"] for r in lesson("short")) < 1e-12 and rendezvous("short") is None
                   else "not")),
    Claim("02.1", r"One forward longer \(`warmup_too_long`, pp - s\): (\[[\d, ]+\]) microbatches in flight instead of "
                  r"(\[[\d, ]+\]), .* the bubble still (\S+) and the gradients (still serial's)",
          lambda: (str([r["peak"] for r in lesson("long")]), str([r["peak"] for r in lesson("1f1b")]),
                   str(simulated(lesson_lists("long")).bubble),
                   "still serial's" if max(r["diff"] for r in lesson("long")) < 1e-12 else "not serial's")),
    Claim("02.2", r"run at pp = 4, m = 8 and watched from outside, `gpipe_step`'s stages hold at most (\[[\d, ]+\]) "
                  r"microbatches in flight against `one_f_one_b_step`'s (\[[\d, ]+\]) \(as 02's simulator finds on the "
                  r"machine's lists\)",
          lambda: (str([r["peak"] for r in lesson("gpipe")]), str([r["peak"] for r in lesson("1f1b")]))
          if [[r["peak"] for r in lesson(k)] for k in ("gpipe", "1f1b")] == [
              simulated(lists).peak_in_flight for lists in ([pipeline.gpipe(4, 8, s) for s in range(4)], one_f_one_b(4, 8))]
          else ("the lists", "differ")),
    Claim("02.2", r"the first stage's activation bytes at (half) GPipe's",
          lambda: (lambda b: "half" if b[0][0] == 2 * b[1][0] else "not half")(
              [[int(x) for x in row.split(",")] for row in re.findall(r"outputs deallocated: \[([\d, ]+)\]",
                                                                      demo("02_pipeline_1f1b.py"))])),
    Claim("02.3", r"With (\d+) targets ignored in the first of (\d+) microbatches, 02's lesson and its executor give the "
                  r"serial model's loss to (float64 rounding), and the mean of means differs from it by (more than 1e-4)",
          lambda: (str(one_rank()["ignored"]), "4",
                   "float64 rounding" if max(one_rank()["weighted_vs_serial"], one_rank()["lesson_vs_serial"]) < 1e-12
                   else "more than rounding",
                   "more than 1e-4" if one_rank()["mean_of_means_vs_serial"] > 1e-4 else "less")),
    Claim("02.4", r"as written, every rank (gets through); with each `send_recv` made as its send, then its receive, "
                  r"stages (\d) and (\d) each wait to send to the other, a deadlock",
          lambda: ("gets through" if rendezvous("1f1b") is None else "deadlocks",
                   *(str(x) for x in one(map(tuple, rendezvous("1f1b", split=True)))))),
    Claim("02.4", r"`gpipe_step`, replayed the same way, (gets through)",
          lambda: "gets through" if rendezvous("gpipe", split=True) is None else "deadlocks"),
    # 03
    Claim("03.1", r"^\*\*Layers (\d+)-(\d+) and (\d+)-(\d+)\.\*\*",
          lambda: tuple(str(x) for c in interleaved.chunk_layers(16, 4, 2, 0) for x in (c.start + 1, c.stop))),
    Claim("03.1", r"rank 3 holds layers (\d+)-(\d+) and (\d+)-(\d+)",
          lambda: tuple(str(x) for c in interleaved.chunk_layers(16, 4, 2, 3) for x in (c.start + 1, c.stop))),
    Claim("03.2", r"`interleaved_step`'s `exchange` calls send (\d+) messages against `one_f_one_b_step`'s (\d+), "
                  r"([\d.]+) times as many",
          lambda: (str(lesson_sends("interleaved")), str(lesson_sends("1f1b")),
                   f"{lesson_sends('interleaved') / lesson_sends('1f1b'):.2f}")),
    Claim("03.2", r"rank 0 holds \(v \+ 1\) pp - 1 = (\d+) chunks of half a stage in flight at its peak, against "
                  r"1F1B's (\d+) whole stages, ([\d.]+) times the activations: its warm-up of 2 \(pp - 1\) \+ \(v - 1\) "
                  r"pp = (\d+) forwards, then the first steady forward\. Both give (serial's) loss and gradients",
          lambda: (lambda il, o: (str(il), str(o), f"{il / (2 * o):.3f}", str(before_first_backward("interleaved")[0] - 1),
                                  "serial's" if max(r["diff"] for k in ("interleaved", "1f1b") for r in lesson(k)) < 1e-12
                                  else "not serial's"))(
              lesson("interleaved")[0]["peak"], lesson("1f1b")[0]["peak"])),
    Claim("03.3", r"With m = (\d) and pp = (\d) the second group would be short, and `chunk_and_microbatch` would "
                  r"name\s+microbatches (\d+ and \d+), which do not exist; `check_interleaving` (refuses) such an m",
          lambda: ("6", "4", microbatches_named_at(4, 6, 2),
                   "refuses" if refused(interleaved.check_interleaving, 4, 6, 2) else "accepts")),
    Claim("03.3", r"at m = (\d), v = (\d) its forwards (\d+) to (\d+) are microbatches (\d) to (\d) on chunk (\d)",
          lambda: (lambda named: ("6", "2", "8", "11", str(named[0][1]), str(named[-1][1]), one(str(c) for c, _ in named)))(
              [interleaved.chunk_and_microbatch(k, 4, 2) for k in range(4 * 2, 6 * 2)])),
    Claim("03.4", r"Run at pp = 4, v = 2, m = 8, `interleaved_step`'s warm-ups are (\[[\d, ]+\]) forwards; the machine's "
                  r"lists \(`interleaved`\) with a factor of 1, read by `validate`: it (finds a deadlock)",
          lambda: (str([n - 1 for n in before_first_backward("interleaved")]),  # the steady step's F comes before its B
                   verdict(lambda: pipeline.validate(interleaved_with_warmup_factor_1(4, 8, 2), 8)))),
    # 04
    Claim("04.1", r"Run at the demo's model and bucket size, `DDP.hook` launches the (\d+) buckets (in order), bucket 0 "
                  r"first, all of them before backward returns \(the demo's chart draws the machine's launches, in the "
                  r"(same) order\)",
          lambda: (lambda b, times, counts: (str(b["n"]), "in order" if b["order"] == list(range(b["n"])) and
                                             b["at_return"] == b["n"] else "out of order",
                                             "same" if times == sorted(times) and counts == (str(b["n"]),) * 2
                                             else "another"))(one_rank()["buckets"], *bucket_launches(demo(*DP_DEMO)))),
    Claim("04.1", r"given the parameters in forward order, it launches them in the order (\[[\d, ]+\]), still during "
                  r"backward\. .* bucket 0, the (embeddings)', would be ready last",
          lambda: (lambda f: (show(f["order"]) if f["at_return"] == f["n"] else "not during backward",
                              "embeddings" if f["first"] in ("transformer.wte.weight", "transformer.wpe.weight")
                              else f["first"]))(one_rank()["forward_buckets"])),
    Claim("04.2", r"with dp = (\d) the sum of the replicas' gradients is (\d) times the serial gradient, and the sum "
                  r"divided by dp (equals) it",
          lambda: (str(serial_facts()["dp"]), f"{serial_facts()['sum_over_serial']:g}",
                   "equals" if serial_facts()["sum_over_dp_vs_serial"] < 1e-12 else "differs from")),
    Claim("04.3", r"in a step of (\d) microbatches each bucket launches (once)",
          lambda: (lambda b: ("2", "once" if b["launched"] == [0, b["buckets"], b["buckets"]] and b["buckets"] > 1
                              else "not once"))(one_rank()["bucketed"])),
    Claim("04.4", r"after one `train_step` at dp = (\d) every replica's weights are the (same), bit for bit",
          lambda: (str(len(lesson("zero1"))), "same" if all(r["same"] for r in lesson("zero1")) else "different")),
    Claim("04.4", r"([\d.]+) of plain AdamW's state at dp = (\d), measured on the two optimizers' state",
          lambda: (f"{one(round(r['fraction'], 3) for r in lesson('zero1')):.3f}", str(len(lesson("zero1"))))),
    # 05
    Claim("05.1", r"^\*\*tp (\[[\d, ]+\]), dp (\[[\d, ]+\]), pp (\[[\d, ]+\])\.\*\*",
          lambda: tuple(str(next(g for g in gpt3d.rank_grid(8, 2, 2, 2)[k] if 3 in g)) for k in ("tp", "dp", "pp"))),
    Claim("05.1", r"rank 3 is t = (\d), d = (\d), p = (\d)",
          lambda: next((str(t), str(d), str(p)) for p in range(2) for d in range(2) for t in range(2)
                       if gpt3d.rank_grid(8, 2, 2, 2)["tp"][p * 2 + d][t] == 3)),
    Claim("05.2", r"run at tp = 2 x pp = 2, the two tp ranks of stage 0 send (equal) tensors, each the (whole) \(b, T, C\)",
          lambda: ("equal" if [r["sent_same"] for r in lesson("tp2pp2")[:2]] == [True, True] else "different",
                   "whole" if {s for r in lesson("tp2pp2")[:2] for s in r["sent"]} == {
                       (lesson("tp2pp2")[0]["rows"], 8, 16)} else "a part of")),
    Claim("05.2", r"sends it whole from each: in the main job, b T C = ([\d,]+) elements from each tp rank",
          lambda: next(c for c in CLAIMS if c.words.startswith("The main job's messages")).value()[0]),
    Claim("05.2", r"The main job's messages are b T C = ([\d,]+) elements, each tp rank sending all ([\d,]+) in the lesson; "
                  r"scatter/gather sends ([\d,]+) from each",
          lambda: (lambda tc, C: (f"{tc.batch_size // (tc.dp * tc.microbatches) * tc.seq_len * C:,}",
                                  f"{tc.batch_size // (tc.dp * tc.microbatches) * tc.seq_len * C:,}",
                                  f"{tc.batch_size // (tc.dp * tc.microbatches) * tc.seq_len * C // tc.tp:,}"))(
              gpt3d.TrainConfig(), gpt3d.MODEL_DEFAULTS["n_embd"])),
    Claim("05.3", r"run at tp = 2 x pp = 2, `ptd_p_step` leaves (exactly those) gradients equal on both tp ranks, and "
                  r"(every split one) different",
          lambda: ("exactly those" if all(r["equal"] == r["names"] - r["split"] for r in lesson("tp2pp2")) else "other",
                   "every split one" if all(r["split"] and not r["equal"] & r["split"] for r in lesson("tp2pp2"))
                   else "not every split one")),
    Claim("05.3", r"at pp = 2 x dp = 2, (all of them) equal",
          lambda: "all of them" if all(r["equal"] == r["names"] for r in lesson("pp2dp2")) else "not all of them"),
    Claim("05.3", r"the ranks of one replica hold ([\d,]+) elements against the serial model's ([\d,]+),",
          lambda: (f"{one(r['held'] for r in lesson('tp2pp2')):,}", f"{serial_parameters():,}")),
    Claim("05.3", r"and the tied copy not at all: ([\d,]+) elements over both tp ranks and both stages, each once",
          lambda: f"{two_ranks()['norm'][0]:,}" if two_ranks()["norm"][0] == serial_parameters() else "not serial's"),
    Claim("05.4", r"^\*\*0, 32/76, 32/76 on replica 0 and 32/76, 32/76, 24/76 on replica 1; 1/(\d+) and 1/(\d+) instead of"
                  r" 1/(\d+)\.\*\*",
          lambda: (lambda w: (str(round(1 / w["own"][0])), str(round(1 / w["own"][1])), str(w["n"])) if w["by_76"] == [
              [0, 32, 32], [32, 32, 24]] else ("weights", str(w["by_76"]), "differ"))(two_ranks()["replica_weights"])),
    # 06
    Claim("06.1", r"`zb_h1_step` sends (\d+) messages, as many as `one_f_one_b_step`'s (\d+), and gives (serial's) loss",
          lambda: (str(lesson_sends("zb-h1")), str(lesson_sends("1f1b")),
                   "serial's" if max(r["diff"] for r in lesson("zb-h1")) < 1e-12 else "not serial's")),
    Claim("06.1", r"Split so, one backward's gradients (equal) B's to float64 rounding",
          lambda: "equal" if serial_facts()["split_vs_B"] < 1e-12 and serial_facts()["weights_after_I"] == {True}
          else "differ from"),
    Claim("06.2", r"the ranks hold at most (\[[\d, ]+\]) microbatches in flight and (\[[\d, ]+\]) Ws waiting while they "
                  r"run a forward \((\[[\d, ]+\]) just after an I",
          lambda: tuple(show(x) for x in zip(*[(max(f for f, _ in at), max(w for _, w in at), max_waiting)
                                                for at, _, max_waiting in held("zb-h1")]))),
    Claim("06.2", r"With M_W = M_B / 2 the peaks of that record are (\[[\d/, ]+\]) M_B, against `one_f_one_b_step`'s "
                  r"(\[[\d, ]+\]): rank s holds s M_W more, and rank 0, which defers nothing, sets the peak, 1F1B's "
                  r"(pp M_B)",
          lambda: (lambda zb_peaks, one_peaks: (show(zb_peaks), show(one_peaks),
                                                "pp M_B" if max(zb_peaks) == zb_peaks[0] == one_peaks[0] == 4
                                                else "more"))(
              [peak for _, peak, _ in held("zb-h1")], [r["peak"] for r in lesson("1f1b")])),
    Claim("06.2", r"\(The machine's `zb_h1` lists the (same) order\.\)",
          lambda: "same" if [[("I" if k == "B" else k, mb) for k, _, mb in r["actions"]] for r in lesson("zb-h1")] == [
              [(a.kind, a.mb) for a in zero_bubble.zb_h1(4, 8, r)] for r in range(4)] else "another"),
    Claim("06.3", r"each rank idles (\d+) in `one_f_one_b_step`'s, (\d+) with each W run at once after its I and (\d+) in "
                  r"`zb_h1_step`'s; the bubble (\S+), (\S+) and (\S+)\.",
          lambda: (*(str(one(replayed(k).idle)) for k in ("1f1b", "zb-now", "zb-h1")),
                   *(str(replayed(k).bubble) for k in ("1f1b", "zb-now", "zb-h1")))),
    Claim("06.3", r"W at once still gives (serial's) loss and gradients, with no W held \((\[[\d, ]+\]) M_B at its "
                  r"peaks, 1F1B's memory\), and idles (twice) as long as `zb_h1_step`",
          lambda: ("serial's" if max(r["diff"] for r in lesson("zb-now")) < 1e-12 else "not serial's",
                   show([peak for _, peak, _ in held("zb-now")]) if [peak for _, peak, _ in held("zb-now")] == [
                       r["peak"] for r in lesson("1f1b")] else "not 1F1B's",
                   {2: "twice"}.get(one(replayed("zb-now").idle) / one(replayed("zb-h1").idle), "not twice"))),
    Claim("06.4", r"`weight_grads` runs once per microbatch: (\d+) times on every rank at m = (\d+), watched from outside",
          lambda: (str(one(sum(k == "W" for k, _, _ in r["actions"]) for r in lesson("zb-h1"))), "8")),
    Claim("06.4", r"each linear layer's weight \(the tied output layer's aside\) ends with the last microbatch's dW alone, "
                  r"its loss-weighted gradient to (float64 rounding), not the batch's; every bias and layer norm, whose "
                  r"gradients I gives, stays (serial's), and the tied `wte`, .* goes (wrong) with them",
          lambda: (lambda runs: (
              "float64 rounding" if all(r["diffs"][n][1] < 1e-12 and r["diffs"][n][0] > 1e-2 for r in runs
                                        for n in r["linear"]) and all(r["linear"] for r in runs) else "not",
              "serial's" if all(d[0] < 1e-12 for r in runs for n, d in r["diffs"].items()
                                if n not in r["linear"] and "wte" not in n) else "not serial's",
              "wrong" if all(r["diffs"]["transformer.wte.weight"][0] > 1e-2 for r in runs
                             if "transformer.wte.weight" in r["diffs"]) else "right"))(lesson("zb-replaced"))),
    # 07
    Claim("07.1", r"At V = (\d+) over (\d) ranks, V is padded to (\d+) and each rank holds (\d+) rows\.",
          lambda: ("1001", "8", str(tensor_parallel.padded_vocab_size(1001, 8)),
                   str(tensor_parallel.padded_vocab_size(1001, 8) // 8))),
    Claim("07.1", r"`VocabSchedule.grid` makes (no embedding group)",
          lambda: "no embedding group" if vocab.vocab_schedule("1f1b", 4, 5, 2).grid(8, 2, 1)["embed"] == []
          else "an embedding group"),
    Claim("07.2", r"Watched from outside at pp = (\d), m = (\d), every output layer on every rank makes the same (\d) "
                  r"collectives in this order: the broadcast of X (\([\d, ]+\)), S's MAX (\([\d, ]+\)) and SUM "
                  r"(\([\d, ]+\)), T's SUM (\([\d, ]+\)); each of the (\d) ranks runs all (\d) output layers",
          lambda: (lambda seq, counts: ("4", "8", *(
              (str(sum(e[0] != "S" and e[0] != "T" for e in seq)), *(str(e[2]) for e in seq if e[0] not in "ST"))
              if [e[:2] for e in seq] == [("broadcast", ""), ("S",), ("all-reduce", "MAX"), ("all-reduce", "SUM"),
                                          ("T",), ("all-reduce", "SUM")] else ("another order",) * 5),
              str(len(counts)), str(one(counts))))(*output_layers())),
    Claim("07.3", r"rank s runs (\[[\d, ]+\]) forwards before its first output layer, as 1F1B before its first backward "
                  r"\((\[[\d, ]+\])\), and holds at most (\[[\d, ]+\]) microbatches in flight",
          lambda: (show([next(i for i, e in enumerate(fbst(r)) if e[0] == "S") for r in lesson("vocab")]),
                   show(before_first_backward("1f1b")), show([in_flight(fbst(r)) for r in lesson("vocab")]))),
    Claim("07.3", r"its actions begin ((?:[FSTB]\d ?)+), each microbatch's S, T and B back to back",
          lambda: " ".join(f"{k}{j}" for k, j in fbst(lesson("vocab")[-1])[:8])),
    Claim("07.3", r"with Algorithm 1 at pp = 4, m = 8, (\[[\d, ]+\]) in flight",
          lambda: (lambda p: show([pipeline.peak_in_flight(acts, p.kinds) for acts in p.lists]))(
              vocab.vocab_schedule("1f1b", 4, 8, 2))),
    Claim("07.4", r"Run at pp = 4, m = 8 on a batch counting (\[[\d, ]+\]) targets \(n = (\d+)\), microbatch 0's output "
                  r"layer adds (exactly 0) to the loss; the (\d) terms, the (same) on every rank, sum to the serial model's "
                  r"loss, its mean over the batch's (\d+) targets, to (float64 rounding), and so do the gradients",
          lambda: (lambda runs: (show(one(tuple(r["counts"]) for r in runs)), str(sum(runs[0]["counts"])),
                                 "exactly 0" if all(r["losses"][0] == 0.0 for r in runs) else "more than 0",
                                 str(len(runs[0]["losses"])),
                                 "same" if len({tuple(r["losses"]) for r in runs}) == 1 else "not the same",
                                 str(sum(runs[0]["counts"])),
                                 "float64 rounding" if abs(runs[-1]["loss"] - runs[-1]["serial"]) < 1e-12 * runs[-1]["serial"]
                                 and max(r["diff"] for r in runs) < 1e-12 else "not"))(lesson("vocab"))),
    Claim("07.4", r"the serial model's mean over microbatch 0 alone is (nan)",
          lambda: str(one(str(r["means"][0]) for r in lesson("vocab")))),
    Claim("07.4", r"the lesson returns a loss of (\d+) and every gradient (\d+), as the serial model (does)",
          lambda: (lambda r: (f"{r['loss']:g}", "0" if all(x["zero"] for x in lesson("vocab-none")) else "not 0",
                              "does" if r["serial"] == r["loss"] else "does not"))(lesson("vocab-none")[-1])),
    # 08: the lesson's OneRing and ring_step, run (ring_facts, ring_step_facts)
    Claim("08.1", r"Run at cp = 4, the four ranks' forwards score (\d), (\d), (\d) and (\d) blocks, (\[[\d/, ]+\]) blocks of "
                  r"work: the last rank does cp - 1/2 = (\d+/\d+) against a mean of cp/2 = (\d+), ([\d.]+) times",
          lambda: (lambda w: (*(str(x["scored"]) for x in ring_facts()), show(w), str(max(w)), str(sum(w) / len(w)),
                              f"{float(max(w) / (sum(w) / len(w))):.2f}"))([x["work"] for x in ring_facts()])),
    Claim("08.1", r"the machine's `simulate` gives the (same) factor for its `contiguous` split",
          lambda: "same" if context.simulate(context.contiguous(4)).factor == max(x["work"] for x in ring_facts()) / (
              sum(x["work"] for x in ring_facts()) / 4) else "another"),
    Claim("08.1", r"\(`pass_on`, (\d) times at cp = 4 on every rank, rank 0 included\)",
          lambda: str(one(x["forward_hops"] for x in ring_facts()))),
    Claim("08.2", r"at cp = 4 every rank's first `block_scores` call is its \((own)\) block",
          lambda: "own" if all(x["own_first"] for x in ring_facts()) else "another"),
    Claim("08.2", r"equal torch's causal attention of the whole sequence to (float64 rounding)",
          lambda: "float64 rounding" if max(x["diff"] for x in ring_facts()) < 1e-12 else "not"),
    Claim("08.2", r"`OneRing`'s forward saves q, k, v, out and lse, \((\d)\) tensors, (none larger) than the rank's",
          lambda: (str(one(x["saved"] for x in ring_facts())),
                   "none larger" if all(x["largest_saved"] for x in ring_facts()) else "one larger")),
    Claim("08.3", r"the ring's loss is the serial loss to (float64 rounding)",
          lambda: "float64 rounding" if max(ring_step_facts()["lesson"][k] for k in ("loss", "grads")) < 1e-12 else "not"),
    Claim("08.3", r"the ring adds cp means, each about the serial mean: ([\d.]+) against the serial ([\d.]+)\.",
          lambda: (f"{ring_step_facts()['own_mean']['value']:.3f}", f"{ring_step_facts()['own_mean']['serial']:.3f}")),
    Claim("08.3", r"every gradient is \((\d)\) x too small at cp = 2",
          lambda: str(round(1 / ring_step_facts()["averaged"]["ratio"]))),
    Claim("08.4", r"at cp = 4, (\d) calls of `pass_on` with (\d) tensors each on every rank\); backward relays k, v, dK and "
                  r"dV together for cp - 1 hops \((\d) calls with (\d) tensors\) and makes one last hop with dK and dV alone "
                  r"\(a (\d)th call with (\d) tensors\)",
          lambda: (str(one(x["forward_hops"] for x in ring_facts())), "2",
                   str(one(x["backward_hops"] - 1 for x in ring_facts())), str(one(t for x in ring_facts()
                                                                                  for t in x["backward_tensors"][:-1])),
                   str(one(x["backward_hops"] for x in ring_facts())),
                   str(one(x["backward_tensors"][-1] for x in ring_facts())))),
    Claim("08.4", r"a block's keys and values are ([\d,]+) bytes, so one layer's forward sends ([\d,]+) bytes over the "
                  r"whole ring, twice the ([\d,]+) of the machine's contiguous split",
          lambda: (f"{one(x['forward_bytes'] // x['forward_hops'] for x in ring_facts()):,}",
                   f"{sum(x['forward_bytes'] for x in ring_facts()):,}",
                   f"{contiguous_forward_bytes(ring_facts()[0]['shape']):,}")),
    # 09
    Claim("09.1", r"In the demo \(E = (\d+) experts over ep = (\d) ranks\) each rank sends (\d+) counts to each rank, "
                  r"and cuts the rows it receives into (\d+) blocks, (\d+) local experts from each of (\d) ranks",
          lambda: (lambda d: (str(d["E"]), str(d["ep"]), str(d["E"] // d["ep"]), str(d["ep"] * (d["E"] // d["ep"])),
                              str(d["E"] // d["ep"]), str(d["ep"])))(expert_demo(*EP_DEMO))),
    Claim("09.2", r"In the demo the (\w+) ranks send (\d+) \(token, expert\) pairs of layer 0 and their experts "
                  r"receive (\d+) rows",
          lambda: (lambda d: ({4: "four"}.get(d["ranks"], str(d["ranks"])), str(d["sent"]), str(d["received"])))(
              expert_demo(*EP_DEMO))),
    Claim("09.3", r"In the lesson, `expert_grid\(4, 4\)` makes one ep group, (\[[\d, ]+\]), and the edp groups "
                  r"(\[\d\], \[\d\], \[\d\], \[\d\])",
          lambda: (lambda g: (str(one(map(str, g["ep"]))), ", ".join(map(str, g["edp"]))))(experts.expert_grid(4, 4))),
    Claim("09.3", r"With tp (\d) x dp (\d) -> ep (\d), edp = (\d) / (\d) = (\d): expert e lives on rank e // (\d) only, "
                  r"and its gradient, .* is summed over its edp group, (\[r\]), alone",
          lambda: (lambda d, plain, _: (str(d.tp), str(d.dp), str(d.ep), str(d.tp * d.dp), str(d.ep),
                                        str(len(plain["edp"][0])), str(d.num_experts // d.ep),
                                        "[r]" if all(g == [r] for r, g in enumerate(plain["edp"])) else "more"))(
              *expert_groups())),
    Claim("09.3", r"Under 08's fold, tp (\d) x cp (\d) -> ep (\d) \(`--tp 2 --cp 2 --dp 1`\), the ep group (\[[\d, ]+\]) is "
                  r"the tp x cp group \(`fold`'s `tp_cp`\), edp is (\d) again, and the router's copies are summed over "
                  r"tp by f and over the dp x cp group, (\[[\d, ]+\]) and (\[[\d, ]+\]) \(08's \"dp\"\), by the "
                  r"data-parallel reduction, both divided by dp x cp = (\d)",
          lambda: (lambda g: (str(len(g["tp"][0])), str(len(g["cp"][0])), str(len(g["ep"][0])),
                              str(g["ep"][0]) if g["ep"] == g["tp_cp"] else "not the tp x cp group",
                              str(len(g["edp"][0])), str(g["dp"][0]), str(g["dp"][1]), str(len(g["dp"][0]))))(
              expert_groups()[2])),
    Claim("09.4", r"every token sending nearly all its probability to experts 0 and 1 \(0.499 each\) gives ([\d.]+), near "
                  r"E/k = (\d)", lambda: (lambda p: (f"{float(experts.aux_loss(p, torch.tensor([[0, 1]] * 5), 8)):.3f}", "4"))(
                      torch.tensor([[0.499, 0.499] + [0.002 / 6] * 6] * 5, dtype=F64))),
    Claim("09.4", r"returns \((\d)\), not 0/0",
          lambda: f"{float(experts.aux_loss(torch.zeros(0, 8, dtype=F64), torch.zeros(0, 2, dtype=torch.long), 8)):g}"),
    Claim("09.4", r"together the load is even and `load_balancing_loss` is ([\d.]+), but each half alone gives ([\d.]+)\.",
          lambda: split_aux_loss()),
    Claim("09.4", r"the demo at `--tp 2 --cp 2 --dp 1` prints the (same) auxiliary loss, ([\d.]+), on the serial and the "
                  r"expert-parallel model",
          lambda: (lambda a: ("same" if a[0] == a[1] else "different", a[0]))(expert_demo(*EP_CP_DEMO)["aux"])),
]


# ----------------------------------------------------------------------------------------------
# The tests


def test_every_question_of_the_guide_has_an_answer_and_every_answer_a_question():
    asked, answered = set(questions()), set(ANSWERS)
    assert asked, "no questions found in docs/GUIDE.md"
    assert not asked - answered, f"docs/ANSWERS.md has no answer to {sorted(asked - answered)}"
    assert not answered - asked, f"docs/ANSWERS.md answers questions docs/GUIDE.md does not ask: {sorted(answered - asked)}"
    assert list(sections(ANSWERS_MD)) == list(sections(GUIDE_MD)), "ANSWERS.md's files are not GUIDE.md's, in its order"


def _names_of_the_code():
    """Every top-level function, class and assignment, and every method, of the numbered files and plumbing/."""
    import ast
    names = set()
    for path in [*ROOT.glob("0[1-9]_*.py"), *(ROOT / "plumbing").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize("key", sorted(ANSWERS))
def test_each_answer_cites_the_code_by_name(key):
    code = _names_of_the_code()
    cited = [n for n in re.findall(r"`([A-Za-z_][\w.]*)`", ANSWERS[key]) if n.split(".")[-1] in code
             or n.split(".")[0] in code]
    assert cited, f"docs/ANSWERS.md {key} names no function, class or method of the numbered files or plumbing/"


def test_every_answer_has_a_claim_and_every_claim_an_answer():
    claimed = {c.key for c in CLAIMS}
    assert not set(ANSWERS) - claimed, f"answers that no Claim checks (add one to CLAIMS): {sorted(set(ANSWERS) - claimed)}"
    assert not claimed - set(ANSWERS), f"Claims of answers docs/ANSWERS.md does not have: {sorted(claimed - set(ANSWERS))}"


def found(claim, answers=ANSWERS):
    return re.search(claim.words, answers.get(claim.key, ""))


@pytest.mark.parametrize("claim", CLAIMS, ids=[f"{c.key}: {c.words[:50]}" for c in CLAIMS])
def test_each_figure_an_answer_states_is_what_the_code_gives(claim):
    hit = found(claim)
    assert hit, f"docs/ANSWERS.md {claim.key} no longer says this (update CLAIMS with the answer): {claim.words}"
    want = claim.value()
    want = want if isinstance(want, tuple) else (want,)
    assert hit.groups() == tuple(str(x) for x in want), \
        f"docs/ANSWERS.md {claim.key} says {hit.groups()} where the code gives {want}: {hit[0]!r}"


def test_a_changed_figure_or_a_dropped_sentence_fails_its_claim():
    claim = next(c for c in CLAIMS if c.key == "03.2" and "messages" in c.words)
    assert found(claim)
    changed = {**ANSWERS, "03.2": ANSWERS["03.2"].replace("send 112 messages", "send 104 messages")}
    assert found(claim, changed).groups() != tuple(claim.value())
    dropped = {**ANSWERS, "03.2": ANSWERS["03.2"].replace("2.33 times as many", "more")}
    assert found(claim, dropped) is None
    planted = "## 03_interleaved.py\n\n1. An answer.\n2. Another.\n\n## 04_data_parallel.py\n\n1. A third.\n"
    assert numbered(re.split(r"\n## (0\d)_[a-z0-9_]+\.py\b[^\n]*\n", "\n" + planted)[2]) == {1: "An answer.",
                                                                                             2: "Another."}


FIRST_READ = ("01", "02", "03", "04", "05")  # issue 47: a first read answers 1 or 2 questions a chapter, ~5 minutes each
SECOND_PASS, IN_DEPTH, CHECK_WORDS = "*Second pass.*", "*In depth.*", 70


def first_read_problems(asked, answered):
    """What 01-05's questions and answers get wrong about the first read: each chapter 1 or 2 questions not marked
    whole *Second pass.* (GUIDE), and each answer a short check, at most CHECK_WORDS words, before *In depth.*."""
    problems = []
    for ch in FIRST_READ:
        keys = sorted(k for k in asked if k.startswith(f"{ch}."))
        first = [k for k in keys if not asked[k].startswith(SECOND_PASS)]
        if not 1 <= len(first) <= 2:
            problems.append(f"GUIDE {ch} has {len(first)} first-read questions {first} (1 or 2; mark the others "
                            f"{SECOND_PASS} at the question's start)")
        for k in keys:
            check, lead_in, _ = answered.get(k, "").partition(IN_DEPTH)
            if not lead_in:
                problems.append(f"ANSWERS {k} has no short check before '{IN_DEPTH}'")
            elif len(check.split()) > CHECK_WORDS:
                problems.append(f"ANSWERS {k}'s check is {len(check.split())} words, past {CHECK_WORDS}"
                                f"{' (a first-read question)' if k in first else ''}")
    return problems


def test_a_first_read_answers_one_or_two_questions_a_chapter_each_checked_in_a_few_words():
    asked = questions()
    assert not first_read_problems(asked, ANSWERS), first_read_problems(asked, ANSWERS)
    three = {**asked, "02.1": asked["02.1"].removeprefix(SECOND_PASS + " ")}  # 02.1's mark dropped: 3 first-read
    none = {k: (q if k[:2] != "04" or q.startswith(SECOND_PASS) else f"{SECOND_PASS} {q}") for k, q in asked.items()}
    wordy = {**ANSWERS, "02.2": ANSWERS["02.2"].replace(IN_DEPTH, "and more " * 8 + IN_DEPTH, 1)}
    no_check = {**ANSWERS, "03.1": ANSWERS["03.1"].replace(IN_DEPTH, "")}
    for planted in (first_read_problems(three, ANSWERS), first_read_problems(none, ANSWERS),
                    first_read_problems(asked, wordy), first_read_problems(asked, no_check)):
        assert len(planted) == 1, planted


def test_the_guide_and_the_readme_link_the_answers():
    assert "](ANSWERS.md" in GUIDE_MD.read_text(encoding="utf-8")
    assert "](docs/ANSWERS.md" in (ROOT / "README.md").read_text(encoding="utf-8")
