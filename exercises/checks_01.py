"""The checks of 01's exercises (exercises/ex01_tensor_parallel.py), and the wrong answers planted to
prove that they catch what they should.

Every check runs on tp = 2 fork-started CPU ranks in float64: first the piece alone, on inputs and
upstream gradients that differ from rank to rank (so that a missing or doubled sum shows), then the
whole GPT-2 against the serial one from the same weights and batch: the loss, the logits and every
gradient. The student's pieces go in place of 01's own (its Functions into the module, which 01's
wrappers copy_to_tp, gather_from_sp and vocab_parallel_cross_entropy apply; its forwards into the
layer classes), so that 01's model runs them on its default path, the paper's. The serial answers
are computed here, before anything is installed.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plumbing.trace import trace_comm
from exercises.autograder import Exercise, Planted, differences, first, installed, merged, numbered, \
    random_weights, ranks, token_batch, tp_group

tensor_parallel = numbered("01_tensor_parallel")
TP = 2
F64 = torch.float64
# V=101 is not a multiple of tp: the last rank holds a padded vocabulary column.
CFG = tensor_parallel.GPTConfig(vocab_size=101, block_size=16, n_layer=2, n_head=4, n_embd=32)
REFERENCE = {  # 01's own pieces, taken before anything is installed: the solutions
    "CopyToTP": tensor_parallel.CopyToTP,
    "ReduceFromTP": tensor_parallel.ReduceFromTP,
    "column_parallel_forward": tensor_parallel.ColumnParallelLinear.forward,
    "row_parallel_forward": tensor_parallel.RowParallelLinear.forward,
    "_VocabParallelCrossEntropy": tensor_parallel._VocabParallelCrossEntropy,
    "GatherFromSP": tensor_parallel.GatherFromSP,
    "ReduceScatterToSP": tensor_parallel.ReduceScatterToSP,
}


def functions(impl, *names):
    """(owner, attribute, value) putting the student's autograd Functions in place of 01's: the class
    itself, which 01's wrappers apply (copy_to_tp calls CopyToTP.apply), and any of 01's names bound
    to the class's apply directly (gather_from_sp = GatherFromSP.apply)."""
    out = []
    for name in names:
        out.append((tensor_parallel, name, impl[name]))
        out += [(tensor_parallel, attr, impl[name].apply) for attr, value in vars(tensor_parallel).items()
                if getattr(value, "__self__", None) is REFERENCE[name] and getattr(value, "__name__", "") == "apply"]
    return out


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ----------------------------------------------------------------------------------------------
# The whole model against the serial one


def serial_reference(sp):
    """The serial model's loss, logits and gradients on the check's batch (here, in this process)."""
    full = random_weights(CFG, seed=4)
    idx, targets = token_batch(CFG, 2, 8, seed=5, ignored=3)
    serial = tensor_parallel.GPT(CFG, None, init=False, dtype=F64)
    serial.load_full_state_dict(full)
    logits, loss = serial(idx, targets)
    loss.backward()
    return dict(full=full, idx=idx, targets=targets, sp=sp, loss=loss.detach(), logits=logits.detach(),
                grads={n: p.grad for n, p in serial.named_parameters()})


MODEL_HINTS = {
    "tp x too large": "summed over the ranks once too often: did a backward all-reduce twice?",
    "tp x too small": "divided by tp, or summed over fewer ranks than it should be",
    "zero": "nothing reached it: is a backward returning zeros, or a collective result thrown away?",
    "sign": "a sign was flipped somewhere between the loss and this tensor",
}


def _model(env, ref):
    group = tp_group(env)
    model = tensor_parallel.GPT(CFG, group, sequence_parallel=ref["sp"], init=False, dtype=F64)  # the paper's path
    model.load_full_state_dict(ref["full"])
    logits, loss = model(ref["idx"], ref["targets"])
    loss.backward()
    pairs = [("the loss", loss.detach(), ref["loss"]),
             ("the logits (gathered)", model.full_logits(logits.detach()), ref["logits"])]
    pairs += [(f"the gradient of {n}", g, ref["grads"][n]) for n, g in model.full_grads().items()]
    return differences(pairs, MODEL_HINTS, factors={"tp": env.world_size})


