"""The checks of 05's exercises (exercises/ex05_3d_gpt.py), and the planted wrong answers.

The rank grid is pure: it is checked here, for several worlds, against its definition. 05.4, the
lesson's step, runs as 05's demo does, against the serial model's step (loss, every gradient, every
weight after AdamW) at two layouts, on a batch whose replicas count unequal numbers of targets. The other
two run 05's own trainer (train) on tp=2 x pp=2 CPU ranks, the student's function in place of 05's,
against plumbing.reference's serial_train on the same data (computed here, before anything is installed): every
step's loss and global gradient norm, in float64 to 1e-10, with clipping active so that the norm
matters. Before that each looks at its piece alone: ScatterGather's pack and unpack on one tp
group, and, parameter by parameter on every rank, whether counts_in_norm counts it.
"""
import functools
import os
import tempfile
from dataclasses import replace

import torch

from exercises.autograder import Exercise, Mistake, Planted, called, differences, first, installed, merged, \
    numbered, ranks, tp_group, warm
from plumbing.reference import serial_train, unequal_counts

tensor_parallel = numbered("01_tensor_parallel")
gpt3d = numbered("05_3d_gpt")
F64 = torch.float64
CFG = tensor_parallel.GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=16)
BASE = gpt3d.TrainConfig(tp=2, pp=2, dp=1, batch_size=8, microbatches=2, seq_len=16, steps=3, lr=1e-2, min_lr=1e-3,
                         warmup_steps=1, grad_clip=0.5, dtype="float64", eval_every=0, bucket_numel=500,
                         timeout_s=20)
REFERENCE = {"rank_grid": gpt3d.rank_grid, "pack": gpt3d.ScatterGather.pack, "unpack": gpt3d.ScatterGather.unpack,
             "counts_in_norm": gpt3d.counts_in_norm, "ptd_p_step": gpt3d.ptd_p_step}
