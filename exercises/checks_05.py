"""The checks of 05's exercises (exercises/ex05_3d_gpt.py), and the planted wrong answers. Each
exercise stubs a function of 05's lesson.

05.1, the rank grid, is pure: checked here for ten worlds against a grid this file builds its own way
(each rank's coordinates, then the ranks that differ in one of them), not against 05's rank_grid.
05.2, new_groups, runs first on every rank of three grids in this process with dist.new_group recorded
(no rank started, so a wrong order cannot hang; torch's helpers built on it, such as
dist.new_subgroups_by_enumeration, are recorded through it, and a call that needs a started process
group is said at the student's line): every rank must create every group, in the same order, and keep
its own; then on 4 CPU ranks, each returned group all-reducing its ranks. 05.3, the
trainer's AdamW, is compared in float64 over three steps with an AdamW written out here (decoupled
decay on the 2-D weights only, betas (0.9, 0.95)), to 1e-12: the same formula in another order of
operations, a few ulps. 05.4, the lesson's step, runs as 05's demo does, against the serial model's
step (loss, every gradient, every weight after AdamW) at two layouts, on a batch whose replicas
count unequal numbers of targets, with the grader's own groups and AdamW (not 05.1's to 05.3's: in the
student copy those are the student's, lent).
"""
import linecache
import sys
from datetime import timedelta

import torch

from exercises import autograder
from exercises.autograder import Exercise, Mistake, Planted, called, differences, first, grid_groups, installed, \
    merged, numbered, ranks
from plumbing.launch import RankEnv
from plumbing.reference import unequal_counts

tensor_parallel = numbered("01_tensor_parallel")
gpt3d = numbered("05_3d_gpt")
F64 = torch.float64
TIMEOUT_S = 20
REFERENCE = {"rank_grid": gpt3d.rank_grid, "new_groups": gpt3d.new_groups, "adamw": gpt3d.adamw,
             "ptd_p_step": gpt3d.ptd_p_step}
