"""The checks of 03's exercises (exercises/ex03_interleaved.py), and the planted wrong answers.

03.1, the layer assignment, is a pure function, checked first without any process for every pp up
to 6 and v up to 4 against its definition; then 2 CPU ranks with v = 2 chunks each, built from the
student's layer ranges, execute 03's interleaved lists with 02's executor. 03.2 is the lesson's
loop, interleaved_step: it runs on CPU ranks (pp = 2, v = 2, m = 4: steady pairs; pp = 3, v = 2,
m = 3: a warm-up cut at m v; pp = 1, v = 2: the hand-over on one rank), on chunks the grader builds,
float64, on a batch whose microbatches count unequal numbers of targets (one none), and the loss
and every gradient are compared with the serial model's (1e-10). Its forwards, backwards and the
receives of each interleaved.exchange are watched against 03's machine's list (interleaved, from
chunk_and_microbatch: the paper's order and warm-up), and a receive the schedule would not yet post
stops the rank at once, saying so (checks_02.Watch), instead of a deadlock. The tied embedding is
summed by the grader's stand-in for 02.3's sum_tied_grads. Nothing expected comes from 03's own
interleaved_step, which the student copy replaces by the stub.
"""
import torch
import torch.distributed as dist

from exercises.autograder import Exercise, Mistake, Planted, called, differences, first, installed, new_group, numbered, ranks
from exercises.checks_02 import ROWS, T, Watch, compared, diagnoses_first, serial_reference, summed_by_the_grader

tensor_parallel = numbered("01_tensor_parallel")
pipeline = numbered("02_pipeline_1f1b")
interleaved = numbered("03_interleaved")
F64 = torch.float64
REFERENCE = {"chunk_layers": interleaved.chunk_layers, "interleaved_step": interleaved.interleaved_step}


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
# 03.2 The lesson's interleaved_step on CPU ranks, against the serial model


def _chunks(cfg, pp, v, r):
    """Rank r's v chunks from the layer ranges 03.1 asks for (built here, so 03.2 is graded alone)."""
    per, out = cfg.n_layer // (pp * v), []
    for c, layers in enumerate([range((c * pp + r) * per, (c * pp + r + 1) * per) for c in range(v)]):
        k = c * pp + r  # the virtual stage: the first holds the embeddings, the last the head
        out.append(tensor_parallel.GPT(cfg, None, layers=layers, pre_process=k == 0, post_process=k == pp * v - 1,
                                       init=False, dtype=F64))
    return out


