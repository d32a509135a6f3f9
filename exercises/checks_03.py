"""The checks of 03's exercises (exercises/ex03_interleaved.py), and the planted wrong answers.

Both are pure functions, checked first without any process for every pp up to 6 and v up to 4:
the layer assignment against its definition, the schedule through 02's validate() and simulate()
and against its definition (order, warmup). Then each runs: 2 CPU ranks with v = 2 chunks each
execute 03's schedule with 02's executor on chunks built from the student's layer ranges, or run
the student's schedule through 02's own pipeline_step, and the loss and every gradient are compared
with the serial model's (float64, 1e-10).
"""
from fractions import Fraction

import torch
import torch.distributed as dist

from exercises.autograder import Exercise, Planted, called, differences, first, new_group, numbered, ranks
from exercises.checks_02 import ROWS, T, first_difference, lists_of, name, serial_reference, validated

tensor_parallel = numbered("01_tensor_parallel")
pipeline = numbered("02_pipeline_1f1b")
interleaved = numbered("03_interleaved")
F64 = torch.float64
REFERENCE = {"chunk_layers": interleaved.chunk_layers, "interleaved": interleaved.interleaved}
LEGAL = [(pp, v, m) for pp in range(1, 7) for v in range(1, 5) for m in range(pp, 13, pp)]


def _run(env, lists, ref, layers_of):
    """Run this rank's list: through 02's pipeline_step (layers_of None: 02's own chunks), or with
    02's executor on chunks holding layers_of(n_layer, pp, v, rank)."""
    schedule, cfg = interleaved.InterleavedSchedule(lists), ref["cfg"]
    pp, v = schedule.pp, schedule.v
    embed_group = new_group([0, pp - 1]) if pp > 1 else None
    micro = pipeline.split_batch(ref["idx"], ref["targets"], ref["m"])
    if layers_of is None:
        chunks, res = pipeline.pipeline_step(cfg, schedule, dist.group.WORLD, embed_group, ref["full"], micro)
    else:
        chunks = []
        for c, layers in enumerate(layers_of(cfg.n_layer, pp, v, env.rank)):
            k = c * pp + env.rank  # the virtual stage: the first holds the embeddings, the last the head
            chunk = tensor_parallel.GPT(cfg, None, layers=layers, pre_process=k == 0, post_process=k == pp * v - 1,
                                        init=False, dtype=F64)
            chunk.load_full_state_dict(ref["full"])
            chunks.append(chunk)
        res = pipeline.execute(schedule, chunks, dist.group.WORLD, micro, pipeline.Wire((ROWS, T, cfg.n_embd)))
        pipeline.sync_tied_embeddings(chunks, embed_group)
    pairs = [("the loss", res.loss, ref["loss"])] if res.loss is not None else []
    pairs += [(f"the gradient of {n}", p.grad, ref["grads"][n]) for c in chunks for n, p in c.named_parameters()]
    return [f"rank {env.rank}: {r}" for r in differences(pairs)]


def run(lists, v, m, layers_of=None):
    pp = len(lists)
    where = f"run on {pp} CPU ranks with 02's {'pipeline_step' if layers_of is None else 'executor'} (v={v}, m={m}), "
    reasons = ranks(_run, pp, lists, serial_reference(pp * v, m), layers_of)
    return first([where + r for rs in reasons for r in rs], 3)


# ----------------------------------------------------------------------------------------------
# 03.1 chunk_layers


def check_chunk_layers(impl):
    fn = impl["chunk_layers"]
    for pp in range(1, 7):
        for v in range(1, 5):
            n_layer = 2 * pp * v
            per = n_layer // (pp * v)
            for r in range(pp):
                got = called(fn, n_layer, pp, v, r, what=f"chunk_layers({n_layer}, {pp}, {v}, {r})")
                want = [range((c * pp + r) * per, (c * pp + r + 1) * per) for c in range(v)]
                if list(map(_as_range, got or [])) != want:
                    shown = ", ".join(f"layers {x.start}-{x.stop - 1}" for x in want)
                    return [f"chunk_layers({n_layer}, pp={pp}, v={v}, rank={r}) = {_show(got)}; rank {r} holds "
                            f"virtual stages {', '.join(str(c * pp + r) for c in range(v))} of {pp * v}, each "
                            f"{per} layers: {shown} (0-based): chunk c is virtual stage c * pp + rank"]
    return run([interleaved.interleaved(2, 4, s, 2) for s in range(2)], 2, 4, fn)