def whole_model(ref):
    """The tensor-parallel GPT-2 (tp=2) against the serial one (ref, from serial_reference): the
    loss, the logits, every gradient."""
    where = f"in the whole model ({'sequence parallel, ' if ref['sp'] else ''}tp={TP}), "
    return first([where + r for r in merged(ranks(_model, TP, ref))], 3)


# ----------------------------------------------------------------------------------------------
# The conjugate operators alone: rank r's input is x * (r + 1) and its upstream gradient its own,
# so a sum over the ranks, a missing one and a doubled one all give different numbers.

# name: (forward, backward) expected on rank r, from xs and gs, every rank's inputs and gradients
OPERATORS = {
    "copy_to_tp": (lambda xs, gs, r, tp: xs[r], lambda xs, gs, r, tp: sum(gs)),
    "reduce_from_tp": (lambda xs, gs, r, tp: sum(xs), lambda xs, gs, r, tp: gs[r]),
    "gather_from_sp": (lambda xs, gs, r, tp: torch.cat(xs, 1), lambda xs, gs, r, tp: sum(gs).chunk(tp, 1)[r]),
    "reduce_scatter_to_sp": (lambda xs, gs, r, tp: sum(xs).chunk(tp, 1)[r], lambda xs, gs, r, tp: torch.cat(gs, 1)),
}
LABEL = {"copy_to_tp": "f (copy_to_tp)", "reduce_from_tp": "g (reduce_from_tp)",
         "gather_from_sp": "sequence parallelism's g (gather_from_sp)",
         "reduce_scatter_to_sp": "sequence parallelism's g-bar (reduce_scatter_to_sp)"}


def _suspects(name, xs, gs, r, tp):
    """Known wrong answers for each operator: (forward suspects, backward suspects)."""
    mine = [torch.zeros_like(g) for g in gs]
    mine[r] = gs[r]
    return {
        "copy_to_tp": ([(sum(xs), "f's forward summed the input over the ranks: f is the identity in "
                                  "forward (g is the one that all-reduces)")],
                       [(gs[r], "f's backward passed this rank's gradient on unchanged: every rank used the "
                                "same input, so its gradient is the sum of the ranks' parts (all-reduce)")]),
        "reduce_from_tp": ([(xs[r], "g's forward returned this rank's partial output: all-reduce it, so "
                                    "that every rank has the sum")],
                           [(sum(gs), "g's backward all-reduced the gradient: g's backward is the identity "
                                      "(each rank's partial output gets the whole gradient as it is)")]),
        "gather_from_sp": ([], [(gs[r].chunk(tp, 1)[r], "sp's g's backward kept this rank's slice of its own "
                                "gradient: every rank used the whole gathered tensor, so sum the ranks' "
                                "gradients first (reduce-scatter, not a split)")]),
        "reduce_scatter_to_sp": ([(xs[r].chunk(tp, 1)[r], "kept this rank's slice of its own partial sums: "
                                   "reduce-scatter sums over the ranks first")],
                                 [(torch.cat(mine, 1), "the backward put this rank's gradient in its own slice "
                                   "and zeros elsewhere: every slice of the input fed the sum, so all-gather "
                                   "the ranks' gradients")]),
    }[name]


def _operators(env, names):
    group = tp_group(env)
    tp, r, out = env.world_size, env.rank, []
    xs = [randn(2, 4, 8, seed=1) * (q + 1) for q in range(tp)]
    for name in names:
        forward, backward = OPERATORS[name]
        y_want = forward(xs, None, r, tp)
        gs = [randn(*y_want.shape, seed=3 + q) for q in range(tp)]  # each rank's upstream gradient
        fwd_suspects, bwd_suspects = _suspects(name, xs, gs, r, tp)
        x = xs[r].clone().requires_grad_()
        y = getattr(tensor_parallel, name)(x, group)
        found = differences([(f"{LABEL[name]}, the output", y.detach(), y_want, fwd_suspects)])
        if not found:
            y.backward(gs[r])
            found = differences([(f"{LABEL[name]}, the input's gradient", x.grad, backward(xs, gs, r, tp),
                                  bwd_suspects)], factors={"tp": tp})
        out += found
    return out


def operators(*names):
    return first([f"alone, {r}" for r in merged(ranks(_operators, TP, names))], 3)