GRIDS = [(1, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (8, 2, 2, 2), (16, 2, 2, 4), (12, 3, 2, 2),
         (6, 1, 3, 2), (16, 8, 1, 2), (24, 2, 3, 4)]  # (world, tp, dp, pp)


# ----------------------------------------------------------------------------------------------
# 05.1 The rank grid

WHY = {"tp": "a tp group is tp adjacent ranks (t fastest: one node, its all-reduces on NVLink)",
       "dp": "a dp group is the ranks that differ only in d, tp apart",
       "pp": "a pp group is the ranks that differ only in p, tp x dp apart, stage order",
       "embed": "each pp group's first and last rank (none at pp = 1)"}


def expected_grid(world, tp, dp, pp):
    """The grid from its definition, built another way than 05's rank_grid: rank r's coordinates are
    (t, d, p) = (r mod tp, r // tp mod dp, r // (tp dp)); a group of a kind is the ranks equal in the
    other two coordinates, ascending; the groups in ascending order of their first rank."""
    coords = {r: (r % tp, r // tp % dp, r // (tp * dp)) for r in range(world)}

    def apart_in(axis):
        groups = {}
        for r, c in coords.items():
            groups.setdefault(c[:axis] + c[axis + 1:], []).append(r)
        return sorted(groups.values())

    grid = {"tp": apart_in(0), "dp": apart_in(1), "pp": apart_in(2)}
    grid["embed"] = [[g[0], g[-1]] for g in grid["pp"]] if pp > 1 else []
    return grid


def check_rank_grid(impl):
    fn = impl["rank_grid"]
    for world, tp, dp, pp in GRIDS:
        got = called(fn, world, tp, dp, pp, what=f"rank_grid({world}, tp={tp}, dp={dp}, pp={pp})")
        want = expected_grid(world, tp, dp, pp)
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
# 05.2 new_groups

GROUP_GRIDS = [(8, 2, 2, 2), (4, 2, 2, 1), (6, 1, 2, 3)]  # (world, tp, dp, pp): 05's, one with no embed, tp = 1
ORDER_RULE = ("dist.new_group is a collective over every rank: each rank calls it for every group of the grid, "
              "member or not, in the same order (a rank that skips one pairs the next call with another group, "
              "or waits forever)")


EMPTY_KIND_RULE = ("a kind with no group (grid['embed'] is [] at pp = 1: the embedding is tied across no stages) "
                   "makes no group, and every rank's Groups has None for it")


RECORDED_RULE = ("new_groups is graded first on each rank in turn, in this process, with every group it makes "
                 "recorded and no process group started (a wrong order then cannot hang): make the groups with "
                 "dist.new_group(ranks, timeout=...) or dist.new_subgroups_by_enumeration, and take this rank "
                 "from env.rank")


class _Recorded:
    """What the recording dist.new_group returns: the group's ranks and the student's line that made it."""

    def __init__(self, ranks, line):
        self.ranks, self.line = sorted(ranks), line

    def __repr__(self):
        return f"the group {self.ranks}" + (f", made at {self.line}" if self.line else "")


def student_line(depth=2):
    """"exercises/ex05_3d_gpt.py:63 (mine[kind] = dist.new_group(...))": the innermost frame above the
    caller in the graded files (autograder's _student_files; the caller itself if none is), or None."""
    frame, files = sys._getframe(depth), autograder._student_files
    while frame is not None and files and frame.f_code.co_filename not in files:
        frame = frame.f_back
    if frame is None:
        return None
    path, line = frame.f_code.co_filename, frame.f_lineno
    source = linecache.getline(path, line).strip()
    source = source if len(source) <= 70 else source[:67] + "..."
    return f"{autograder._short_path(path)}:{line}" + (f" ({source})" if source else "")


def _recording(world, tp, dp, pp, fn):
    """new_groups(env, grid) on every rank of the grid in this process, dist.new_group recorded: the reasons,
    each said at the student's line that called dist.new_group."""
    grid = expected_grid(world, tp, dp, pp)
    made = {}

    def new_group(ranks=None, timeout=None, *args, **kwargs):
        group = _Recorded(range(world) if ranks is None else ranks, student_line())
        made[rank].append((group, timeout))
        return group

    def new_subgroups_by_enumeration(ranks_per_subgroup_list, *args, **kwargs):
        if not ranks_per_subgroup_list:  # torch's own ValueError would not say why the list is empty
            raise autograder.Mistake(f"{student_line()}: {where}: dist.new_subgroups_by_enumeration is given an "
                                     f"empty list, which it refuses: {EMPTY_KIND_RULE}")
        return real_by_enumeration(ranks_per_subgroup_list, *args, **kwargs)  # its new_group is the recording one

    def get_rank(group=None):
        return rank if group is None else group.ranks.index(rank) if rank in group.ranks else -1

    def get_world_size(group=None):
        return world if group is None else len(group.ranks)

    where = f"grid {world} = tp {tp} x dp {dp} x pp {pp}"
    kept = {}
    # torch's helpers that make groups (dist.new_subgroups_by_enumeration, dist.new_subgroups) call
    # distributed_c10d's new_group and get_rank: those are recorded and answered here too, so that a student's
    # call of one is graded as the groups it makes, with no process group started.
    c10d, real_by_enumeration = gpt3d.dist.distributed_c10d, gpt3d.dist.distributed_c10d.new_subgroups_by_enumeration
    with installed(*[(owner, name, fn) for owner in (gpt3d.dist, c10d)
                     for name, fn in (("new_group", new_group), ("get_rank", get_rank),
                                      ("get_world_size", get_world_size),
                                      ("new_subgroups_by_enumeration", new_subgroups_by_enumeration))]):
        for rank in range(world):
            made[rank] = []
            try:
                kept[rank] = called(fn, RankEnv(rank, world, rank, torch.device("cpu")), grid, TIMEOUT_S,
                                    what=f"new_groups on rank {rank} of the {where}")
            except autograder.StudentError as e:
                if "not been initialized" not in str(e.__cause__):
                    raise
                at = autograder._where(e.__cause__)
                raise autograder.Mistake(f"{at[0].strip()[3:] + ': ' if at else ''}new_groups on rank {rank} of the "
                                         f"{where} calls a torch.distributed function that needs a started process "
                                         f"group: {RECORDED_RULE}") from None
    every = [g for kind in ("tp", "dp", "pp", "embed") for g in grid[kind]]
    ranks_of = {rank: [g.ranks for g, _ in made[rank]] for rank in range(world)}
    for rank in range(world):
        at = f"{made[rank][0][0].line}: " if made[rank] and made[rank][0][0].line else ""
        missing = [g for g in every if g not in ranks_of[rank]]
        if missing:
            return [f"{at}{where}: rank {rank} never creates the group {missing[0]}"
                    + (f" and {len(missing) - 1} more" if len(missing) > 1 else "") + f": {ORDER_RULE}"]
        if ranks_of[rank] != ranks_of[0]:
            mine, theirs = ranks_of[rank], ranks_of[0]
            k = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            at = f"{made[rank][min(k, len(mine) - 1)][0].line}: " if made[rank][min(k, len(mine) - 1)][0].line else ""
            return [f"{at}{where}: rank {rank}'s call {k + 1} to dist.new_group makes "
                    f"{mine[k] if k < len(mine) else 'nothing'}, rank 0's makes "
                    f"{theirs[k] if k < len(theirs) else 'nothing'}: {ORDER_RULE}"]
        for group, timeout in made[rank]:
            if timeout != timedelta(seconds=TIMEOUT_S):
                return [f"{group.line + ': ' if group.line else ''}{where}: rank {rank} makes {group.ranks} with "
                        f"timeout={timeout!r}, not timedelta(seconds=timeout_s): a group's own timeout bounds the "
                        f"collectives on it, so that a rank waiting for a peer that never comes fails, naming the "
                        f"group, instead of hanging (torch's default is 30 minutes)"]
    for rank in range(world):
        groups = kept[rank]
        for kind in ("tp", "dp", "pp", "embed"):
            own = next((g for g in grid[kind] if rank in g), None)
            got = getattr(groups, kind, "missing")
            if got == "missing":
                return [f"{where}: rank {rank}'s result has no {kind!r}: return Groups(tp=, dp=, pp=, embed=)"]
            if own is None and got is not None:
                return [f"{where}: rank {rank} is in no {kind} group, and its result's {kind} is {got!r}: None there"]
            if own is not None and not (isinstance(got, _Recorded) and got.ranks == own):
                return [f"{where}: rank {rank}'s {kind} is {got!r}, not its own {own}: keep, of each kind, the "
                        f"group that holds env.rank"]
    return []


def _real_groups(env, fn):
    """On real ranks: each kept group all-reduces its ranks' numbers, against its ranks' sum."""
    grid = expected_grid(env.world_size, 2, 1, 2)
    groups = fn(env, grid, TIMEOUT_S)
    out = []
    for kind in ("tp", "dp", "pp", "embed"):
        own = next(g for g in grid[kind] if env.rank in g)
        x = torch.tensor([float(env.rank)], dtype=F64)
        torch.distributed.all_reduce(x, group=getattr(groups, kind))
        if int(x) != sum(own):
            out.append(f"an all-reduce over the {kind} group summed {int(x)}, not {sum(own)} (ranks {own})")
    return out


def check_new_groups(impl):
    for world, tp, dp, pp in GROUP_GRIDS:
        found = _recording(world, tp, dp, pp, impl["new_groups"])
        if found:
            return found
    return first([f"on tp 2 x pp 2 CPU ranks, {r}" for r in merged(ranks(_real_groups, 4, impl["new_groups"]))], 3)


# ----------------------------------------------------------------------------------------------
# 05.3 adamw, against AdamW written out


def _model():
    """Parameters of each kind 05 trains: an embedding and a linear's matrices (decayed), a LayerNorm and
    a bias (not), random in float64; and three steps of random gradients."""
    gen = torch.Generator().manual_seed(5)
    shapes = {"wte (2-D)": (11, 6), "ln.weight (1-D)": (6,), "ln.bias (1-D)": (6,), "fc.weight (2-D)": (5, 6),
              "fc.bias (1-D)": (5,)}
    params = {n: torch.nn.Parameter(torch.randn(*s, generator=gen, dtype=F64)) for n, s in shapes.items()}
    grads = [{n: torch.randn(*s, generator=gen, dtype=F64) for n, s in shapes.items()} for _ in range(3)]
    return params, grads


def written_out(start, grads, lr, betas=(0.9, 0.95), decay=lambda p: p.dim() >= 2, eps=1e-8):
    """AdamW step by step (Loshchilov and Hutter's decoupled decay, torch's eps): {name: weights after}."""
    (b1, b2), out = betas, {}
    for n, p in start.items():
        w, m, v = p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)
        for t, g in enumerate((step[n] for step in grads), 1):
            w = w * (1 - lr * 0.1) if decay(w) else w
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            w = w - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        out[n] = w
    return out


def _recording_adamw(built):
    """torch.optim.AdamW, each construction's line (the student's, student_line) appended to built."""
    class AdamW(torch.optim.AdamW):
        def __init__(self, *args, **kwargs):
            built.append(student_line())
            super().__init__(*args, **kwargs)
    return AdamW


def check_adamw(impl):
    for lr in (None, 3e-2):  # its default (05's CHECK_LR) and one given
        params, grads = _model()
        start = {n: p.detach().clone() for n, p in params.items()}  # the weights before the optimizer's steps
        what = f"adamw(model.parameters(){'' if lr is None else f', lr={lr}'})"
        built = []  # the student's line that built each torch.optim.AdamW
        args = [(p for p in params.values())] + ([] if lr is None else [lr])  # a generator, as 05's demo passes
        with installed((torch.optim, "AdamW", _recording_adamw(built))):
            opt = called(impl["adamw"], *args, what=what)
        at = f"{built[-1]}: " if built and built[-1] else ""
        if not isinstance(opt, torch.optim.Optimizer):
            return [f"{at}{what} returned {opt!r:.60}: a torch.optim.AdamW over the parameters (two parameter groups)"]
        held = [id(p) for group in opt.param_groups for p in group["params"]]
        for n, p in params.items():
            if held.count(id(p)) != 1:
                return [f"{at}{what}: {n} is in {held.count(id(p))} parameter groups, not 1"
                        + (": params is a generator (05's demo passes model.parameters()), used up by the first "
                           "pass over it: make it a list first" if not held.count(id(p)) else "")]
        for n, p in params.items():
            group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
            decay, want = group.get("weight_decay"), 0.1 if p.dim() >= 2 else 0.0
            if decay != want:
                return [f"{at}{what}: {n} is in a group with weight_decay {decay}, not {want}: "
                        + ("weight decay is for the 2-D weights only; decay would pull a LayerNorm's gain toward 0, "
                           "and a bias sets no scale to regularise: give the parameters with p.dim() < 2 a group "
                           "of their own with weight_decay 0.0" if p.dim() < 2 else
                           "the 2-D weights (the linears' and embeddings' matrices) decay by 0.1")]
            if tuple(group.get("betas", ())) != (0.9, 0.95):
                return [f"{at}{what}: {n}'s group has betas {group.get('betas')}: the trainer's are (0.9, 0.95), "
                        f"GPT-3's (torch's default second-moment beta 0.999 averages over ~1000 steps, slow to "
                        f"follow a loss spike)"]
        for step in grads:
            for n, p in params.items():
                p.grad = step[n].clone()
            called(opt.step, what=f"{what}.step()")
        lr = gpt3d.CHECK_LR if lr is None else lr
        want = written_out(start, grads, lr)
        wrong = {"every parameter decayed: weight decay is for the 2-D weights only (biases and LayerNorms "
                 "keep theirs)": written_out(start, grads, lr, decay=lambda p: True),
                 "no parameter decayed: the 2-D weights decay by lr x 0.1 a step": written_out(start, grads, lr,
                                                                                            decay=lambda p: False),
                 "betas (0.9, 0.999), torch's default: the trainer's are (0.9, 0.95)":
                     written_out(start, grads, lr, betas=(0.9, 0.999)),
                 "lr is not the one given": written_out(start, grads, 1e-3 if lr != 1e-3 else 3e-2)}
        pairs = [(f"{what}: {n} after 3 steps", p.detach(), want[n], [(alt[n], hint) for hint, alt in wrong.items()])
                 for n, p in params.items()]
        found = differences(pairs, tol=1e-12)
        if found:
            return [at + r for r in found]
    return []


# ----------------------------------------------------------------------------------------------
# 05.4 ptd_p_step: the lesson's one step, against the serial model's (05's demo, in words)

LESSON_LAYOUTS = [(1, 1, 2), (2, 2, 2)]  # (tp, pp, dp)
CONTRACT = ("each counted target of the GLOBAL batch weighs 1/n, n counted over the dp replicas (an all-reduce "
            "over groups.dp); microbatch i's mean weighs dp x valid_i / n, as allreduce_gradients averages")


def trainers_adamw(params, lr=gpt3d.CHECK_LR):
    """The trainer's AdamW, built here (not 05.3's, which the student copy lends from the student's file):
    decay 0.1 on the 2-D weights only, betas (0.9, 0.95)."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def _lesson_step(env, layout):
    tp, pp, dp = layout
    m = gpt3d.CHECK_M
    cfg = tensor_parallel.GPTConfig(vocab_size=97, block_size=8, n_layer=2 * pp, n_head=2 * tp, n_embd=8 * tp)
    groups = grid_groups(env, expected_grid(env.world_size, tp, dp, pp))  # the grader's, not 05.1's and 05.2's
    full = tensor_parallel.init_state_dict(cfg, 3, dtype=F64, random_all=True)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=F64)
    stage = gpt3d.pipeline.stage_model(cfg, groups.pp, group=groups.tp, dtype=F64)
    for model in (serial, stage):
        model.load_full_state_dict(full)
    idx, targets = torch.randint(cfg.vocab_size, (2, dp * m * 2, 8), generator=torch.Generator().manual_seed(4))
    unequal_counts(targets, dp * m)  # replica 0's first microbatch counts none: the replicas count unequally
    ref_loss = serial(idx, targets)[1]
    ref_loss.backward()
    trainers_adamw(serial.parameters()).step()
    loss = gpt3d.ptd_p_step(stage, trainers_adamw(stage.parameters()), idx, targets, groups, m)
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


def _grid_embed_at_pp_1(world, tp=1, dp=1, pp=1):
    grid = gpt3d.rank_grid(world, tp, dp, pp)
    grid["embed"] = [[g[0], g[-1]] for g in grid["pp"]]  # the mistake: at pp = 1 too, where no stage pair exists
    return grid


def _groups_only_mine(env, grid, timeout_s=60.0):
    mine = dict(embed=None)
    for kind, groups in grid.items():
        for ranks in groups:
            if env.rank in ranks:  # only the groups that hold this rank are made here
                mine[kind] = gpt3d.dist.new_group(ranks, timeout=gpt3d.timedelta(seconds=timeout_s))  # the mistake
    return gpt3d.Groups(**mine)


def _groups_last_kept(env, grid, timeout_s=60.0):
    mine = dict(embed=None)
    for kind, groups in grid.items():
        for ranks in groups:
            mine[kind] = gpt3d.dist.new_group(ranks, timeout=gpt3d.timedelta(seconds=timeout_s))  # the mistake
    return gpt3d.Groups(**mine)


def _groups_no_timeout(env, grid, timeout_s=60.0):
    mine = dict(embed=None)
    for kind, groups in grid.items():
        for ranks in groups:
            group = gpt3d.dist.new_group(ranks)  # the mistake: torch's default timeout, not the run's
            if env.rank in ranks:
                mine[kind] = group
    return gpt3d.Groups(**mine)


def _groups_subgroups_of_every_kind(env, grid, timeout_s=60.0):
    mine, timeout = {}, gpt3d.timedelta(seconds=timeout_s)
    for kind, groups in grid.items():  # torch's helper: every group of a kind in one collective call, in order
        mine[kind], _ = gpt3d.dist.new_subgroups_by_enumeration(groups, timeout=timeout)  # the mistake
    return gpt3d.Groups(**mine)


def _adamw_decays_everything(params, lr=gpt3d.CHECK_LR):
    return torch.optim.AdamW(list(params), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)  # the mistake: one group


def _adamw_default_betas(params, lr=gpt3d.CHECK_LR):
    params = list(params)
    two, one = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": two}, {"params": one, "weight_decay": 0.0}], lr=lr, weight_decay=0.1)  # the mistake


def _adamw_generator_twice(params, lr=gpt3d.CHECK_LR):
    two, one = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]  # params: used up by the first
    return torch.optim.AdamW([{"params": two}, {"params": one, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                             weight_decay=0.1)


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


def _step_not_averaged(stage, opt, idx, targets, groups, m):  # the replicas' gradients left as each computed them
    dp = torch.distributed.get_world_size(groups.dp)
    idx, targets = gpt3d.data_parallel.shard_batch(idx, targets, dp, torch.distributed.get_rank(groups.dp))
    microbatches = list(zip(idx.chunk(m), targets.chunk(m)))
    weights = gpt3d.data_parallel.replica_loss_weights(microbatches, groups.dp)
    opt.zero_grad()
    loss = gpt3d.pipeline.one_f_one_b_step(stage, microbatches, groups.pp, weights)
    opt.step()
    if loss is not None:
        torch.distributed.all_reduce(loss, group=groups.dp)
        loss = loss / dp
    return loss


EXERCISES = [
    Exercise("05.1", "rank_grid", "the rank grid: tp fastest, then dp, then pp", ("rank_grid",),
             "Narayanan et al. 2021, Section 3", check_rank_grid, lambda: {"rank_grid": REFERENCE["rank_grid"]},
             [Planted("grid_dp_fastest", "the grid puts dp fastest, so a tp group spans nodes",
                      lambda: {"rank_grid": _grid_dp_fastest}, "a tp group is tp adjacent ranks"),
              Planted("grid_embed_at_pp_1", "an embed group at pp = 1, where the embedding is not tied across stages",
                      lambda: {"rank_grid": _grid_embed_at_pp_1}, "none at pp = 1")]),
    Exercise("05.2", "new_groups", "the process groups: every rank makes every group, in order",
             ("new_groups",), "Narayanan et al. 2021, Section 3; torch.distributed.new_group", check_new_groups,
             lambda: {"new_groups": REFERENCE["new_groups"]},
             [Planted("groups_only_mine", "each rank makes only the groups that hold it",
                      lambda: {"new_groups": _groups_only_mine}, "member or not, in the same order", at_line=True),
              Planted("groups_last_kept", "each kind keeps the last group made, not the rank's own",
                      lambda: {"new_groups": _groups_last_kept}, "keep, of each kind, the group that holds env.rank",
                      at_line=True),
              Planted("groups_no_timeout", "the groups are made without the run's timeout",
                      lambda: {"new_groups": _groups_no_timeout}, "a group's own timeout bounds the collectives",
                      at_line=True),
              Planted("groups_subgroups_empty_embed", "dist.new_subgroups_by_enumeration for every kind, the "
                      "empty embed list at pp = 1 too", lambda: {"new_groups": _groups_subgroups_of_every_kind},
                      "makes no group, and every rank's Groups has None for it", at_line=True)]),
    Exercise("05.3", "adamw", "the trainer's AdamW: weight decay on the 2-D weights only", ("adamw",),
             "Narayanan et al. 2021, Section 3 (each rank updates what it holds); Loshchilov and Hutter 2019",
             check_adamw,
             lambda: {"adamw": REFERENCE["adamw"]},
             [Planted("adamw_decays_everything", "one parameter group: biases and LayerNorms decay too",
                      lambda: {"adamw": _adamw_decays_everything}, "weight decay is for the 2-D weights only",
                      at_line=True),
              Planted("adamw_default_betas", "torch's default betas, (0.9, 0.999)",
                      lambda: {"adamw": _adamw_default_betas}, "the trainer's are (0.9, 0.95)", at_line=True),
              Planted("adamw_generator_twice", "params, a generator, read twice: the second group is empty",
                      lambda: {"adamw": _adamw_generator_twice}, "make it a list first")]),
    Exercise("05.4", "ptd_p_step", "one PTD-P step from the earlier chapters' lessons", ("ptd_p_step",),
             "Narayanan et al. 2021, Section 3; docs/LOSS.md", check_ptd_p_step,
             lambda: {"ptd_p_step": REFERENCE["ptd_p_step"]},
             [Planted("step_replica_means", "each replica's own mean loss, the replicas averaged (1/dp)",
                      lambda: {"ptd_p_step": _step_replica_means}, "n counted over the dp replicas"),
              Planted("step_not_averaged", "the gradients are not all-reduced over the dp replicas",
                      lambda: {"ptd_p_step": _step_not_averaged}, "as allreduce_gradients averages")]),
]