GRIDS = [(1, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (8, 2, 2, 2), (16, 2, 2, 4), (12, 3, 2, 2),
         (6, 1, 3, 2), (16, 8, 1, 2), (24, 2, 3, 4)]  # (world, tp, dp, pp)


# ----------------------------------------------------------------------------------------------
# 05.1 The rank grid

WHY = {"tp": "a tp group is tp adjacent ranks (t fastest: one node, its all-reduces on NVLink)",
       "dp": "a dp group is the ranks that differ only in d, tp apart",
       "pp": "a pp group is the ranks that differ only in p, tp x dp apart, stage order",
       "embed": "each pp group's first and last rank (none at pp = 1)"}


def check_rank_grid(impl):
    fn = impl["rank_grid"]
    for world, tp, dp, pp in GRIDS:
        got = called(fn, world, tp, dp, pp, what=f"rank_grid({world}, tp={tp}, dp={dp}, pp={pp})")
        want = gpt3d.rank_grid(world, tp, dp, pp)
        where = f"rank_grid({world}, tp={tp}, dp={dp}, pp={pp})"
        if not isinstance(got, dict) or set(got) != set(want):
            return [f"{where} returned {got!r:.80}: a dict with the keys {sorted(want)}"]
        for kind in ("tp", "dp", "pp", "embed"):
            mine = [list(g) for g in got[kind]]
            if mine != want[kind]:
                wrong = next((g for g, w in zip(mine, want[kind]) if g != w), None)
                return [f"{where}[{kind!r}] = {_short(mine)}, expected {_short(want[kind])}"
                        + (f" (first wrong group: {wrong})" if wrong is not None else "") + f": {WHY[kind]}; "
                        f"rank (t, d, p) = (p * dp + d) * tp + t"]
    try:
        fn(6, 2, 2, 2)
    except ValueError as e:
        if not all(str(x) in str(e) for x in (6, 2)):
            return [f"rank_grid(6, tp=2, dp=2, pp=2) raises {e!r}, which should name the world 6 and tp, dp, pp"]
        return []
    except (NotImplementedError, Mistake):  # a stub's hint; what it returned, said at its line
        raise
    except Exception as e:  # noqa: BLE001
        return [f"rank_grid(6, tp=2, dp=2, pp=2) raises {type(e).__name__}; a ValueError naming the numbers is "
                f"expected (6 != 2 x 2 x 2)"]
    return ["rank_grid(6, tp=2, dp=2, pp=2) returns a grid; it must raise ValueError: 6 != tp x dp x pp = 8"]


def _short(groups):
    text = str(groups)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------------------------------------------
# Training with 05's trainer, against serial training


@functools.lru_cache(maxsize=1)
def data_file():
    """A small text file to train on (its bytes are the tokens): 05's built-in corpus is 1 MB, and
    making it takes seconds."""
    path = os.path.join(tempfile.mkdtemp(prefix="exercises-05-"), "counting.txt")
    words = " ".join(f"{a} plus {b} is {a + b}." for a in range(10) for b in range(10))
    with open(path, "w") as f:
        f.write(words * 4)
    return path


def config():
    return replace(BASE, data=data_file())


def serial_reference():
    warm(meta=True)  # 05's build draws its weights on the meta device: import that once, here
    ref = serial_train(CFG, config())
    if max(ref["norms"]) <= BASE.grad_clip:
        raise RuntimeError("the check's serial run never clips: its gradient norm would not matter")
    return ref


def _train(env, ref):
    out = gpt3d.train(env, CFG, config(), quiet=True)
    pairs = [(f"the {what} of step {i}", torch.tensor(a, dtype=F64), torch.tensor(b, dtype=F64))
             for key, what in (("losses", "loss"), ("norms", "global gradient norm"))
             for i, (a, b) in enumerate(zip(out[key], ref[key]))]
    hints = {"other": "compared with serial training on the same data"}
    return differences(pairs, hints, factors={"tp": BASE.tp, "pp": BASE.pp})


def training(ref):
    where = f"training tp={BASE.tp} x pp={BASE.pp} for {BASE.steps} steps with 05's trainer, "
    return first([where + r for r in merged(ranks(_train, BASE.tp * BASE.pp, ref))], 3)


# ----------------------------------------------------------------------------------------------
# 05.2 Scatter/gather


def _scatter_gather(env):
    group = tp_group(env)
    tp, r = env.world_size, env.rank
    shape = (2, 4, 6)
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=F64)  # the same on every tp rank
    wire = gpt3d.ScatterGather(shape, group)
    sent = wire.pack(t)
    want = t.reshape(-1).chunk(tp)[r]
    found = differences([("pack(t) (what this rank sends)", sent, want,
                          [(t.reshape(-1), "it is the whole tensor: each tp rank sends only its 1/tp slice")] +
                          [(t.reshape(-1).chunk(tp)[q], f"it is rank {q}'s slice: take this rank's (its index "
                                                        f"in the tp group)") for q in range(tp) if q != r])])
    if not found and not sent.is_contiguous():
        found = ["pack(t) is not contiguous: point-to-point sends need contiguous buffers (.contiguous())"]
    if found:
        return found
    got = wire.unpack(want.clone())
    return differences([("unpack(this rank's slice) (the rebuilt boundary tensor)", got, t,
                         [(torch.cat([want, torch.zeros(t.numel() - want.numel(), dtype=F64)]).view(shape),
                           "only this rank's slice is filled: all-gather the slices over the tp group")])])


def check_scatter_gather(impl):
    patches = (gpt3d.ScatterGather, "pack", impl["pack"]), (gpt3d.ScatterGather, "unpack", impl["unpack"])
    with installed(*patches):
        alone = first([f"alone on tp=2, {r}" for r in merged(ranks(_scatter_gather, 2))], 3)
    if alone:
        return alone
    ref = serial_reference()  # only now: it takes seconds, and a piece that fails alone needs none
    with installed(*patches):
        return training(ref)


# ----------------------------------------------------------------------------------------------
# 05.3 counts_in_norm


def _counts(env):
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, BASE.tp, BASE.dp, BASE.pp), BASE.timeout_s)
    run = gpt3d.build(env, CFG, config(), groups)
    tp_rank, pp_rank = env.rank % BASE.tp, env.rank // (BASE.tp * BASE.dp)
    out = []
    for chunk in run.chunks:
        for n, p in chunk.named_parameters():
            got = gpt3d.counts_in_norm(p, chunk, groups.tp)
            want = REFERENCE["counts_in_norm"](p, chunk, groups.tp)
            if bool(got) != want:
                out.append(f"(tp {tp_rank}, pp {pp_rank}) {n} is {'' if got else 'not '}counted: {_why(n, p, chunk, want)}")
    return out


