"""The checks of 04's exercises (exercises/ex04_data_parallel.py), and the planted wrong answers.

dp = 2 replicas on fork-started CPU ranks, a one-layer GPT-2 in float64. Each check looks at one
step first (the gradients after the reduction, or the shards and the parameters after one ZeRO-1
step), so that it can say which tensor went wrong and how; then it trains three AdamW steps with
04's own train_replica, the student's function in place of 04's, against 04's serial_training on
the whole batch (computed here, before anything is installed): every loss and every parameter.
"""
import copy
from argparse import Namespace

import torch
import torch.distributed as dist

from exercises.autograder import Exercise, Planted, differences, first, installed, merged, new_group, \
    numbered, random_weights, ranks
from plumbing.launch import gather_numbers

tensor_parallel = numbered("01_tensor_parallel")
data_parallel = numbered("04_data_parallel")
F64 = torch.float64
DP = 2
CFG = tensor_parallel.GPTConfig(vocab_size=53, block_size=16, n_layer=1, n_head=2, n_embd=16)
ARGS = Namespace(lr=1e-2, bucket_numel=300, microbatches=1, steps=3)  # 300: buckets split parameters
REFERENCE = {"allreduce_gradients": data_parallel.allreduce_gradients,
             "launch_bucket": data_parallel.BucketedDDP._launch,
             "shard_range": data_parallel.BucketedDDP.shard_range,
             "all_gather_params": None}  # None: 04's own FlatAdamW.step gathers (see install_zero1)


def reference():
    """The batches, the weights, serial training's losses and parameters (ARGS.steps AdamW steps),
    and the serial gradient and parameters after the first batch's one step."""
    full = random_weights(CFG, seed=3)
    gen = torch.Generator().manual_seed(2)
    batches = [tuple(torch.randint(CFG.vocab_size, (2, 8, 8), generator=gen)) for _ in range(ARGS.steps)]
    losses, params = data_parallel.serial_training(CFG, ARGS, full, batches)
    one = data_parallel.serial_training(CFG, copy.copy(ARGS), full, batches[:1])[1]
    model = tensor_parallel.GPT(CFG, None, init=False, dtype=F64)
    model.load_full_state_dict(full)
    model(*batches[0])[1].backward()
    return dict(full=full, batches=batches, losses=losses, params={n: p.detach() for n, p in params.items()},
                one_step={n: p.detach() for n, p in one.items()}, grads={n: p.grad for n, p in model.named_parameters()})


def replica(env, ref):
    """This rank's replica, its dp group, and its rows of the first batch."""
    group = new_group(list(range(env.world_size)))
    model = tensor_parallel.GPT(CFG, None, init=False, dtype=F64)
    model.load_full_state_dict(ref["full"])
    rows = data_parallel.shard_batch(*ref["batches"][0], env.world_size, env.rank)
    return group, model, rows


def training(env, ref, mode, group):
    """train_replica's losses and parameters against serial training's."""
    losses, params = data_parallel.train_replica(env, CFG, ARGS, mode, group, ref["full"], ref["batches"])[:2]
    pairs = [(f"the loss of step {i}", torch.tensor(a, dtype=F64), torch.tensor(b, dtype=F64))
             for i, (a, b) in enumerate(zip(losses, ref["losses"]))]
    pairs += [(f"{n} after {ARGS.steps} steps", p, ref["params"][n]) for n, p in params.items()]
    return [f"training {mode} for {ARGS.steps} AdamW steps, {r}" for r in differences(pairs)]


# ----------------------------------------------------------------------------------------------
# 04.1 allreduce_gradients


def _naive(env, ref):
    group, model, (idx, targets) = replica(env, ref)
    model(idx, targets)[1].backward()
    own = {n: p.grad.clone() for n, p in model.named_parameters()}
    data_parallel.allreduce_gradients(model.parameters(), group)
    dp = env.world_size
    pairs = [(f"the gradient of {n} after the reduction", p.grad, ref["grads"][n],
              [(own[n], "it is this replica's own gradient: sum it over the dp group (an all-reduce)"),
               (own[n] / dp, "it is this replica's own gradient divided by dp: the all-reduce is missing")])
             for n, p in model.named_parameters()]
    found = differences(pairs, {"dp x too large": "each replica's loss is the mean over its own rows, so the "
                                                  "sum over the replicas is dp times the mean: divide by dp",
                                "dp x too small": "divided by dp twice?"}, factors={"dp": dp})
    return found or training(env, ref, "naive", group)


