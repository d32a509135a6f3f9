"""The checks of 06's exercises (exercises/ex06_zero_bubble.py), and the planted wrong answers.

06.1 (SplitLinear and weight_grads) runs in this process, float64, against autograd's whole backward
of the same layer (F.linear): one layer with a bias and one without, on (2, 3, n_in) inputs: Y; at I,
X's and the bias's gradient, none yet for the weight, something kept; at W, the weight's; then a
second microbatch's I and W, whose dW adds to the first's. Then 01's GPT (tp 1) with every linear
layer split by 06's split_linears (which calls the SplitLinear installed) on a batch with ignored
targets: after the backward (every I) and the Ws of what it kept, the loss and every gradient
against the plain GPT's (1e-10).

06.2 (zb_h1_step) runs on CPU ranks, one stage each (02's stage_model, the serial model's weights),
pp = 4 at m = 6 and m = 2 (a warm-up cut at m), float64, on a batch whose microbatches count unequal
numbers of targets (microbatch 0 none): the loss and every gradient against the serial model's
(1e-10). While it runs, 06's SplitLinear and weight_grads are this file's own (so 06.2 needs nothing
of 06.1), each I's kept entries tagged with its microbatch, and the tied embedding is summed by 02's
machine in place of 02.3's sum_tied_grads. Each F, I and W is watched against 06's zb_h1 list for the
rank: a W of nothing, or of entries no I kept yet, or an action where ZB-H1 runs another, stops the
rank at once, saying so at the line of the student's code that ran it.
"""
import inspect
import linecache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from exercises import autograder
from exercises.autograder import Exercise, Mistake, Planted, _short_path, _student_files, differences, first, \
    installed, new_group, numbered, random_weights, ranks, token_batch
from exercises.checks_02 import compared, diagnoses_first, serial_reference, summed_by_the_grader

tensor_parallel = numbered("01_tensor_parallel")
pipeline = numbered("02_pipeline_1f1b")
zero_bubble = numbered("06_zero_bubble")
F64 = torch.float64
REFERENCE = {"SplitLinear": zero_bubble.SplitLinear, "weight_grads": zero_bubble.weight_grads,
             "zb_h1_step": zero_bubble.zb_h1_step}


# ----------------------------------------------------------------------------------------------
# 06.1 SplitLinear and weight_grads, against autograd's whole backward


def _leaf(shape, gen):
    return torch.randn(shape, generator=gen, dtype=F64).requires_grad_()


def _one_layer(split, wgrads, bias):
    """One layer, two microbatches: [reasons]."""
    gen = torch.Generator().manual_seed(3 + bias)
    weight, b = _leaf((4, 5), gen), _leaf((4,), gen) if bias else None
    mine_w = weight.detach().clone().requires_grad_()
    mine_b = None if b is None else b.detach().clone().requires_grad_()
    where = "one layer " + ("with a bias" if bias else "without a bias (a row-parallel layer's, whose bias is after g)")
    total = None
    for mb in range(2):
        x, dy = _leaf((2, 3, 5), gen), torch.randn(2, 3, 4, generator=gen, dtype=F64)
        xx = x.detach().clone().requires_grad_()
        want = F.linear(x, weight, b)
        want.backward(dy)
        dw = weight.grad.clone() - (0 if total is None else total)
        total = weight.grad.clone()
        kept = []
        got = split.apply(xx, mine_w, mine_b, kept)
        at = f"{where}, microbatch {mb}"
        pairs = [(f"{at}: the output Y", None if got is None else got.detach(), want.detach())]
        reasons = differences(pairs)
        if reasons:
            return reasons
        before = None if mine_w.grad is None else mine_w.grad.clone()
        got.backward(dy)
        if mine_w.grad is not None and (before is None or not torch.equal(mine_w.grad, before)):
            return [f"{at}: the weight's gradient changed at I (its backward): I computes X's gradient and the bias's "
                    f"only; dW = dY^T X waits for W, which weight_grads runs later, out of the kept entries (return "
                    f"None for the weight: Qi et al., Section 2, B = I + W)"]
        pairs = [(f"{at}: X's gradient at I", xx.grad, x.grad)]
        if b is not None:
            pairs.append((f"{at}: the bias's gradient at I", mine_b.grad, b.grad))
        reasons = differences(pairs)
        if reasons:
            return reasons
        if not kept:
            return [f"{at}: I kept nothing for W: append what dW = dY^T X needs (the weight, X, dY) to kept"]
        wgrads(kept)
        pairs = [(f"{at}: the weight's gradient after W", mine_w.grad, weight.grad,
                  [(dw if mb else None, "W replaced the weight's gradient by this microbatch's dW: add to it (each "
                                        "microbatch's W adds its share, as autograd accumulates)")])]
        reasons = differences(pairs, factors={"2": 2})
        if reasons:
            return reasons
    return []


