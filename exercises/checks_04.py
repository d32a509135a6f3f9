"""The checks of 04's exercises (exercises/ex04_data_parallel.py), and the planted wrong answers.

dp = 2 replicas on fork-started CPU ranks, a one-layer GPT-2 in float64. Each check looks at one
step first (the gradients after the reduction, or the parameters after one ZeRO-1 step), so that it
can say which tensor went wrong and how; then it trains three AdamW steps of 2 microbatches with
04's lesson, train_lesson, the student's function in place of 04's, against 04's serial_training on
the whole batch (computed here, before anything is installed): every loss and every parameter.
"""
import copy
from argparse import Namespace

import torch
import torch.distributed as dist

from exercises.autograder import Exercise, Planted, differences, first, installed, merged, new_group, \
    numbered, random_weights, ranks

tensor_parallel = numbered("01_tensor_parallel")
data_parallel = numbered("04_data_parallel")
F64 = torch.float64
DP = 2
CFG = tensor_parallel.GPTConfig(vocab_size=53, block_size=16, n_layer=1, n_head=2, n_embd=16)
ARGS = Namespace(lr=1e-2, bucket_numel=300, microbatches=2, steps=3)  # 300: buckets split parameters
REFERENCE = {"allreduce_gradients": data_parallel.allreduce_gradients,
             "ddp_hook": data_parallel.DDP.hook,
             "zero1_step": data_parallel.ZeRO1.step}


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
    """train_lesson's losses and parameters against serial training's."""
    losses, params = data_parallel.train_lesson(env, CFG, ARGS, mode, group, ref["full"], ref["batches"])
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
# 04.2 The lesson's DDP hook


def _flat(ddp, model, tensors):
    """{name: tensor} of the model's parameters laid out as ddp's flat buffer (padding: 0)."""
    flat = torch.zeros_like(ddp.grads)
    for n, p in model.named_parameters():
        flat[ddp.offset[p]:ddp.offset[p] + p.numel()] = tensors[n].reshape(-1)
    return flat


def _bucketed(env, ref):
    group, model, (idx, targets) = replica(env, ref)
    ddp = data_parallel.DDP(model.parameters(), group, ARGS.bucket_numel)
    model(idx, targets)[1].backward()  # one microbatch, the step's last (ddp.sync)
    n, works = len(ddp.buckets), list(ddp.works)
    if len(works) != n or not all(hasattr(w, "wait") for w in works):
        return [f"{len(works)} work handles in self.works after backward, for {n} buckets: when a bucket's count "
                f"reaches 0, launch its all-reduce with async_op=True, so that it returns a handle at once, and "
                f"append the handle to self.works"]
    kept = [n for n, p in model.named_parameters() if p.grad is not None]
    if kept:
        return [f"{kept[0]}.grad is still set after its hook: set p.grad = None once it is in the buffer (the next "
                f"microbatch's backward would add into it, and its gradient would be counted twice)"]
    ddp.finish()
    want = _flat(ddp, model, ref["grads"])
    for i, (lo, hi) in enumerate(ddp.buckets):
        found = differences([(f"bucket {i}'s averaged gradient (elements {lo} to {hi})", ddp.grads[lo:hi],
                              want[lo:hi])], {"dp x too large": "add the gradient in divided by dp (alpha=1 / "
                                                               "self.dp): the replicas' sum is then their average"},
                            factors={"dp": env.world_size})
        if found:
            return found
    return training(env, ref, "bucketed", group) + training(env, ref, "zero1", group)


def check_ddp_hook(impl):
    ref = reference()
    with installed((data_parallel.DDP, "hook", impl["ddp_hook"])):
        return first(merged(ranks(_bucketed, DP, ref)), 4)


# ----------------------------------------------------------------------------------------------
# 04.3 ZeRO-1's step: AdamW on this rank's shard, then the all-gather


