"""The checks of 02's exercises (exercises/ex02_pipeline_1f1b.py), and the planted wrong answers.

A schedule is checked without any process first, for every pp up to 6 and m up to 12: it must be a
list of Actions that 02's validate() accepts, whose first backward comes where the schedule's
definition puts it, which keeps the microbatches in flight and the bubble that simulate() should
find, and which equals 02's own list. Then it runs: pp = 4 CPU ranks run it through 02's own
pipeline_step (the chunks built, the lists executed, the tied embedding synced), and the loss and
every gradient are compared with the serial model's (float64, 1e-10). The tied embedding is checked
after 02's executor, as 05's train_step calls it (gradients where grad_of says), on 2 ranks, and on
1 rank that holds two chunks.
"""
from fractions import Fraction

import torch
import torch.distributed as dist

from exercises.autograder import Exercise, Planted, StudentError, called, differences, first, new_group, \
    numbered, random_weights, ranks, token_batch

tensor_parallel = numbered("01_tensor_parallel")
pipeline = numbered("02_pipeline_1f1b")
interleaved = numbered("03_interleaved")
F64 = torch.float64
ROWS, T = 2, 8  # each microbatch: (ROWS, T) tokens
REFERENCE = {"gpipe": pipeline.gpipe, "one_f_one_b": pipeline.one_f_one_b,
             "sync_tied_embeddings": pipeline.sync_tied_embeddings}
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


def _tied(env, lists, ref, sync):
    chunks, res, embed_group = _execute(env, lists, ref)
    store = {p: p.grad.clone() for c in chunks for p in c.parameters()}  # where grad_of says they live
    before = {p: g.clone() for p, g in store.items()}
    sync(chunks, embed_group, grad_of=store.__getitem__)
    out, key = [], "transformer.wte.weight"
    for i, c in enumerate(chunks):
        if "wte" not in c.transformer:
            continue
        p = c.transformer.wte.weight
        copy = f"rank {env.rank}'s copy of {key}" + (f" (chunk {i})" if len(chunks) > 1 else "")
        part = "the lookup's" if c.pre_process else "the output layer's"
        found = differences([(copy, store[p], ref["grads"][key],
                              [(before[p], f"it holds only its own part of the gradient ({part}): add the other "
                                           f"copy's part" + (", an all-reduce over embed_group" if embed_group
                                                             else ", held by this rank's other chunk"))])],
                            factors={"2": 2})
        if found and not differences([("", p.grad, ref["grads"][key])]):
            found = [f"{copy}: p.grad was updated, but the gradient lives in grad_of(p): update that"]
        out += found
    return out


def check_sync_tied_embeddings(impl):
    sync = impl["sync_tied_embeddings"]
    two_ranks = [pipeline.one_f_one_b(2, 4, s) for s in range(2)]
    reasons = [r for rs in ranks(_tied, 2, two_ranks, serial_reference(2, 4), sync) for r in rs]
    if not reasons:  # one rank holding two chunks (pp = 1, v = 2), then one holding one (pp = v = 1)
        for v in (2, 1):
            reasons += [f"pp=1, v={v}: {r}" for rs in ranks(_tied, 1, [interleaved.interleaved(1, 2, 0, v)],
                                                             serial_reference(v, 2), sync) for r in rs]
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


def _sync_nothing(chunks, embed_group, grad_of=lambda p: p.grad):
    pass


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
    Exercise("02.3", "sync_tied_embeddings", "the tied embedding's gradient across stages",
             ("sync_tied_embeddings",), "Shoeybi et al. 2019, Section 3 (the shared embedding)",
             check_sync_tied_embeddings, lambda: {"sync_tied_embeddings": REFERENCE["sync_tied_embeddings"]},
             [Planted("tied_not_synced", "the copies of the tied embedding are left as they are",
                      lambda: {"sync_tied_embeddings": _sync_nothing}, "it holds only its own part of the gradient")]),
]