def _whole_gpt(split, wgrads):
    """01's GPT (tp 1) with every linear layer split, against the same GPT's plain backward."""
    cfg = tensor_parallel.GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16)
    full = random_weights(cfg, 5)
    idx, targets = token_batch(cfg, 2, 8, 6, ignored=3)
    plain = tensor_parallel.GPT(cfg, None, init=False, dtype=F64).load_full_state_dict(full)
    want = plain(idx, targets)[1]
    want.backward()
    model = tensor_parallel.GPT(cfg, None, init=False, dtype=F64).load_full_state_dict(full)
    kept = []
    with installed((zero_bubble, "SplitLinear", split)):
        zero_bubble.split_linears(model, kept)
        loss = model(idx, targets)[1]
        loss.backward()
    wgrads(list(kept))
    where = "01's GPT (tp 1) with every linear layer split (06's split_linears), after the backward and the Ws"
    pairs = [("the loss", loss.detach(), want.detach())]
    pairs += [(f"the gradient of {n}", p.grad, plain.get_parameter(n).grad) for n, p in model.named_parameters()]
    return [f"{where}: {r}" for r in differences(pairs, factors={"2": 2})]


def _weight_deferred(out, inputs, needs):
    """The guard's rule for a backward's gradients, with the weight's None allowed: I leaves the weight's
    gradient to W (whether I gives the weight one anyway is this file's check, said with the reason)."""
    return GRADIENT_RULE(out, inputs, tuple(False if i == 1 else n for i, n in enumerate(needs)))


GRADIENT_RULE = autograder._gradient_problem


def check_split(impl):
    with installed((autograder, "_gradient_problem", _weight_deferred)):
        for bias in (True, False):
            reasons = _one_layer(impl["SplitLinear"], impl["weight_grads"], bias)
            if reasons:
                return first(reasons)
        return first(_whole_gpt(impl["SplitLinear"], impl["weight_grads"]))


# ----------------------------------------------------------------------------------------------
# 06.2 zb_h1_step on CPU ranks, watched against zb_h1's list


class Kept(tuple):
    """What the grader's I keeps for one layer, tagged with the microbatch whose I kept it."""
    mb = None


def _student_line(codes):
    """" at exercises/ex06_zero_bubble.py:NN in zb_h1_step (its source)": the innermost frame of the student's
    code running now (a frame of a student file whose code is not the grader's)."""
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if code.co_filename in _student_files and code not in codes:
            source = linecache.getline(code.co_filename, frame.f_lineno).strip()
            return f" (at {_short_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}: {source})"
        frame = frame.f_back
    return ""


def _codes(*fns):
    """Every code object of fns and of the functions they define: the grader's own frames."""
    out, todo = set(), [f.__code__ for f in fns]
    while todo:
        code = todo.pop()
        out.add(code)
        todo += [c for c in code.co_consts if inspect.iscode(c)]
    return out