def _as_range(x):
    return x if isinstance(x, range) else range(x[0], x[-1] + 1) if isinstance(x, (list, tuple)) and x else x


def _show(got):
    try:
        return "[" + ", ".join(f"range({x.start}, {x.stop})" if isinstance(x, range) else repr(x) for x in got) + "]"
    except TypeError:
        return repr(got)


# ----------------------------------------------------------------------------------------------
# 03.2 The interleaved schedule


def order_of(pp, v, k, forward):
    """(chunk, microbatch) of a rank's k-th forward (or backward) in Megatron's interleaved order:
    the definition the check holds the lists to (03's own `at`, written from the paper's text)."""
    chunk, mb = (k % (pp * v)) // pp, (k // (pp * v)) * pp + k % pp
    return (chunk if forward else v - 1 - chunk), mb


def check_interleaved_lists(fn):
    for pp, v, m in LEGAL:
        where = f"pp={pp}, v={v}, m={m}"
        lists = lists_of(fn, pp, m, v, what="interleaved")
        if v == 1:
            diff = next(filter(None, (first_difference(a, pipeline.one_f_one_b(pp, m, s), f"{where}, rank {s}",
                                                       "02's 1F1B") for s, a in enumerate(lists))), None)
            if diff:
                return [diff + " (with v = 1, interleaving is 1F1B)"]
            continue
        bad = _order(lists, pp, v, m, where) or _warmups(lists, pp, v, m, where)
        if bad:
            verdict = validated(lists, pp, m, where, interleaved.InterleavedSchedule)
            return [bad + (f" ({verdict.split(': ', 1)[1]})" if verdict else "")]
        bad = validated(lists, pp, m, where, interleaved.InterleavedSchedule)
        if bad:
            return [bad]
        sim = pipeline.simulate(pipeline.Schedule(lists), Fraction(1, v), Fraction(2, v))
        if sim.bubble != Fraction(pp - 1, v * m):
            return [f"{where}: the simulated bubble is {sim.bubble}, not (pp - 1)/(v m) = {Fraction(pp - 1, v * m)}"]
        diff = next(filter(None, (first_difference(a, interleaved.interleaved(pp, m, s, v), f"{where}, rank {s}",
                                                   "03's interleaved") for s, a in enumerate(lists))), None)
        if diff:
            return [diff]
    return []


def _order(lists, pp, v, m, where):
    for s, acts in enumerate(lists):
        for kind, forward in (("F", True), ("B", False)):
            mine = [a for a in acts if a.kind == kind]
            for k, a in enumerate(mine):
                chunk, mb = order_of(pp, v, k, forward)
                if (a.chunk, a.mb) != (chunk, mb):
                    step = "forward" if forward else "backward"
                    return (f"{where}, rank {s}: {step} number {k} is {name(a)}, microbatch {a.mb} on chunk "
                            f"{a.chunk}; the interleaved order runs microbatch {mb} on chunk {chunk} there: groups "
                            f"of pp={pp} microbatches go through chunk {'0, then 1, ...' if forward else 'v - 1, then v - 2, ...'}"
                            f", before the next group starts")
            if len(mine) != m * v:
                return f"{where}, rank {s}: {len(mine)} {kind} actions, not m v = {m * v}"
    return None