def _why(n, p, chunk, want):
    if chunk.post_process and not chunk.pre_process and p is chunk.transformer.wte.weight:
        return "this is the last stage's copy of the tied embedding, the first stage's wte again: count it once, there"
    if hasattr(p, "tp_dim"):
        return f"it is split across the tp ranks (tp_dim={p.tp_dim}): each rank holds a different slice, so every rank counts its own"
    return ("it is replicated on every tp rank: count it on one (tp rank 0)" if not want else
            "it is replicated on every tp rank, and tp rank 0 counts it")


def check_counts_in_norm(impl):
    warm(meta=True)  # 05's build draws its weights on the meta device: import that once, here
    with installed((gpt3d, "counts_in_norm", impl["counts_in_norm"])):
        alone = first(merged(ranks(_counts, BASE.tp * BASE.pp * BASE.dp)), 4)
    if alone:
        return alone
    ref = serial_reference()
    with installed((gpt3d, "counts_in_norm", impl["counts_in_norm"])):
        return training(ref)


# ----------------------------------------------------------------------------------------------
# 05.4 ptd_p_step: the lesson's one step, against the serial model's (05's demo, in words)

LESSON_LAYOUTS = [(1, 1, 2), (2, 2, 2)]  # (tp, pp, dp)
CONTRACT = ("each counted target of the GLOBAL batch weighs 1/n, n counted over the dp replicas (an all-reduce "
            "over groups.dp); microbatch i's mean weighs dp x valid_i / n, as allreduce_gradients averages")


def _lesson_step(env, layout):
    tp, pp, dp = layout
    m = gpt3d.CHECK_M
    cfg = tensor_parallel.GPTConfig(vocab_size=97, block_size=8, n_layer=2 * pp, n_head=2 * tp, n_embd=8 * tp)
    groups = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, tp, dp, pp), BASE.timeout_s)
    full = tensor_parallel.init_state_dict(cfg, 3, dtype=F64, random_all=True)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=F64)
    stage = gpt3d.pipeline.stage_model(cfg, groups.pp, group=groups.tp, dtype=F64)
    for model in (serial, stage):
        model.load_full_state_dict(full)
    idx, targets = torch.randint(cfg.vocab_size, (2, dp * m * 2, 8), generator=torch.Generator().manual_seed(4))
    unequal_counts(targets, dp * m)  # replica 0's first microbatch counts none: the replicas count unequally
    ref_loss = serial(idx, targets)[1]
    ref_loss.backward()
    gpt3d.adamw(serial.parameters()).step()
    loss = gpt3d.ptd_p_step(stage, gpt3d.adamw(stage.parameters()), idx, targets, groups, m)
    pairs = [("the loss (last stage)", loss, ref_loss.detach())] if stage.post_process else []
    pairs += [(f"the gradient of {n}", g, serial.get_parameter(n).grad) for n, g in stage.full_grads().items()]
    pairs += [(f"{n} after the AdamW step", w, serial.get_parameter(n).detach())
              for n, w in stage.full_state_dict().items()]
    hints = {k: CONTRACT for k in ("other", "dp x too large", "dp x too small", "scaled")}
    return differences(pairs, hints, factors={"dp": dp})


def check_ptd_p_step(impl):
    with installed((gpt3d, "ptd_p_step", impl["ptd_p_step"])):
        for tp, pp, dp in LESSON_LAYOUTS:
            where = f"tp={tp} x pp={pp} x dp={dp}, against the serial model's step, "
            found = first([where + r for r in merged(ranks(_lesson_step, tp * pp * dp, (tp, pp, dp)))], 3)
            if found:
                return found
    return []


# ----------------------------------------------------------------------------------------------
# Planted wrong answers