class Watch:
    """This rank's Fs, Is and Ws as zb_h1_step runs them, against zb_h1(pp, m, rank): a step off the list
    raises Mistake at once, naming the student's line."""

    def __init__(self, rank, pp, microbatches):
        self.rank, self.pp, self.microbatches = rank, pp, microbatches
        self.expected = [(a.kind, a.mb) for a in zero_bubble.zb_h1(pp, len(microbatches), rank)]
        self.done, self.outputs, self.current = [], {}, None

    def place(self):
        n = {k: sum(a[0] == k for a in self.done) for k in "FIW"}
        return f"after {n['F']} F, {n['I']} I and {n['W']} W"

    def act(self, kind, mb):
        k = len(self.done)
        want = self.expected[k] if k < len(self.expected) else None
        if (kind, mb) != want:
            there = "nothing more" if want is None else f"{want[0]}{want[1]}"
            raise Mistake(f"{self.place()}: its action number {k} is {kind}{mb}, where ZB-H1 runs {there} there: "
                          f"{self.why(kind, mb, want)}"
                          + _student_line(GRADER))
        self.done.append((kind, mb))

    def why(self, kind, mb, want):
        s = self.rank
        if kind == "W" and want is not None and want[0] == "W":
            return "the Ws run oldest first: W of the oldest microbatch whose I has run"
        if kind == "W":
            return (f"rank {s} defers its Ws: it runs the oldest W only while more than {s} (its rank) wait, and the "
                    f"{s} left after the drain (running each W at once is 1F1B with B split, whose cooldown bubble "
                    f"ZB-H1 fills)")
        if want is not None and want[0] == "W":
            return (f"a W is due here: rank {s} runs the oldest W as soon as more than {s} wait (after each I, and "
                    f"the {s} left after the drain, before the step ends)")
        return "ZB-H1 is 1F1B with each backward cut to I: the same warm-up, forwards in order, Is oldest first"

    def pieces(self):
        real_f, real_b = pipeline.forward_step, pipeline.backward_step
        watch = self

        def forward_step(stage, mb, x, weight, losses):
            i = next((j for j, b in enumerate(watch.microbatches) if b is mb or b[0] is mb[0]), None)
            watch.act("F", i)
            out = real_f(stage, mb, x, weight, losses)
            watch.outputs[id(out[1])] = i
            return out

        def backward_step(x, y, dy):
            i = watch.outputs.get(id(y))
            watch.act("I", i)
            watch.current = i
            try:
                return real_b(x, y, dy)
            finally:
                watch.current = None

        class GraderSplit(torch.autograd.Function):  # the grader's I: X's and the bias's gradient, the rest kept
            @staticmethod
            def forward(ctx, x, weight, bias, kept):
                ctx.save_for_backward(x)
                ctx.parts = weight, bias, kept
                return x @ weight.T + (0 if bias is None else bias)

            @staticmethod
            def backward(ctx, g):
                (x,), (weight, bias, kept) = ctx.saved_tensors, ctx.parts
                entry = Kept((weight, x, g))
                entry.mb = watch.current
                kept.append(entry)
                return torch.matmul(g, weight), None, None if bias is None else g.sum(tuple(range(g.dim() - 1))), None

        def weight_grads(entries):  # the grader's W, watched
            mbs = sorted({getattr(e, "mb", None) for e in entries}, key=str)
            if not entries:
                raise Mistake(f"{watch.place()}: a W of nothing: W runs after its microbatch's I, on the entries that "
                              f"I appended to kept (a copy of kept taken then, and kept cleared for the next I)"
                              + _student_line(GRADER))
            if len(mbs) > 1 or mbs[0] is None:
                raise Mistake(f"{watch.place()}: a W of the entries of several Is ({mbs}): each W is one microbatch's, "
                              f"the entries its I kept (copy kept after each I, then clear it)" + _student_line(GRADER))
            watch.act("W", mbs[0])
            for weight, x, g in entries:  # dW = dY^T X over every token, accumulated
                part = torch.einsum("...o,...i->oi", g, x)
                weight.grad = part + (0 if weight.grad is None else weight.grad)

        return [(pipeline, "forward_step", forward_step), (pipeline, "backward_step", backward_step),
                (zero_bubble, "SplitLinear", GraderSplit), (zero_bubble, "weight_grads", weight_grads)]


GRADER = _codes(Watch.act, Watch.pieces, _student_line)


def _lesson(env, step, ref):
    pp, s, m = env.world_size, env.rank, ref["m"]
    embed_group = new_group([0, pp - 1]) if pp > 1 else None
    stage = pipeline.stage_model(ref["cfg"], dtype=F64).load_full_state_dict(ref["full"])
    micro = list(zip(ref["idx"].chunk(m), ref["targets"].chunk(m)))
    watch, calls = Watch(s, pp, micro), []
    with installed(*watch.pieces(), (pipeline, "sum_tied_grads",
                                     summed_by_the_grader(lambda st: [st], embed_group, calls))):
        loss = step(stage, micro)
    left = watch.expected[len(watch.done):]
    if left:
        return [f"rank {s}: the step ended after {len(watch.done)} actions; ZB-H1 runs {len(watch.expected)} "
                f"(every microbatch's F, I and W once): {left[0][0]}{left[0][1]} never ran"]
    return compared(env, loss, [stage], ref, calls, s == pp - 1)


def check_zb_h1_step(impl):
    for m in (6, 2):  # a steady state (rank 3's Ws deferred by 3); a warm-up cut at m
        ref = serial_reference(4, m, unequal=True)
        where = f"pp=4, m={m}, ZB-H1 on 4 CPU ranks, one stage each, against the serial model: "
        found = ranks(_lesson, 4, impl["zb_h1_step"], ref)
        reasons = first(diagnoses_first([where + r for rs in found for r in rs]), 3)
        if reasons:
            return reasons
    return []


# ----------------------------------------------------------------------------------------------
# Planted wrong answers. 06.1: SplitLinear's backward, or W, with one thing changed.