def _warmups(lists, pp, v, m, where):
    for s, acts in enumerate(lists):
        got = next((i for i, a in enumerate(acts) if a.kind == "B"), len(acts))
        warm = min((pp - s - 1) * 2 + (v - 1) * pp, m * v)
        want = warm + (warm < m * v)  # then the first steady forward
        if got != want:
            return (f"{where}, rank {s}: {got} forward{'s' * (got != 1)} before the first backward, where the interleaved schedule "
                    f"runs {want}: a warmup of 2 (pp - rank - 1) + (v - 1) pp = {(pp - s - 1) * 2 + (v - 1) * pp} "
                    f"(at most m v = {m * v}), then the first steady forward")
        steady = [i for i, a in enumerate(acts) if a.steady]
        if steady != list(range(warm, warm + 2 * (m * v - warm))):
            return (f"{where}, rank {s}: steady=True on actions {steady[:6]}{' ...' if len(steady) > 6 else ''}; "
                    f"the steady pairs are the {m * v - warm} forward-backward pairs after the warmup of {warm}")
    return None


def check_interleaved(impl):
    fn = impl["interleaved"]
    bad = check_interleaved_lists(fn)
    if bad:
        return bad
    lists = [called(fn, 2, 4, s, 2, what=f"interleaved(2, 4, {s}, 2)") for s in range(2)]
    return run(lists, 2, 4)


# ----------------------------------------------------------------------------------------------
# Planted wrong answers


def _layers_rank_major(n_layer, pp, v, rank):  # rank r holds v consecutive stages: that is not interleaving
    per = n_layer // (pp * v)
    return [range((rank * v + c) * per, (rank * v + c + 1) * per) for c in range(v)]


def _interleaved_warmup(delta):
    def schedule(pp, m, stage, v):
        if v == 1:
            return pipeline.one_f_one_b(pp, m, stage)
        at = lambda k, fwd: pipeline.Action("F" if fwd else "B", order_of(pp, v, k, fwd)[1], order_of(pp, v, k, fwd)[0])  # noqa: E731
        total = m * v
        warm = max(0, min((pp - stage - 1) * 2 + (v - 1) * pp + delta, total))
        acts = [at(k, True) for k in range(warm)]
        for i in range(total - warm):
            f, b = at(warm + i, True), at(i, False)
            acts += [pipeline.Action("F", f.mb, f.chunk, steady=True), pipeline.Action("B", b.mb, b.chunk, steady=True)]
        return acts + [at(k, False) for k in range(total - warm, total)]
    return schedule


def _chunk_major_order(pp, m, stage, v):  # every microbatch through chunk 0 before any reaches chunk 1
    if v == 1:
        return pipeline.one_f_one_b(pp, m, stage)
    acts = interleaved.interleaved(pp, m, stage, v)
    fwd = iter([(k // m, k % m) for k in range(m * v)])
    out = []
    for a in acts:
        if a.kind == "F":
            c, mb = next(fwd)
            a = pipeline.Action("F", mb, c, steady=a.steady)
        out.append(a)
    return out


EXERCISES = [
    Exercise("03.1", "chunk_layers", "which layers each rank holds: v chunks, round robin", ("chunk_layers",),
             "Narayanan et al. 2021, Section 2.2.2", check_chunk_layers,
             lambda: {"chunk_layers": REFERENCE["chunk_layers"]},
             [Planted("layers_rank_major", "rank r holds v consecutive virtual stages",
                      lambda: {"chunk_layers": _layers_rank_major}, "chunk c is virtual stage c * pp + rank")]),
    Exercise("03.2", "interleaved", "the interleaved 1F1B schedule: its order and its warmup", ("interleaved",),
             "Narayanan et al. 2021, Section 2.2.2 (Figure 4, bottom)", check_interleaved,
             lambda: {"interleaved": REFERENCE["interleaved"]},
             [Planted("interleaved_warmup_short", "the warmup is one forward short",
                      lambda: {"interleaved": _interleaved_warmup(-1)}, "a warmup of 2 (pp - rank - 1) + (v - 1) pp"),
              Planted("chunk_major_order", "every microbatch goes through chunk 0 before any reaches chunk 1",
                      lambda: {"interleaved": _chunk_major_order}, "microbatches go through chunk 0, then 1")]),
]