# ----------------------------------------------------------------------------------------------
# 01.1 f and g


def check_f_and_g(impl):
    """The student's Functions in place of 01's: 01's copy_to_tp and reduce_from_tp apply them."""
    ref = serial_reference(sp=False)
    with installed(*functions(impl, "CopyToTP", "ReduceFromTP")):
        return operators("copy_to_tp", "reduce_from_tp") + whole_model(ref)


# ----------------------------------------------------------------------------------------------
# 01.2 The linears: the student's forward for layers without sp, 01's for the rest


def linear_forwards(impl):
    own_col, own_row = REFERENCE["column_parallel_forward"], REFERENCE["row_parallel_forward"]

    def column(self, x):
        return own_col(self, x) if self.sp else impl["column_parallel_forward"](self, x)

    def row(self, x):
        return own_row(self, x) if self.sp else impl["row_parallel_forward"](self, x)

    return ((tensor_parallel.ColumnParallelLinear, "forward", column),
            (tensor_parallel.RowParallelLinear, "forward", row))


def _linears(env):
    group = tp_group(env)
    tp, r, out = env.world_size, env.rank, []
    for kind, n_in, n_out in (("column", 32, 48), ("row", 48, 32)):
        cls = tensor_parallel.ColumnParallelLinear if kind == "column" else tensor_parallel.RowParallelLinear
        layer = cls(n_in, n_out, group, dtype=F64)
        w, b = randn(n_out, n_in, seed=11), randn(n_out, seed=12)
        tensor_parallel.load_full_state_dict(layer, {"weight": w, "bias": b}, group)
        x_full, dy_full = randn(2, 8, n_in, seed=13), randn(2, 8, n_out, seed=14)
        x_ref = x_full.clone().requires_grad_()
        y_ref = F.linear(x_ref, w, b)
        y_ref.backward(dy_full)
        name = f"{cls.__name__}({n_in} -> {n_out}), "
        if kind == "column":  # input replicated, output split by columns
            x, y_want, dy, dx_want = x_full, y_ref.detach().chunk(tp, -1)[r], dy_full.chunk(tp, -1)[r], x_ref.grad
            partial = dy @ layer.weight.detach()  # this rank's share of the input's gradient
            y_sus, dx_sus = [], [(partial, "only this rank's part of the input's gradient: the input must "
                                           "pass through f (copy_to_tp), whose backward sums the ranks' parts")]
        else:  # input split by rows, output replicated
            x, y_want, dy, dx_want = x_full.chunk(tp, -1)[r], y_ref.detach(), dy_full, x_ref.grad.chunk(tp, -1)[r]
            local = F.linear(x, layer.weight.detach())
            y_sus = [(y_want + (tp - 1) * b, f"the right output plus (tp - 1) x the bias: the bias was added on "
                                              f"every rank before the sum over the ranks, so it counts tp={tp} "
                                              f"times; add it once, after g"),
                     (local + b, "this rank's partial product plus the bias: sum the partial products over "
                                 "the ranks with g (reduce_from_tp) first")]
            dx_sus = []
        x = x.clone().requires_grad_()
        y = layer(x)
        found = differences([(f"{name}the output", y.detach(), y_want, y_sus)])
        if not found:
            y.backward(dy)
            grads = tensor_parallel.gather_full(layer, group, grads=True)
            found = differences([(f"{name}the input's gradient", x.grad, dx_want, dx_sus),
                                 (f"{name}the weight's gradient", grads["weight"], _grad_w(x_full, dy_full)),
                                 (f"{name}the bias's gradient", grads["bias"], dy_full.sum((0, 1)))],
                                factors={"tp": tp})
        out += found
    return out


def _grad_w(x, dy):
    """The gradient of F.linear's weight: the sum over rows of dy^T x, (n_out, n_in)."""
    return dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])


def check_linears(impl):
    ref = serial_reference(sp=False)
    with installed(*linear_forwards(impl)):
        return first([f"alone, {r}" for r in merged(ranks(_linears, TP))], 3) + whole_model(ref)


# ----------------------------------------------------------------------------------------------
# 01.3 The vocab-parallel cross-entropy, against F.cross_entropy and against the usual mistakes


