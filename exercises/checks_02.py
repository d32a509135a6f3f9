"""The checks of 02's exercises (exercises/ex02_pipeline_1f1b.py), and the planted wrong answers.

A schedule is checked without any process first, for every pp up to 6 and m up to 12: it must be a
list of Actions that 02's validate() accepts, whose first backward comes where the schedule's
definition puts it, which keeps the microbatches in flight and the bubble that simulate() should
find, and which equals 02's own list. Then it runs: pp = 4 CPU ranks run it through 02's own
pipeline_step (the chunks built, the lists executed, the tied embedding synced), and the loss and
every gradient are compared with the serial model's (float64, 1e-10). The tied embedding's sum is
checked inside 02's lesson: one_f_one_b_step on 2 ranks and on 1, the student's sum_tied_grads in
place of 02's, against the serial model's loss and every gradient.
"""
from fractions import Fraction

import torch
import torch.distributed as dist

from exercises.autograder import Exercise, Planted, StudentError, called, differences, first, installed, \
    new_group, numbered, random_weights, ranks, token_batch

tensor_parallel = numbered("01_tensor_parallel")
pipeline = numbered("02_pipeline_1f1b")
interleaved = numbered("03_interleaved")
F64 = torch.float64
ROWS, T = 2, 8  # each microbatch: (ROWS, T) tokens
REFERENCE = {"gpipe": pipeline.gpipe, "one_f_one_b": pipeline.one_f_one_b,
             "sum_tied_grads": pipeline.sum_tied_grads}
CASES = [(pp, m) for pp in range(1, 7) for m in range(1, 13)]


def pipeline_cfg(n_layer):
    return tensor_parallel.GPTConfig(vocab_size=97, block_size=T, n_layer=n_layer, n_head=2, n_embd=16)


def name(a):
    return str(a) if isinstance(a, pipeline.Action) else repr(a)


# ----------------------------------------------------------------------------------------------
# Schedules, read without running them


def lists_of(fn, pp, m, *extra, what):
    """Every stage's list from fn(pp, m, stage, *extra); a StudentError if one is not a list of
    pipeline.Action."""
    out = []
    for s in range(pp):
        acts = called(fn, pp, m, s, *extra, what=f"{what}({pp}, {m}, {s}{''.join(f', {x}' for x in extra)})")
        if not isinstance(acts, list) or not all(isinstance(a, pipeline.Action) for a in acts):
            raise StudentError(f"{what}({pp}, {m}, {s}) returned {acts!r:.80}, not a list of pipeline.Action")
        out.append(acts)
    return out


def validated(lists, pp, m, where, schedule=pipeline.Schedule):
    """None if 02's validate() accepts the lists (as a `schedule`: 03 passes its own), else its reason."""
    try:
        pipeline.validate(schedule(lists), m)
    except pipeline.ScheduleError as e:
        return f"{where}: 02's validate() refuses the lists: {e}"
    return None


def first_difference(got, want, where, why):
    """Where two lists first differ, in words; None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"{where}: action {i} is {name(a)}, {why} runs {name(b)} there"
    if len(got) != len(want):
        return f"{where}: {len(got)} actions, {why} has {len(want)}"
    return None


def check_gpipe_lists(fn):
    for pp, m in CASES:
        lists, where = lists_of(fn, pp, m, what="gpipe"), f"pp={pp}, m={m}"
        for s, acts in enumerate(lists):
            forwards = [a for a in acts if a.kind == "F"]
            if acts[:len(forwards)] != forwards:
                return [f"{where}, stage {s}: a backward before the last forward ({' '.join(map(name, acts[:8]))} "
                        f"...): GPipe runs every forward first (Narayanan et al. 2021, Figure 3)"]
        bad = validated(lists, pp, m, where) or next(filter(None, (
            first_difference(acts, pipeline.gpipe(pp, m, s), f"{where}, stage {s}", "GPipe (02's gpipe)")
            for s, acts in enumerate(lists))), None)
        if bad:
            return [bad]
    return []


def check_one_f_one_b_lists(fn):
    for pp, m in CASES:
        lists, where = lists_of(fn, pp, m, what="one_f_one_b"), f"pp={pp}, m={m}"
        bad = validated(lists, pp, m, where)
        if bad:
            return [bad + _warmup_note(lists, pp, m)]
        sim = pipeline.simulate(pipeline.Schedule(lists))
        for s, acts in enumerate(lists):
            warmup = next((i for i, a in enumerate(acts) if a.kind == "B"), len(acts))
            want = min(pp - s - 1, m) + (pp - s - 1 < m)  # the warmup, then the first steady forward
            at = f"{where}, stage {s}"
            if warmup != want:
                return [f"{at}: {warmup} forward{'s' * (warmup != 1)} before the first backward, where 1F1B "
                        f"runs {want}: a warmup of pp - stage - 1 = {pp - s - 1} (at most m), then the first "
                        f"steady forward"]
            if sim.peak_in_flight[s] != min(pp - s, m):
                return [f"{at}: {sim.peak_in_flight[s]} microbatches in flight at the peak; 1F1B keeps at most "
                        f"pp - stage = {pp - s} (capped at m): backward the oldest as soon as its gradient "
                        f"can arrive"]
            diff = first_difference(acts, pipeline.one_f_one_b(pp, m, s), at, "1F1B (02's one_f_one_b)")
            if diff:
                return [diff]
        if sim.bubble != Fraction(pp - 1, m):
            return [f"{where}: the simulated bubble is {sim.bubble}, not (pp - 1)/m = {Fraction(pp - 1, m)}"]
    return []


def _warmup_note(lists, pp, m):
    """Why a 1F1B list may deadlock: its warmup against 02's."""
    first_b = lambda acts: next((i for i, a in enumerate(acts) if a.kind == "B"), len(acts))  # noqa: E731
    got = [first_b(acts) for acts in lists]
    want = [first_b(pipeline.one_f_one_b(pp, m, s)) for s in range(pp)]
    if got != want:
        return (f" (forwards before the first backward, per stage: {got}; 1F1B runs {want}: a warmup of "
                f"pp - stage - 1, at most m, then one steady forward)")
    return ""