def _grid_dp_fastest(world, tp=1, dp=1, pp=1):
    if tp * dp * pp != world:
        raise ValueError(f"the world size {world} does not match tp={tp} x dp={dp} x pp={pp}")
    rank = lambda t, d, p: (p * tp + t) * dp + d  # noqa: E731  (the mistake: dp fastest)
    grid = {"tp": sorted([rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)),
            "dp": sorted([rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)),
            "pp": sorted([rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp))}
    grid["embed"] = [[g[0], g[-1]] for g in grid["pp"]] if pp > 1 else []
    return grid


def _pack_whole(self, t):
    return t.reshape(-1).contiguous()


def _unpack_returns_gather(self, buf):
    out = buf.new_empty(buf.numel() * self.tp)
    return tensor_parallel.all_gather_single(out, buf, group=self.tp_group)  # the mistake: it returns None


def _counts_replicated_everywhere(p, chunk, tp_group):
    return not (chunk.post_process and not chunk.pre_process and p is chunk.transformer.wte.weight)


def _counts_tied_copy(p, chunk, tp_group):
    return hasattr(p, "tp_dim") or torch.distributed.get_rank(tp_group) == 0


def _step_replica_means(stage, opt, idx, targets, groups, m):  # each replica's own mean, averaged (1/dp)
    dp = torch.distributed.get_world_size(groups.dp)
    idx, targets = gpt3d.data_parallel.shard_batch(idx, targets, dp, torch.distributed.get_rank(groups.dp))
    opt.zero_grad()
    loss = gpt3d.pipeline.one_f_one_b_step(stage, list(zip(idx.chunk(m), targets.chunk(m))), groups.pp)
    gpt3d.data_parallel.allreduce_gradients(list(stage.parameters()), groups.dp)
    opt.step()
    if loss is not None:
        torch.distributed.all_reduce(loss, group=groups.dp)
        loss = loss / dp
    return loss


EXERCISES = [
    Exercise("05.1", "rank_grid", "the rank grid: tp fastest, then dp, then pp", ("rank_grid",),
             "Narayanan et al. 2021, Section 3", check_rank_grid, lambda: {"rank_grid": REFERENCE["rank_grid"]},
             [Planted("grid_dp_fastest", "the grid puts dp fastest, so a tp group spans nodes",
                      lambda: {"rank_grid": _grid_dp_fastest}, "a tp group is tp adjacent ranks")]),
    Exercise("05.2", "scatter_gather", "scatter/gather of the boundary tensor between stages", ("pack", "unpack"),
             "Narayanan et al. 2021, Section 4.1", check_scatter_gather,
             lambda: {"pack": REFERENCE["pack"], "unpack": REFERENCE["unpack"]},
             [Planted("unpack_returns_gather", "unpack returns what all_gather_single returns (None), not out",
                      lambda: {"unpack": _unpack_returns_gather}, "it returned None, but the piece it stands in for "
                      "always returns a value", at_line=True),
              Planted("pack_whole_tensor", "each tp rank sends the whole boundary tensor",
                      lambda: {"pack": _pack_whole}, "each tp rank sends only its 1/tp slice")]),
    Exercise("05.3", "counts_in_norm", "the global gradient norm: every element counted once", ("counts_in_norm",),
             "Narayanan et al. 2021, Section 3 (the layout); 05's clip_gradients", check_counts_in_norm,
             lambda: {"counts_in_norm": REFERENCE["counts_in_norm"]},
             [Planted("norm_counts_replicated_twice", "replicated parameters are counted on every tp rank",
                      lambda: {"counts_in_norm": _counts_replicated_everywhere}, "count it on one (tp rank 0)"),
              Planted("norm_counts_tied_copy", "the last stage's copy of the tied embedding is counted too",
                      lambda: {"counts_in_norm": _counts_tied_copy}, "count it once, there")]),
    Exercise("05.4", "ptd_p_step", "one PTD-P step from the earlier chapters' lessons", ("ptd_p_step",),
             "Narayanan et al. 2021, Section 3; docs/LOSS.md", check_ptd_p_step,
             lambda: {"ptd_p_step": REFERENCE["ptd_p_step"]},
             [Planted("step_replica_means", "each replica's own mean loss, the replicas averaged (1/dp)",
                      lambda: {"ptd_p_step": _step_replica_means}, "n counted over the dp replicas")]),
]