def check_allreduce_gradients(impl):
    ref = reference()
    with installed((data_parallel, "allreduce_gradients", impl["allreduce_gradients"])):
        return first(merged(ranks(_naive, DP, ref)), 4)


# ----------------------------------------------------------------------------------------------
# 04.2 The bucket's launch


def _flat(ddp, model, grads):
    """The serial gradients laid out as ddp's flat buffer."""
    flat = torch.zeros_like(ddp.grad_buffer)
    for n, p in model.named_parameters():
        flat[ddp.offsets[p]:ddp.offsets[p] + p.numel()] = grads[n].reshape(-1)
    return flat


def _bucketed(env, ref):
    group, model, (idx, targets) = replica(env, ref)
    out = []
    for zero in (False, True):
        mode = "ZeRO-1" if zero else "bucketed"
        m = copy.deepcopy(model)
        ddp = data_parallel.BucketedDDP(m.parameters(), group, ARGS.bucket_numel, zero=zero)
        m(idx, targets)[1].backward()
        launched = dict(ddp.works)
        if len(launched) != len(ddp.buckets):
            out.append(f"{mode}: {len(launched)} of {len(ddp.buckets)} buckets were launched during backward (every "
                       f"bucket fills during backward, and _launch must store self.works[i])")
            continue
        bad = [i for i, w in launched.items() if not (isinstance(w, tuple) and len(w) == 2 and hasattr(w[0], "wait"))]
        if bad:
            out.append(f"{mode}: self.works[{bad[0]}] is {launched[bad[0]]!r:.60}, not (work, shard): launch the "
                       f"collective with async_op=True, so that it returns a handle at once, and keep the handle")
            continue
        own = ddp.grad_buffer.clone()  # each replica's own gradients / dp; the reduction runs in the background
        ddp.finish()
        want = _flat(ddp, m, ref["grads"])
        for i in range(len(ddp.buckets)):
            a, b = ddp.shard_range(i)
            found = differences([(f"{mode}: bucket {i}'s reduced gradient (elements {a} to {b})", ddp.grad_buffer[a:b],
                                  want[a:b], [(own[a:b], "it is still this replica's own gradient / dp: reduce "
                                                         "the bucket's own elements of grad_buffer, in place "
                                                         "(a copy leaves the buffer as it was)")])],
                                factors={"dp": env.world_size})
            if found:
                out += found
                break
    return out or training(env, ref, "bucketed", group) + training(env, ref, "zero1", group)


def check_launch_bucket(impl):
    ref = reference()
    with installed((data_parallel.BucketedDDP, "_launch", impl["launch_bucket"])):
        return first(merged(ranks(_bucketed, DP, ref)), 4)


# ----------------------------------------------------------------------------------------------
# 04.3 ZeRO-1: the partition and the all-gather


def install_zero1(impl):
    """shard_range as the student wrote it; the all-gather too, run after 04's own optimizer update:
    FlatAdamW.step with ddp.zero off updates this rank's pieces and stops before gathering."""
    own_step = data_parallel.FlatAdamW.step
    gather = impl["all_gather_params"]

    def step(self):
        zero, self.ddp.zero = self.ddp.zero, False
        try:
            own_step(self)
        finally:
            self.ddp.zero = zero
        if zero:
            gather(self.ddp)

    return [(data_parallel.BucketedDDP, "shard_range", impl["shard_range"])] + \
        ([(data_parallel.FlatAdamW, "step", step)] if gather is not None else [])