# ----------------------------------------------------------------------------------------------
# Running a schedule on CPU ranks with 02's executor, against the serial model


def serial_reference(n_layer, m, seed=7):
    cfg = pipeline_cfg(n_layer)
    full = random_weights(cfg, seed)
    idx, targets = token_batch(cfg, ROWS * m, T, seed + 1, ignored=5)  # uneven valid tokens per microbatch
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=F64)
    serial.load_full_state_dict(full)
    loss = serial(idx, targets)[1]
    loss.backward()
    return dict(cfg=cfg, full=full, idx=idx, targets=targets, m=m, loss=loss.detach(),
                grads={n: p.grad for n, p in serial.named_parameters()})


def _execute(env, lists, ref):
    """Build this rank's chunks and run its list with 02's executor, the tied embedding not yet
    synced: (chunks, result, embed_group)."""
    pp, schedule = env.world_size, pipeline.Schedule(lists)
    embed_group = new_group([0, pp - 1]) if pp > 1 else None
    chunks = pipeline.build_chunks(ref["cfg"], pp, env.rank, schedule.v, init=False, dtype=F64)
    for c in chunks:
        c.load_full_state_dict(ref["full"])
    micro = pipeline.split_batch(ref["idx"], ref["targets"], ref["m"])
    res = pipeline.execute(schedule, chunks, dist.group.WORLD, micro, pipeline.Wire((ROWS, T, ref["cfg"].n_embd)))
    return chunks, res, embed_group


def _run(env, lists, ref):
    """This rank's list through 02's own pipeline_step: its chunks built, the list executed, the tied
    embedding's gradients summed (02's sync_tied_embeddings)."""
    pp = env.world_size
    embed_group = new_group([0, pp - 1]) if pp > 1 else None
    micro = pipeline.split_batch(ref["idx"], ref["targets"], ref["m"])
    chunks, res = pipeline.pipeline_step(ref["cfg"], pipeline.Schedule(lists), dist.group.WORLD, embed_group,
                                         ref["full"], micro)
    pairs = [("the loss", res.loss, ref["loss"])] if res.loss is not None else []
    pairs += [(f"the gradient of {n}", p.grad, ref["grads"][n]) for c in chunks for n, p in c.named_parameters()]
    return [f"rank {env.rank}: {r}" for r in differences(pairs, factors={"m": ref["m"]})]


def run_lists(lists, n_layer, m):
    """Execute every rank's list on len(lists) CPU ranks; the differences from the serial model."""
    ref = serial_reference(n_layer, m)
    where = f"run on {len(lists)} CPU ranks with 02's pipeline_step (m={m}), "
    return first([where + r for rs in ranks(_run, len(lists), lists, ref) for r in rs], 3)


def check_gpipe(impl):
    bad = check_gpipe_lists(impl["gpipe"])
    return bad or run_lists([impl["gpipe"](4, 6, s) for s in range(4)], 4, 6)


def check_one_f_one_b(impl):
    bad = check_one_f_one_b_lists(impl["one_f_one_b"])
    return bad or run_lists([impl["one_f_one_b"](4, 6, s) for s in range(4)], 4, 6)


# ----------------------------------------------------------------------------------------------
# 02.3 The tied embedding