def _zero(env, ref):
    group, model, (idx, targets) = replica(env, ref)
    ddp = data_parallel.DDP(model.parameters(), group, ARGS.bucket_numel)
    opt = data_parallel.ZeRO1(ddp, lr=ARGS.lr, weight_decay=0.1)
    model(idx, targets)[1].backward()
    ddp.finish()
    opt.step()
    got = _flat(ddp, model, {n: p.detach() for n, p in model.named_parameters()})
    before, after = _flat(ddp, model, ref["full"]), _flat(ddp, model, ref["one_step"])
    owned = torch.zeros_like(after, dtype=torch.bool)
    owned[opt.lo:opt.hi] = True
    found = differences([("the parameters after one ZeRO-1 step, laid out as the flat buffer", got, after,
                          [(torch.where(owned, after, before), "they match serial training on this rank's own shard "
                            "only; elsewhere they are the old weights: all-gather every rank's updated shard into "
                            "self.flat before copying back"),
                           (before, "they are the old weights everywhere: after AdamW on self.shard and the "
                            "all-gather into self.flat, copy each parameter's elements of self.flat back into it")])])
    return found or training(env, ref, "zero1", group)


def check_zero1(impl):
    ref = reference()
    with installed((data_parallel.ZeRO1, "step", impl["zero1_step"])):
        return first(merged(ranks(_zero, DP, ref)), 4)


# ----------------------------------------------------------------------------------------------
# Planted wrong answers


def _no_division(params, group):
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def _hook_blocking(self, p):
    """The lesson's hook with each bucket's all-reduce waited for at once, and no handle kept."""
    self.view(p).add_(p.grad.reshape(-1), alpha=1 / self.dp)
    p.grad = None
    if self.sync:
        for i in self.buckets_of[p]:
            self.pending[i] -= 1
            if self.pending[i] == 0:
                dist.all_reduce(self.grads[self.buckets[i][0]:self.buckets[i][1]], group=self.group)


def _no_all_gather(self):
    """AdamW on the shard, which goes back into this rank's own place of self.flat only."""
    self.shard.grad = self.ddp.grads[self.lo:self.hi]
    self.adamw.step()
    self.flat[self.lo:self.hi] = self.shard.detach()
    for p in self.ddp.params:
        p.data.copy_(self.flat[self.ddp.offset[p]:self.ddp.offset[p] + p.numel()].view_as(p))


def _no_copy_back(self):
    """AdamW on the shard and the all-gather, but the parameters are left as they were."""
    self.shard.grad = self.ddp.grads[self.lo:self.hi]
    self.adamw.step()
    dist.all_gather(list(self.flat.chunk(self.ddp.dp)), self.shard, group=self.ddp.group)


EXERCISES = [
    Exercise("04.1", "allreduce_gradients", "naive data parallelism: average gradients after backward",
             ("allreduce_gradients",), "Li et al. 2020 (gradient reduction, the naive solution)",
             check_allreduce_gradients, lambda: {"allreduce_gradients": REFERENCE["allreduce_gradients"]},
             [Planted("no_division_by_dp", "the gradients are summed over the replicas but not divided by dp",
                      lambda: {"allreduce_gradients": _no_division}, "is dp=2 x too large")]),
    Exercise("04.2", "ddp_hook", "a bucket's asynchronous reduction, launched from the hook",
             ("ddp_hook",), "Li et al. 2020 (gradient bucketing, overlapping communication, no_sync)",
             check_ddp_hook, lambda: {"ddp_hook": REFERENCE["ddp_hook"]},
             [Planted("hook_blocking", "each bucket's all-reduce waits, and no work handle is kept",
                      lambda: {"ddp_hook": _hook_blocking}, "launch its all-reduce with async_op=True")],
             replaces=("DDP.hook",)),
    Exercise("04.3", "zero1", "ZeRO-1: AdamW on this rank's shard, then the all-gather",
             ("zero1_step",), "Rajbhandari et al. 2020 (P_os, ZeRO-DP stage 1)", check_zero1,
             lambda: {"zero1_step": REFERENCE["zero1_step"]},
             [Planted("no_all_gather", "the updated shards are not gathered",
                      lambda: {"zero1_step": _no_all_gather}, "on this rank's own shard only"),
              Planted("no_copy_back", "the gathered parameters are not copied back into the model",
                      lambda: {"zero1_step": _no_copy_back}, "the old weights everywhere")],
             replaces=("ZeRO1.step",)),
]