def _zero(env, ref):
    group, model, (idx, targets) = replica(env, ref)
    dp = env.world_size
    ddp = data_parallel.BucketedDDP(model.parameters(), group, ARGS.bucket_numel, zero=True)
    mine = [tuple(ddp.shard_range(i)) for i in range(len(ddp.buckets))]
    # On the run's device: NCCL (a torchrun launch on GPUs) takes no CPU tensors.
    every = [[tuple(map(int, row[2 * i:2 * i + 2])) for i in range(len(mine))]
             for row in gather_numbers([x for ab in mine for x in ab], group, device=env.device)]
    for i, (lo, hi) in enumerate(ddp.buckets):
        parts = [every[q][i] for q in range(dp)]
        want = [(lo + q * (hi - lo) // dp, lo + (q + 1) * (hi - lo) // dp) for q in range(dp)]
        if parts != want:
            return [f"bucket {i} = [{lo}, {hi}): the ranks' shard_range are {parts}; ZeRO-1 gives rank q the "
                    f"q-th of dp={dp} equal parts, {want}: disjoint, covering the bucket, in rank order"]
    opt = data_parallel.FlatAdamW(ddp, lr=ARGS.lr, weight_decay=0.1)
    model(idx, targets)[1].backward()
    ddp.finish()
    opt.step()
    out = []
    before = _flat(ddp, model, ref["full"])
    after = _flat(ddp, model, ref["one_step"])
    owned = torch.zeros_like(after, dtype=torch.bool)
    for i in range(len(ddp.buckets)):
        owned[slice(*ddp.shard_range(i))] = True
    out += differences([("the flat parameters after one ZeRO-1 step", ddp.param_buffer, after,
                         [(torch.where(owned, after, before), "they match serial training on this rank's own "
                           "shards only; elsewhere they are the old weights: all-gather every rank's updated "
                           "shard into the buffer")])])
    return out or training(env, ref, "zero1", group)


def check_zero1(impl):
    ref = reference()
    with installed(*install_zero1(impl)):
        return first(merged(ranks(_zero, DP, ref)), 4)


# ----------------------------------------------------------------------------------------------
# Planted wrong answers


def _no_division(params, group):
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def _launch_blocking(self, i):
    lo, hi = self.buckets[i]
    dist.all_reduce(self.grad_buffer[lo:hi], group=self.group)  # waits, and keeps no handle
    self.works[i] = (None, None)


def _same_shard_everywhere(self, i):
    lo, hi = self.buckets[i]
    return (lo, lo + (hi - lo) // self.dp) if self.zero else (lo, hi)


def _no_gather(ddp):
    pass


EXERCISES = [
    Exercise("04.1", "allreduce_gradients", "naive data parallelism: average gradients after backward",
             ("allreduce_gradients",), "Li et al. 2020 (gradient reduction, the naive solution)",
             check_allreduce_gradients, lambda: {"allreduce_gradients": REFERENCE["allreduce_gradients"]},
             [Planted("no_division_by_dp", "the gradients are summed over the replicas but not divided by dp",
                      lambda: {"allreduce_gradients": _no_division}, "is dp=2 x too large")]),
    Exercise("04.2", "launch_bucket", "a bucket's asynchronous reduction, launched from the hook",
             ("launch_bucket",), "Li et al. 2020 (gradient bucketing, overlapping communication)",
             check_launch_bucket, lambda: {"launch_bucket": REFERENCE["launch_bucket"]},
             [Planted("launch_blocking", "the bucket's all-reduce waits, and no work handle is kept",
                      lambda: {"launch_bucket": _launch_blocking}, "launch the collective with async_op=True")]),
    Exercise("04.3", "zero1", "ZeRO-1: each rank's shard, then the all-gather",
             ("shard_range", "all_gather_params"), "Rajbhandari et al. 2020 (P_os, ZeRO-DP stage 1)", check_zero1,
             lambda: {"shard_range": REFERENCE["shard_range"], "all_gather_params": REFERENCE["all_gather_params"]},
             [Planted("same_shard_everywhere", "every rank takes the first 1/dp of each bucket",
                      lambda: {"shard_range": _same_shard_everywhere}, "disjoint, covering the bucket"),
              Planted("no_all_gather", "the updated shards are not gathered",
                      lambda: {"all_gather_params": _no_gather}, "on this rank's own shards only")]),
]