def _tied(env, ref):
    """02's lesson, one_f_one_b_step, on this rank's stage with the sum_tied_grads installed (the student's);
    the copy's gradient before the sum is kept, to say what a wrong one holds."""
    stage = pipeline.stage_model(ref["cfg"], dtype=F64).load_full_state_dict(ref["full"])
    micro = pipeline.split_batch(ref["idx"], ref["targets"], ref["m"])
    summing, own = pipeline.sum_tied_grads, {}

    def watched(st, pp_group=None):
        if "wte" in st.transformer and st.transformer.wte.weight.grad is not None:
            own["grad"] = st.transformer.wte.weight.grad.clone()
        return summing(st, pp_group)

    with installed((pipeline, "sum_tied_grads", watched)):
        loss = pipeline.one_f_one_b_step(stage, micro)
    key, pp = "transformer.wte.weight", env.world_size
    pairs = [("the loss", loss, ref["loss"])] if loss is not None else []
    for n, p in stage.named_parameters():
        if n == key and "grad" in own:
            part = "the lookup's" if stage.pre_process and pp > 1 else "the output layer's" if pp > 1 else "both uses'"
            pairs.append((f"rank {env.rank}'s copy of {key}", p.grad, ref["grads"][key],
                          [(own["grad"], f"it holds only its own part of the gradient ({part}): add the other "
                                         f"stage's part (send_recv with the stage at the other end)"),
                           (ref["grads"][key] - own["grad"], "it holds only the other stage's part: add it to "
                                                             "this copy's own gradient, do not replace it")]))
        elif n != key:
            pairs.append((f"the gradient of {n}", p.grad, ref["grads"][n]))
    return [f"rank {env.rank}: {r}" for r in differences(pairs, factors={"2": 2})]


def check_sum_tied_grads(impl):
    reasons = []
    with installed((pipeline, "sum_tied_grads", impl["sum_tied_grads"])):
        for pp in (2, 1):  # two stages, each a copy; one stage holding both uses in one weight
            reasons += [f"pp={pp}: {r}" for rs in ranks(_tied, pp, serial_reference(2, 4)) for r in rs]
            if reasons:
                break
    return first(reasons, 3)


# ----------------------------------------------------------------------------------------------
# Planted wrong answers


def _one_f_one_b_warming_up(warmup_of):
    """1F1B as 02 writes it, with another warmup: warmup_of(pp, stage), capped at m."""
    def schedule(pp, m, stage):
        warmup = max(0, min(warmup_of(pp, stage), m))
        acts = [pipeline.Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [pipeline.Action("F", warmup + i), pipeline.Action("B", i)]
        return acts + [pipeline.Action("B", i) for i in range(m - warmup, m)]
    return schedule


_warmup_too_long = _one_f_one_b_warming_up(lambda pp, s: pp - s)  # one more forward than it takes
_warmup_too_short = _one_f_one_b_warming_up(lambda pp, s: pp - s - 2)  # it runs, but neighbours take turns


def _gpipe_backwards_reversed(pp, m, stage):
    return [pipeline.Action("F", i) for i in range(m)] + [pipeline.Action("B", i) for i in reversed(range(m))]


def _sum_nothing(stage, pp_group=None):
    pass


def _swap_not_add(stage, pp_group=None):  # each end takes the other's part instead of adding it
    s, pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    if pp > 1 and s in (0, pp - 1):
        g = stage.transformer.wte.weight.grad
        g.copy_(pipeline.send_recv(g, pp - 1 - s, g, pp_group))


EXERCISES = [
    Exercise("02.1", "gpipe", "GPipe as a list of actions", ("gpipe",),
             "Huang et al. 2019; Narayanan et al. 2021, Section 2.2.1 (Figure 3)", check_gpipe,
             lambda: {"gpipe": REFERENCE["gpipe"]},
             [Planted("gpipe_backwards_reversed", "GPipe's backwards run newest first",
                      lambda: {"gpipe": _gpipe_backwards_reversed}, "GPipe (02's gpipe) runs B0 there")]),
    Exercise("02.2", "one_f_one_b", "1F1B (PipeDream-Flush) as a list of actions", ("one_f_one_b",),
             "Narayanan et al. 2021, Section 2.2.1 (Figure 4, top); PipeDream-Flush (Narayanan et al. 2021, ICML)",
             check_one_f_one_b, lambda: {"one_f_one_b": REFERENCE["one_f_one_b"]},
             [Planted("warmup_too_long", "1F1B warms up with pp - stage forwards, one too many",
                      lambda: {"one_f_one_b": _warmup_too_long}, "where 1F1B runs 1: a warmup of pp - stage - 1 = 0"),
              Planted("warmup_too_short", "1F1B warms up with pp - stage - 2 forwards, one too few",
                      lambda: {"one_f_one_b": _warmup_too_short}, "1 forward before the first backward, where 1F1B runs 2")]),
    Exercise("02.3", "sum_tied_grads", "the tied embedding's gradient across stages",
             ("sum_tied_grads",), "Shoeybi et al. 2019, Section 3 (the shared embedding)",
             check_sum_tied_grads, lambda: {"sum_tied_grads": REFERENCE["sum_tied_grads"]},
             [Planted("tied_not_summed", "the copies of the tied embedding are left as they are",
                      lambda: {"sum_tied_grads": _sum_nothing}, "it holds only its own part of the gradient"),
              Planted("tied_swapped", "each end takes the other's part instead of adding it",
                      lambda: {"sum_tied_grads": _swap_not_add}, "it holds only the other stage's part")]),
]