class _ThreeGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, kept):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.kept = weight, bias, kept
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, = ctx.saved_tensors
        ctx.kept.append((ctx.weight, x, dy))
        db = None if ctx.bias is None else dy.flatten(0, -2).sum(0)
        return dy @ ctx.weight, None, db  # the mistake: three gradients for forward's four inputs (kept's None)


class _BiasNotSummed(_ThreeGradients):
    @staticmethod
    def backward(ctx, dy):
        x, = ctx.saved_tensors
        ctx.kept.append((ctx.weight, x, dy))
        return dy @ ctx.weight, None, None if ctx.bias is None else dy.sum(0), None  # the mistake: summed over b only


class _DwAtI(_ThreeGradients):
    @staticmethod
    def backward(ctx, dy):  # B whole: the weight's gradient at I too, and W adds it again
        x, = ctx.saved_tensors
        ctx.kept.append((ctx.weight, x, dy))
        db = None if ctx.bias is None else dy.flatten(0, -2).sum(0)
        return dy @ ctx.weight, dy.flatten(0, -2).T @ x.flatten(0, -2), db, None


class _NotReturned(_DwAtI):  # its backward never runs: forward's None stops it first
    @staticmethod
    def forward(ctx, x, weight, bias, kept):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.kept = weight, bias, kept
        y = F.linear(x, weight, bias)  # the mistake: computed, never returned  # noqa: F841


def _w_replaces(kept):
    for weight, x, dy in kept:
        weight.grad = dy.flatten(0, -2).T @ x.flatten(0, -2)  # the last microbatch's dW alone


# 06.2: ZB-H1's loop with one thing changed, written out flat so that the wrong step is on its own line.


def _ws_not_deferred(stage, microbatches):
    s, pp, m = dist.get_rank(), dist.get_world_size(), len(microbatches)
    w, losses, flight, kept, waiting = pipeline.loss_weights(microbatches), [], [], [], []
    zero_bubble.split_linears(stage, kept)
    out = next(stage.parameters()).new_empty(*microbatches[0][0].shape, stage.cfg.n_embd)
    warmup = min(pp - s - 1, m)
    for i in range(warmup):
        flight.append(pipeline.forward_step(stage, microbatches[i], pipeline.recv_from(s - 1, out), w[i], losses))
        pipeline.send_to(flight[-1][1], s + 1)
    x = pipeline.recv_from(s - 1, out) if warmup < m else None
    for i in range(warmup, m):
        flight.append(pipeline.forward_step(stage, microbatches[i], x, w[i], losses))
        dy = pipeline.send_recv(flight[-1][1], s + 1, out)
        dx = pipeline.backward_step(*flight.pop(0), dy)
        waiting.append(kept.copy())
        kept.clear()
        x = pipeline.send_recv(dx, s - 1, out) if i + 1 < m else pipeline.send_to(dx, s - 1)
        zero_bubble.weight_grads(waiting.pop(0))  # the mistake: W at once, as 1F1B's B would (rank s defers s)
    while flight:
        pipeline.send_to(pipeline.backward_step(*flight.pop(0), pipeline.recv_from(s + 1, out)), s - 1)
        zero_bubble.weight_grads(kept.copy())
        kept.clear()
    pipeline.sum_tied_grads(stage)
    return sum(losses) if stage.post_process else None


def _ws_newest_first(stage, microbatches):
    s, pp, m = dist.get_rank(), dist.get_world_size(), len(microbatches)
    w, losses, flight, kept, waiting = pipeline.loss_weights(microbatches), [], [], [], []
    zero_bubble.split_linears(stage, kept)
    out = next(stage.parameters()).new_empty(*microbatches[0][0].shape, stage.cfg.n_embd)
    warmup = min(pp - s - 1, m)
    for i in range(warmup):
        flight.append(pipeline.forward_step(stage, microbatches[i], pipeline.recv_from(s - 1, out), w[i], losses))
        pipeline.send_to(flight[-1][1], s + 1)
    x = pipeline.recv_from(s - 1, out) if warmup < m else None
    for i in range(warmup, m):
        flight.append(pipeline.forward_step(stage, microbatches[i], x, w[i], losses))
        dy = pipeline.send_recv(flight[-1][1], s + 1, out)
        dx = pipeline.backward_step(*flight.pop(0), dy)
        waiting.append(kept.copy())
        kept.clear()
        x = pipeline.send_recv(dx, s - 1, out) if i + 1 < m else pipeline.send_to(dx, s - 1)
        while len(waiting) > s:
            zero_bubble.weight_grads(waiting.pop())  # the mistake: the newest W first, not the oldest
    while flight:
        pipeline.send_to(pipeline.backward_step(*flight.pop(0), pipeline.recv_from(s + 1, out)), s - 1)
        waiting.append(kept.copy())
        kept.clear()
    while waiting:
        zero_bubble.weight_grads(waiting.pop(0))
    pipeline.sum_tied_grads(stage)
    return sum(losses) if stage.post_process else None