def _cross_entropy_cases(full, target, V, tp, r, ignore_index):
    """The right loss, and what each usual mistake gives instead, on rank r: [(loss, words)]."""
    N, V_pad = full.shape
    cols = torch.arange(V_pad)
    owner = torch.div(target.clamp_min(0), V_pad // tp, rounding_mode="floor")
    valid = target != ignore_index
    z = full.masked_fill(cols >= V, -math.inf)
    t = target.clamp_min(0)

    def mean(per_row, over=None):
        return per_row.masked_fill(~valid, 0).sum() / (valid.sum() if over is None else over)

    def picked(shifted):
        return shifted.gather(1, t[:, None]).squeeze(1)

    slices = [slice(q * V_pad // tp, (q + 1) * V_pad // tp) for q in range(tp)]
    top = z.max(1).values
    sums = [(z[:, s] - top[:, None]).exp().sum(1) for s in slices]
    own_max = [z[:, s].max(1).values for s in slices]
    own_sums = sum((z[:, s] - own_max[q][:, None]).exp().sum(1) for q, s in enumerate(slices))
    own_shift = torch.stack(own_max, 1).gather(1, owner[:, None]).squeeze(1)
    mine = owner == r
    with_pad = full - full.max(1).values[:, None]
    return [
        (mean(sum(sums).log() - picked(z) + top, over=torch.tensor(N)),
         f"it averages over all {N} positions: the ones whose target is ignore_index take no part; divide by "
         f"the number of the others"),
        (mean(sums[r].log() - picked(z) + top), "it equals the loss with this rank's own sum of exponentials: "
         "sum it over the ranks (sums(group, ...))"),
        (mean(sum(sums).log() - (picked(z) - top).masked_fill(~mine, 0)),
         "it equals the loss with the target logit taken on this rank only: the rank holding the target's "
         "column has it, the others put 0, and a sum over the ranks gives it to all"),
        (mean(own_sums.log() - picked(z) + own_shift), "it equals the loss with each rank shifting by its own "
         "max: all-reduce the max (op MAX) so that every rank subtracts the same number"),
        (mean(with_pad.exp().sum(1).log() - picked(with_pad)), "it counts the padded columns (index >= n_vocab) as "
         "tokens: fill them with -inf first"),
    ]


def _cross_entropy(env, V, ignore_index):
    group = tp_group(env)
    tp, r = env.world_size, env.rank
    V_pad, N = tensor_parallel.padded_vocab_size(V, tp), 24
    full = torch.cat([randn(N, V, seed=5) * 3, torch.full((N, V_pad - V), 1e4, dtype=F64)], 1)  # poisoned padding
    target = torch.randint(V, (N,), generator=torch.Generator().manual_seed(6))
    target[::5] = ignore_index
    ref_in = full[:, :V].clone().requires_grad_()
    ref = F.cross_entropy(ref_in, target, ignore_index=ignore_index)
    ref.backward(torch.tensor(0.7, dtype=F64))  # an upstream gradient that is not 1
    grad_want = torch.cat([ref_in.grad, torch.zeros(N, V_pad - V, dtype=F64)], 1).chunk(tp, 1)[r]
    local = full.chunk(tp, 1)[r].clone().requires_grad_()
    with trace_comm() as log:
        loss = tensor_parallel.vocab_parallel_cross_entropy(local, target, group, V, ignore_index)
    sums = [c.shape for c in log if c.op == "all-reduce"]
    what = f"V={V} (padded to {V_pad}), ignore_index={ignore_index}"
    found = differences([(f"{what}, the loss", loss.detach(), ref.detach(),
                          _cross_entropy_cases(full, target, V, tp, r, ignore_index))])
    if not found:
        loss.backward(torch.tensor(0.7, dtype=F64))
        found = differences([(f"{what}, the gradient of this rank's logits", local.grad, grad_want)],
                            {"other": "each rank's gradient is softmax - one-hot on its own columns, times the "
                                      "upstream gradient / the number of counted rows",
                             "scaled": "is the backward's result multiplied by the upstream gradient (grad, 0.7 "
                                       "here) and divided by the number of counted rows?"}, factors={"tp": tp})
    if not found and sums != [(2, N)]:
        seen = ", ".join(str(s) for s in sums) or "none"
        found = [f"{what}: forward's sum all-reduces had the shapes {seen}: the target logits and the sums of "
                 f"exponentials, (N,) each, travel stacked in one all-reduce of (2, N) = (2, {N}) (as "
                 f"Megatron's cross-entropy sends them), after the max's"]
    return found


def check_cross_entropy(impl):
    """The student's Function in place of 01's: 01's vocab_parallel_cross_entropy applies it."""
    ref = serial_reference(sp=False)
    with installed(*functions(impl, "_VocabParallelCrossEntropy")):
        alone = merged(ranks(_cross_entropy, TP, 13, -100))
        return first([f"alone, {r}" for r in alone], 3) + whole_model(ref)


# ----------------------------------------------------------------------------------------------
# 01.4 Sequence parallelism's pair


def check_sequence_parallel(impl):
    """The student's Functions in place of 01's: 01's gather_from_sp and reduce_scatter_to_sp apply them.
    The operators' own failures, if any, are said even where the whole model then stops (in the student
    copy, at its linears with sequence parallelism: LENT, below) or crashes on what they return."""
    with installed(*functions(impl, "GatherFromSP", "ReduceScatterToSP")):
        found = operators("gather_from_sp", "reduce_scatter_to_sp")
    try:
        ref = serial_reference(sp=True)  # the serial model's layers are built with sequence parallelism too
        with installed(*functions(impl, "GatherFromSP", "ReduceScatterToSP")):
            return found + whole_model(ref)
    except Exception:  # noqa: BLE001 - a stub of the copy (on the ranks: a RankFailure), or a crash the operators explain
        if found:
            return found
        raise


# In the student copy the numbered file's linears are stubs, and the grader lends the student's 01.2
# forwards to the other checks. 01.2 asks for the layers without sequence parallelism (its check keeps
# 01's own forward for the rest, linear_forwards), so a lent forward serves those alone: a layer with
# sequence parallelism (01.4's whole model) says that it needs 01's own, as a check needing the reference does.
SP_LINEAR_IS_01S = ("01.2 {}.forward with sequence parallelism: 01.2 asks for the layers without it, so this check "
                    "needs 01_tensor_parallel.py's own for the layers with it, which the student copy does not have: "
                    "it is graded in the instructor's copy")


def _lent_linear(cls_name):
    def lend(students):
        def forward(self, x):
            if self.sp:
                raise NotImplementedError(SP_LINEAR_IS_01S.format(cls_name))
            return students(self, x)
        return forward
    return lend


LENT = {"column_parallel_forward": _lent_linear("ColumnParallelLinear"),
        "row_parallel_forward": _lent_linear("RowParallelLinear")}


# ----------------------------------------------------------------------------------------------
# Planted wrong answers: each must fail with the words given (tests/test_exercises.py).


class _GBackwardAllReduces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tensor_parallel.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return tensor_parallel.all_reduce(grad, ctx.group), None  # the mistake: g's backward is the identity


class _FBackwardIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # the mistake: no all-reduce


def _bias_before_reduce(self, x):
    return tensor_parallel.reduce_from_tp(F.linear(x, self.weight, self.bias), self.group)  # bias on every rank


class _CrossEntropyLocalSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, n_vocab, ignore_index):
        Vl, r = logits.shape[1], tensor_parallel.tp_rank(group)
        z = logits.masked_fill(torch.arange(r * Vl, (r + 1) * Vl) >= n_vocab, -math.inf)
        top = tensor_parallel.all_reduce(z.max(1).values, group, dist.ReduceOp.MAX)
        local, valid = target - r * Vl, target != ignore_index
        mine = valid & (local >= 0) & (local < Vl)
        local = local.masked_fill(~mine, 0)
        picked = (z - top[:, None]).gather(1, local[:, None]).squeeze(1).masked_fill(~mine, 0)
        exp = (z - top[:, None]).exp()
        picked = tensor_parallel.all_reduce(picked, group)
        total = exp.sum(1)  # the mistake: not summed over the ranks
        n_valid = valid.sum()
        ctx.save_for_backward(exp / total[:, None], local, mine, valid, n_valid)
        return (total.log() - picked).masked_fill(~valid, 0).sum() / n_valid

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, valid, n_valid = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(1, local[:, None], mine.to(softmax.dtype)[:, None])
        return (softmax - onehot) * (valid * grad / n_valid)[:, None], None, None, None, None


class _GatherBackwardSplits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tensor_parallel.gather(x, group, tensor_parallel.SEQ)

    @staticmethod
    def backward(ctx, grad):  # the mistake: a split, not a reduce-scatter
        return tensor_parallel.split(grad, ctx.group, tensor_parallel.SEQ), None


# What the guard catches as a Function returns (autograder.guarded), said at the line marked "the mistake"
# (tests/test_exercises.py reads the line from here): the rule broken, not a crash in the grader.


class _FBackwardReturnsAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return dist.all_reduce(grad, group=ctx.group), None  # the mistake: dist.all_reduce returns None


class _FBackwardInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)  # the mistake: the sum written into the gradient autograd gave
        return grad, None


class _GBackwardOneGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return tensor_parallel.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad  # the mistake: one gradient for forward's two inputs (x, group)


class _GForwardInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)  # the mistake: the sum written into forward's input
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _row_returns_all_reduce(self, x):
    y = F.linear(x, self.weight).clone()
    return dist.all_reduce(y, group=self.group)  # the mistake: dist.all_reduce returns None