def _lesson(env, step, v, ref):
    pp, r, m = env.world_size, env.rank, ref["m"]
    embed_group = new_group([0, pp - 1]) if pp > 1 else None
    chunks = [c.load_full_state_dict(ref["full"]) for c in _chunks(ref["cfg"], pp, v, r)]
    micro = list(zip(ref["idx"].chunk(m), ref["targets"].chunk(m)))
    expected = [(a.kind, a.chunk, a.mb) for a in interleaved.interleaved(pp, m, r, v)]
    watch, calls = Watch("interleaved", r, pp, expected, chunks, micro), []
    real_exchange, listed = interleaved.exchange, interleaved.interleaved(pp, m, r, v)
    # The schedule's steps: a steady forward and the backward after it are one step (no exchange between).
    steps = []
    for a in listed:
        pair = steps and a.steady and a.kind == "B" and len(steps[-1]) == 1 and steps[-1][0].steady
        steps[-1].append(a) if pair else steps.append([a])
    bounds, at = [0], 0
    for group in steps:
        at += len(group)
        bounds.append(at)
    exchanges = []  # how many actions had run at each exchange

    def exchange(sends, receives, box, like):  # each receive checked against the schedule before it is posted
        done = len(watch.done)
        if done not in bounds:  # inside a steady pair
            raise Mistake(f"{watch.place()}: an exchange between the steady forward and its backward; 03 runs the "
                          f"pair back to back with no boundary between (with v chunks, a boundary there can make "
                          f"two ranks wait on each other)")
        exchanges.append(done)
        for kind, k, i in receives:
            p = expected.index((kind, k // pp, i)) if (kind, k // pp, i) in expected else None
            steady_pair = p is not None and kind == "B" and len(watch.done) == p - 1 and expected[p - 1][0] == "F"
            watch.awaits(kind, k // pp, i, pending=int(steady_pair))
        return real_exchange(sends, receives, box, like)

    holding = lambda stage: [c for c in chunks if "wte" in c.transformer]  # noqa: E731
    with installed(*watch.lesson_pieces(messages=False), (interleaved, "exchange", exchange),
                   (pipeline, "sum_tied_grads", summed_by_the_grader(holding, embed_group, calls))):
        try:
            loss = step(chunks, micro)
        except Exception as e:  # noqa: BLE001 - the student's loop raised: where was it in the schedule?
            j = len(exchanges) - 1  # the step it was in: the one after its last exchange
            if exchanges and j < len(steps) and len(watch.done) >= bounds[j + 1] and not steps[j][0].steady \
                    and steps[j][0].kind == "F":
                raise Mistake(f"{watch.place()}: it raised {type(e).__name__}: {e} in its step {j}, after that step's "
                              f"forward had run, where the schedule's step {j} is a warm-up forward alone (an action "
                              f"run early: its forward has not run, or its gradient has not arrived): "
                              + watch.interleaved_why("B", ("F",))) from e
            raise
    left = expected[len(watch.done):]
    if left and watch.done:  # none watched: the loop does its arithmetic itself (serial decides)
        return [f"rank {r}: the step ended after {len(watch.done)} actions; interleaved 1F1B runs {len(expected)} "
                f"(every microbatch forward and backward once on each of the {v} chunks)"]
    return compared(env, loss, chunks, ref, calls, r == pp - 1)


def check_interleaved_step(impl):
    for pp, v, m in ((2, 2, 4), (3, 2, 3), (1, 2, 2)):  # steady pairs; a warm-up cut at m v; one rank
        ref = serial_reference(pp * v, m, unequal=True)
        where = f"pp={pp}, v={v}, m={m}, interleaved 1F1B on {pp} CPU rank{'s' * (pp > 1)} against the serial model: "
        bad = first(diagnoses_first([where + x for rs in ranks(_lesson, pp, impl["interleaved_step"], v, ref)
                                     for x in rs]), 3)
        if bad:
            return bad
    return []


# ----------------------------------------------------------------------------------------------
# Planted wrong answers


def _layers_rank_major(n_layer, pp, v, rank):  # rank r holds v consecutive stages: that is not interleaving
    per = n_layer // (pp * v)
    return [range((rank * v + c) * per, (rank * v + c + 1) * per) for c in range(v)]


def _interleaved_planted(delta=0, chunk_major=False, tied=True):
    """The lesson's loop with one thing changed: the warm-up by delta forwards, every microbatch
    through chunk 0 before any reaches chunk 1, or the tied embedding left unsummed."""
    def interleaved_step(chunks, microbatches):
        r, pp, v, m = dist.get_rank(), dist.get_world_size(), len(chunks), len(microbatches)
        S, n, w, losses = pp * v, m * v, pipeline.loss_weights(microbatches), []
        like = next(chunks[0].parameters()).new_empty(*microbatches[0][0].shape, chunks[0].cfg.n_embd)
        warmup = max(0, min(2 * (pp - r - 1) + (v - 1) * pp + delta, n))

        def order(k, forward):
            if chunk_major:
                return (k // m if forward else v - 1 - k // m), k % m
            return interleaved.chunk_and_microbatch(k, pp, v, forward)
        fwd, bwd = ([(kind, *order(k, kind == "F")) for k in range(n)] for kind in "FB")
        steps = [[f] for f in fwd[:warmup]] + [[f, b] for f, b in zip(fwd[warmup:], bwd)] + \
            [[b] for b in bwd[n - warmup:]]
        box, flight, sends, src = {}, {}, {}, {"F": -1, "B": 1}
        for step in steps + [[]]:
            interleaved.exchange(sends, {(kind, c * pp + r, i): (r + src[kind]) % pp for kind, c, i in step
                                         if pp > 1 and 0 <= c * pp + r + src[kind] < S}, box, like)
            sends = {}
            for kind, c, i in step:
                k, x = c * pp + r, box.pop((kind, c * pp + r, i), None)
                if kind == "F":
                    flight[c, i] = pipeline.forward_step(chunks[c], microbatches[i], x, w[i], losses)
                    out, dst = flight[c, i][1].detach(), k + 1
                else:
                    out, dst = pipeline.backward_step(*flight.pop((c, i)), x), k - 1
                if 0 <= dst < S:
                    (sends if pp > 1 else box)[(kind, dst, i)] = out
        if pp > 1 and tied:
            pipeline.sum_tied_grads(chunks[0] if r == 0 else chunks[-1])
        elif pp == 1:
            first_, last = (c.transformer.wte.weight.grad for c in (chunks[0], chunks[-1]))
            last.copy_(first_.add_(last))
        return sum(losses) if r == pp - 1 else None
    return interleaved_step


EXERCISES = [
    Exercise("03.1", "chunk_layers", "which layers each rank holds: v chunks, round robin", ("chunk_layers",),
             "Narayanan et al. 2021, Section 2.2.2", check_chunk_layers,
             lambda: {"chunk_layers": REFERENCE["chunk_layers"]},
             [Planted("layers_rank_major", "rank r holds v consecutive virtual stages",
                      lambda: {"chunk_layers": _layers_rank_major}, "chunk c is virtual stage c * pp + rank")]),
    Exercise("03.2", "interleaved_step", "interleaved 1F1B, the lesson's loop: order and warm-up",
             ("interleaved_step",), "Narayanan et al. 2021, Section 2.2.2 (Figure 4, bottom)", check_interleaved_step,
             lambda: {"interleaved_step": REFERENCE["interleaved_step"]},
             [Planted("interleaved_warmup_short", "the warm-up is one forward short",
                      lambda: {"interleaved_step": _interleaved_planted(delta=-1)}, "warm-up too short"),
              Planted("chunk_major_order", "every microbatch goes through chunk 0 before any reaches chunk 1",
                      lambda: {"interleaved_step": _interleaved_planted(chunk_major=True)},
                      "groups of pp = 2 microbatches go through chunk 0, then chunk 1"),
              Planted("interleaved_tied_not_summed", "the loop never calls sum_tied_grads",
                      lambda: {"interleaved_step": _interleaved_planted(tied=False)},
                      "the step never called pipeline.sum_tied_grads")]),
]
