"""04_data_parallel.py's demo, the part that is not the concept: its flags, its checks, what it counts
and compares, and the demo's machine part (prove_machine), which runs 04's machine and prints it. 04
imports each name back, so `data_parallel.differences` and the rest are where they were.

    check_world(world, dp, B, m)   one replica per rank, and B divisible by dp x m
    counted(targets, dp, m)        the counted targets of each replica's microbatches
    differences(got, want)         the largest relative difference of (losses, parameters)
    training_reference(cfg, args)  the demo's batches, unevenly masked, and serial training on them
    DemoConfig, parser()           the demo's flags
    main(demo)                     parse them, launch `demo` on dp ranks: True if every rank passed
    prove_machine(env, ...)        each mode on the machine (04's train_replica) against serial
                                   training and against the lesson, printed (demos.report_dp)

It imports 04 (serial_training, train_replica) only when called: 04 imports this module.
"""
import importlib
from dataclasses import dataclass

import torch

from plumbing import cli, demos
from plumbing.launch import gather_numbers

tensor_parallel = importlib.import_module("01_tensor_parallel")


def check_world(world, dp, batch_size, m):
    if world != dp:
        raise ValueError(f"the world size {world} does not match dp={dp} (one replica per rank)")
    if batch_size % (dp * m):
        raise ValueError(f"the global batch of {batch_size} sequences is not divisible by dp x m = {dp} x {m}")


def counted(targets, dp, m, ignore_index=-100):
    """The counted targets of each replica's microbatches of one global batch, [[per microbatch]] per replica."""
    return [[int((t != ignore_index).sum()) for t in rows.chunk(m)] for rows in targets.chunk(dp)]


def differences(got, want):
    """The largest relative difference of got = (losses, {name: parameter}) from want's."""
    (losses, params), (ref_losses, ref_params) = got, want
    return max([tensor_parallel.max_rel_diff(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)]
               + [tensor_parallel.max_rel_diff(params[n], ref_params[n].detach()) for n in params])


def training_reference(cfg, args):
    """The demo's random batches and full weights, and serial training's losses and weights on them.
    Some targets are not counted (-100), unevenly: replica 0 counts one, replica 1's first
    microbatch none, the others about half (docs/LOSS.md: the replicas' means would not do)."""
    data_parallel = importlib.import_module("04_data_parallel")  # at call time: 04 imports this module
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [tuple(torch.randint(cfg.vocab_size, (2, args.batch_size, args.seq_len), generator=gen))
               for _ in range(args.steps)]
    for _, targets in batches:
        targets[torch.rand(targets.shape, generator=gen) < 0.5] = -100
        rows = targets.chunk(args.dp)
        if args.dp > 1:
            rows[0].fill_(-100)[0, 0] = 7  # one counted target in replica 0
            rows[1].chunk(args.microbatches)[0].fill_(-100)  # none in replica 1's first microbatch
    full = tensor_parallel.init_state_dict(cfg, args.seed, dtype=torch.float64, random_all=True)
    return (batches, full, *data_parallel.serial_training(cfg, args, full, batches))


@dataclass
class DemoConfig:
    dp: int = 4  # data-parallel replicas: CPU ranks started here, or torchrun's world
    steps: int = 3  # AdamW steps, each on a new random batch
    microbatches: int = 2  # gradient-accumulation steps per replica per step
    bucket_numel: int = 20000  # elements per gradient bucket
    batch_size: int = 16  # global batch B, in sequences
    seq_len: int = 32  # T, tokens per sequence
    lr: float = 1e-2  # AdamW learning rate
    seed: int = 1234  # for the weights and the batches


def parser():
    """04's parser, described by 04's docstring (read at call time: 04 imports this module)."""
    return cli.demo_parser(importlib.import_module("04_data_parallel").__doc__, DemoConfig, tensor_parallel.GPTConfig,
                           vocab_size=1001, block_size=64, n_layer=2, n_head=4, n_embd=64)


def main(demo):
    """Parse 04's flags, launch `demo` on dp ranks, exit 0 if every rank passed."""
    cfg, args = cli.demo_args(parser())  # every flag checked before any rank starts
    return all(tensor_parallel.launch(demo, args.dp, cfg, args))


def prove_machine(env, cfg, args, group, reference, lessons, say):
    """Each mode on the machine (train_replica) against serial training (1e-10) and against the lesson's
    train_lesson (1e-12): the same float64 operations on the same numbers, equal to the bit on a CPU today;
    the margin is for a collective that sums in another order (ZeRO-1: the machine reduce-scatters its
    padded buckets, the lesson all-reduces its own), a few ulps that AdamW's 1/sqrt(v) may grow over the
    steps in parameters with tiny gradients. A mistake (a bucket reduced twice or stale, a 1/dp weighting of
    the losses, a shard not gathered) is O(1e-3) or more."""
    data_parallel = importlib.import_module("04_data_parallel")  # at call time: 04 imports this module
    batches, full, ref_losses, ref_params = reference
    say("\nthe machine: naive is allreduce_gradients, bucketed BucketedDDP with AdamW, zero1 BucketedDDP(zero=True) "
        "with FlatAdamW")
    runs = {}
    for mode in ("naive", "bucketed", "zero1"):
        losses, params, timeline, opt, digest = data_parallel.train_replica(env, cfg, args, mode, group, full, batches)
        digests = [f"{int(d[0]):012x}" for d in gather_numbers([digest], group, env.device)]  # every replica's
        runs[mode] = demos.DataParallelRun(losses, differences((losses, params), (ref_losses, ref_params)), digests,
                                           timeline, demos.optimizer_state_bytes(opt),
                                           differences((losses, params), lessons[mode]))
    return demos.report_dp(say, cfg, args, ref_losses, runs)  # True if every mode equals serial and the lesson