class _CrossEntropyMasksInPlace(REFERENCE["_VocabParallelCrossEntropy"]):
    @staticmethod
    def forward(ctx, logits, target, group, n_vocab, ignore_index):
        Vl, r = logits.shape[1], tensor_parallel.tp_rank(group)
        logits.masked_fill_(torch.arange(r * Vl, (r + 1) * Vl) >= n_vocab, -math.inf)  # the mistake: in place
        return REFERENCE["_VocabParallelCrossEntropy"].forward(ctx, logits, target, group, n_vocab, ignore_index)


class _CrossEntropySumsApart(REFERENCE["_VocabParallelCrossEntropy"]):
    @staticmethod
    def forward(ctx, logits, target, group, n_vocab, ignore_index):
        real = tensor_parallel.all_reduce

        def apart(x, group, *op):  # the mistake: the two stacked sums sent in two all-reduces, one each
            return real(x, group, *op) if x.dim() == 1 else torch.stack([real(y, group) for y in x])

        try:
            tensor_parallel.all_reduce = apart
            return REFERENCE["_VocabParallelCrossEntropy"].forward(ctx, logits, target, group, n_vocab, ignore_index)
        finally:
            tensor_parallel.all_reduce = real


class _CrossEntropyTwoGradients(REFERENCE["_VocabParallelCrossEntropy"]):
    @staticmethod
    def backward(ctx, grad):
        grad_logits = REFERENCE["_VocabParallelCrossEntropy"].backward(ctx, grad)[0]
        return grad_logits, None  # the mistake: two gradients for forward's five inputs