def _zb_planted(copied=True, flush=True):
    """The lesson's loop with kept queued without a copy (then cleared: every W of nothing), or without the
    last flush (rank s's s deferred Ws never run)."""
    def zb_h1_step(stage, microbatches):
        s, pp, m = dist.get_rank(), dist.get_world_size(), len(microbatches)
        w, losses, flight, kept, waiting = pipeline.loss_weights(microbatches), [], [], [], []
        zero_bubble.split_linears(stage, kept)
        out = next(stage.parameters()).new_empty(*microbatches[0][0].shape, stage.cfg.n_embd)

        def input_grad(dy):
            dx = pipeline.backward_step(*flight.pop(0), dy)
            waiting.append(kept.copy() if copied else kept)
            kept.clear()
            return dx

        def run_ws_beyond(n):
            while len(waiting) > n:
                zero_bubble.weight_grads(waiting.pop(0))

        warmup = min(pp - s - 1, m)
        for i in range(warmup):
            flight.append(pipeline.forward_step(stage, microbatches[i], pipeline.recv_from(s - 1, out), w[i], losses))
            pipeline.send_to(flight[-1][1], s + 1)
        x = pipeline.recv_from(s - 1, out) if warmup < m else None
        for i in range(warmup, m):
            flight.append(pipeline.forward_step(stage, microbatches[i], x, w[i], losses))
            dx = input_grad(pipeline.send_recv(flight[-1][1], s + 1, out))
            x = pipeline.send_recv(dx, s - 1, out) if i + 1 < m else pipeline.send_to(dx, s - 1)
            run_ws_beyond(s)
        while flight:
            pipeline.send_to(input_grad(pipeline.recv_from(s + 1, out)), s - 1)
            run_ws_beyond(s)
        if flush:
            run_ws_beyond(0)
        pipeline.sum_tied_grads(stage)
        return sum(losses) if stage.post_process else None
    return zb_h1_step


EXERCISES = [
    Exercise("06.1", "split", "the backward split: I now, W later", ("SplitLinear", "weight_grads"),
             "Qi et al. 2023 (Zero Bubble Pipeline Parallelism), Section 2", check_split,
             lambda: {"SplitLinear": REFERENCE["SplitLinear"], "weight_grads": REFERENCE["weight_grads"]},
             [Planted("split_three_gradients", "I's backward returns three gradients (none for kept)",
                      lambda: {"SplitLinear": _ThreeGradients}, "one gradient per input of forward", at_line=True),
              Planted("split_bias_summed_over_b_only", "the bias's gradient is summed over the batch, not every token",
                      lambda: {"SplitLinear": _BiasNotSummed}, "the shape of the input it stands for", at_line=True),
              Planted("split_forward_not_returned", "SplitLinear's forward computes Y and does not return it",
                      lambda: {"SplitLinear": _NotReturned}, "forward returned None", at_line=True),
              Planted("split_dw_at_i", "I computes the weight's gradient too (B whole), and W adds it again",
                      lambda: {"SplitLinear": _DwAtI}, "the weight's gradient changed at I"),
              Planted("w_replaces_the_gradient", "W sets the weight's gradient to its dW instead of adding it",
                      lambda: {"weight_grads": _w_replaces}, "W replaced the weight's gradient")]),
    Exercise("06.2", "zb_h1_step", "ZB-H1, the lesson's loop: I at once, W deferred", ("zb_h1_step",),
             "Qi et al. 2023 (Zero Bubble Pipeline Parallelism), Section 2.1 (ZB-H1)", check_zb_h1_step,
             lambda: {"zb_h1_step": REFERENCE["zb_h1_step"]},
             [Planted("zb_ws_not_deferred", "every W runs right after its I, as 1F1B's B would",
                      lambda: {"zb_h1_step": _ws_not_deferred}, "defers its Ws", at_line=True),
              Planted("zb_ws_newest_first", "the deferred Ws run newest first",
                      lambda: {"zb_h1_step": _ws_newest_first}, "the Ws run oldest first", at_line=True),
              Planted("zb_kept_not_copied", "kept is queued as it is, then cleared: every W finds nothing",
                      lambda: {"zb_h1_step": _zb_planted(copied=False)}, "a W of nothing"),
              Planted("zb_last_ws_forgotten", "rank s's s deferred Ws never run after the drain",
                      lambda: {"zb_h1_step": _zb_planted(flush=False)}, "never ran")]),
]