class _GatherBackwardAllReduces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tensor_parallel.gather(x, group, tensor_parallel.SEQ)

    @staticmethod
    def backward(ctx, grad):
        return tensor_parallel.all_reduce(grad, ctx.group), None  # the mistake: (B, T, C), not x's (B, T/tp, C)


class _ReduceScatterInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        dist.all_reduce(x, group=group)  # the mistake: the sum written into forward's input
        return tensor_parallel.split(x, group, tensor_parallel.SEQ)

    @staticmethod
    def backward(ctx, grad):
        return tensor_parallel.gather(grad, ctx.group, tensor_parallel.SEQ), None


EXERCISES = [
    Exercise("01.1", "f_and_g", "f and g, the conjugate operators", ("CopyToTP", "ReduceFromTP"),
             "Shoeybi et al. 2019, Section 3 and Figure 3", check_f_and_g,
             lambda: {k: REFERENCE[k] for k in ("CopyToTP", "ReduceFromTP")},
             [Planted("g_backward_all_reduces", "g's backward all-reduces too (it must be the identity)",
                      lambda: {"ReduceFromTP": _GBackwardAllReduces}, "g's backward all-reduced"),
              Planted("f_backward_identity", "f's backward forgets the all-reduce",
                      lambda: {"CopyToTP": _FBackwardIdentity}, "f's backward passed this rank's gradient"),
              Planted("f_backward_returns_all_reduce", "f's backward returns what dist.all_reduce returns (None)",
                      lambda: {"CopyToTP": _FBackwardReturnsAllReduce}, "`dist.all_reduce` works in place and "
                      "returns None", at_line=True),
              Planted("f_backward_in_place", "f's backward all-reduces the gradient it is given in place",
                      lambda: {"CopyToTP": _FBackwardInPlace}, "backward wrote into the gradient it was given",
                      at_line=True),
              Planted("g_backward_one_gradient", "g's backward returns one gradient for forward's two inputs",
                      lambda: {"ReduceFromTP": _GBackwardOneGradient}, "backward returns one gradient per input "
                      "of forward", at_line=True),
              Planted("g_forward_in_place", "g's forward all-reduces its input in place (dist.all_reduce)",
                      lambda: {"ReduceFromTP": _GForwardInPlace}, "forward leaves its inputs as they are",
                      at_line=True)]),
    Exercise("01.2", "linears", "the column- and row-parallel linear layers",
             ("column_parallel_forward", "row_parallel_forward"),
             "Shoeybi et al. 2019, Section 3 (the MLP block)", check_linears,
             lambda: {k: REFERENCE[k] for k in ("column_parallel_forward", "row_parallel_forward")},
             [Planted("bias_before_reduce", "the row-parallel bias is added on every rank before g",
                      lambda: {"row_parallel_forward": _bias_before_reduce}, "plus (tp - 1) x the bias"),
              Planted("row_forward_returns_all_reduce", "the row-parallel forward returns what dist.all_reduce "
                      "returns (None)", lambda: {"row_parallel_forward": _row_returns_all_reduce},
                      "it returned None, but the piece it stands in for always returns a value", at_line=True)],
             replaces=("ColumnParallelLinear.forward", "RowParallelLinear.forward")),
    Exercise("01.3", "cross_entropy", "the vocab-parallel cross-entropy", ("_VocabParallelCrossEntropy",),
             "Shoeybi et al. 2019, Section 3 (the output embedding)", check_cross_entropy,
             lambda: {"_VocabParallelCrossEntropy": REFERENCE["_VocabParallelCrossEntropy"]},
             [Planted("cross_entropy_local_sum", "the sum of exponentials is not summed over the ranks",
                      lambda: {"_VocabParallelCrossEntropy": _CrossEntropyLocalSum},
                      "this rank's own sum of exponentials"),
              Planted("cross_entropy_masks_in_place", "the padded columns are filled with -inf in the logits given",
                      lambda: {"_VocabParallelCrossEntropy": _CrossEntropyMasksInPlace},
                      "forward wrote into its input logits in place", at_line=True),
              Planted("cross_entropy_two_gradients", "backward returns two gradients, not one per input (five)",
                      lambda: {"_VocabParallelCrossEntropy": _CrossEntropyTwoGradients},
                      "returned 2 gradients for forward's 5 inputs", at_line=True),
              Planted("cross_entropy_sums_apart", "the two sums in two all-reduces, not one stacked",
                      lambda: {"_VocabParallelCrossEntropy": _CrossEntropySumsApart},
                      "travel stacked in one all-reduce")]),
    Exercise("01.4", "sequence_parallel", "sequence parallelism's all-gather / reduce-scatter pair",
             ("GatherFromSP", "ReduceScatterToSP"), "Korthikanti et al. 2022, Section 4.2.2",
             check_sequence_parallel, lambda: {k: REFERENCE[k] for k in ("GatherFromSP", "ReduceScatterToSP")},
             [Planted("gather_backward_splits", "sp's g's backward splits the gradient instead of reduce-scattering",
                      lambda: {"GatherFromSP": _GatherBackwardSplits}, "reduce-scatter, not a split"),
              Planted("gather_backward_full_shape", "sp's g's backward all-reduces: a (B, T, C) gradient for (B, "
                      "T/tp, C)", lambda: {"GatherFromSP": _GatherBackwardAllReduces},
                      "a gradient has the shape of the input it stands for", at_line=True),
              Planted("reduce_scatter_in_place", "sp's g-bar all-reduces its input in place, then splits it",
                      lambda: {"ReduceScatterToSP": _ReduceScatterInPlace}, "forward wrote into its input x in place",
                      at_line=True)]),
]
