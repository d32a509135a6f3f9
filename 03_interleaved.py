"""03 - The interleaved 1F1B schedule with virtual stages (Narayanan et al. 2021, Section 2.2.2).

What this file adds on top of 02: each rank holds v model chunks instead of one contiguous slice.
The model is cut into pp*v chunks and rank r holds chunks r, r + pp, r + 2pp, ... (with 16 layers,
pp=4 and v=2, rank 0 holds layers 1-2 and 9-10, rank 3 layers 7-8 and 15-16). A microbatch now
crosses every rank v times, so each forward or backward is 1/v as long and the pipeline fills and
drains v times faster: the bubble shrinks from (pp-1)/m to (pp-1)/(v m), at the price of more
point-to-point messages: about v times as many, the paper says; exactly (pp v - 1)/(pp - 1) times,
the stage boundaries a microbatch crosses (7/3 at pp=4, v=2). Only the schedule is new: 02's
validator, simulator, executor and timelines read its lists unchanged.

The schedule is Megatron's (the paper's Figure 4). Microbatches go through the chunks in groups
of pp, and m must be divisible by pp (the paper's requirement, kept here; other m are refused;
Megatron Core now groups by microbatch_group_size_per_vp_stage, pp by default, and lets the last
group be shorter). v=1 returns 02's
1F1B lists exactly.

Run it:
    python 03_interleaved.py                         # pp=4 CPU ranks, v=2, m=8
    python 03_interleaved.py --pp 2 --virtual-stages 3 --microbatches 4
    torchrun --nproc-per-node 4 03_interleaved.py    # one rank per GPU

The demo runs 1F1B and interleaved 1F1B on the same model, checks both against the serial model in
float64 (loss and every gradient <= 1e-10), draws their timelines on one time scale, prints the
simulated bubbles against (pp-1)/m and (pp-1)/(v m), the p2p message count and bytes ((pp v - 1)/
(pp - 1) times 1F1B's) and each stage's peak stored activation bytes. It exits 1 on a mismatch.
"""
import importlib
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction

import torch.distributed as dist

from plumbing import cli, demos
from plumbing.launch import printer, run_main
from plumbing.reference import pipeline_reference

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")


# ----------------------------------------------------------------------------------------------
# The interleaved schedule as data, and how its lists run


def interleaved(pp, m, stage, v):
    """Interleaved 1F1B on rank `stage`: m*v forwards and m*v backwards over its v chunks."""
    check_interleaving(pp, m, v)
    if v == 1:
        return pipeline.one_f_one_b(pp, m, stage)

    def at(k, forward):
        # Virtual step k: groups of pp microbatches visit chunk 0, then chunk 1, ... (backwards
        # visit them in reverse), before the next group of pp microbatches starts.
        chunk = (k % (pp * v)) // pp
        return pipeline.Action("F" if forward else "B", (k // (pp * v)) * pp + k % pp,
                           chunk if forward else v - 1 - chunk)

    total = m * v
    # (v - 1) pp forwards bring microbatch 0 to rank r's last chunk; its gradient is back 2 (pp - r - 1)
    # steps later, one hop a step down to the last rank and one back. A steady pair runs F and B with
    # no boundary between, so with fewer warm-up forwards rank r's B would wait for rank r+1, which
    # waits for the F output rank r sends only after that B (validate() finds it: v = 2, m = 2 pp).
    warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    acts = [at(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        f, b = at(warmup + i, True), at(i, False)
        acts += [pipeline.Action("F", f.mb, f.chunk, steady=True), pipeline.Action("B", b.mb, b.chunk, steady=True)]
    return acts + [at(k, False) for k in range(total - warmup, total)]


@dataclass
class InterleavedSchedule(pipeline.Schedule):
    """02's Schedule, whose steady forward and the backward after it run back to back, as one group
    with no boundary between them: at v > 1 a boundary there could make two ranks wait on each other."""

    def groups(self, rank):
        groups, acts, i = [], self.lists[rank], 0
        while i < len(acts):  # a steady F pairs with the steady B after it; any other action runs alone
            pair = acts[i].steady and acts[i].kind == "F" and i + 1 < len(acts) and acts[i + 1].steady
            groups.append(acts[i:i + 1 + pair])
            i += 1 + pair
        return groups


def chunk_layers(n_layer, pp, v, rank):
    """The layer ranges of rank's chunks: chunk c is virtual stage c*pp + rank."""
    ranges = pipeline.split_layers(n_layer, pp * v)
    return [ranges[c * pp + rank] for c in range(v)]


# ----------------------------------------------------------------------------------------------
# Demo: 1F1B and interleaved 1F1B on the same model, against the serial model.


def demo(env, cfg, args):
    pp, m, v = args.pp, args.microbatches, args.virtual_stages
    pipeline.check_world(pp, env.world_size)  # every check runs before the first collective
    check_interleaving(pp, m, v)
    pipeline.split_layers(cfg.n_layer, pp * v)
    microbatches, full, ref_loss, ref_grads = pipeline_reference(cfg, args, m, env.device)
    say = printer(env)
    say(f"{cfg}\npp={pp} v={v} m={m} global batch B={args.batch_size} T={args.seq_len} float64, "
        f"world={env.world_size} ({dist.get_backend()})")
    say("layers per rank (1-based): " + "; ".join(
        f"rank {r}: " + ", ".join(f"{c.start + 1}-{c.stop}" for c in chunk_layers(cfg.n_layer, pp, v, r))
        for r in range(pp)))
    embed_group = dist.new_group([0, pp - 1], timeout=timedelta(seconds=60)) if pp > 1 else None
    runs = {"1f1b": pipeline.Schedule([pipeline.one_f_one_b(pp, m, s) for s in range(pp)]),
            "interleaved": InterleavedSchedule([interleaved(pp, m, s, v) for s in range(pp)])}
    # The same work per rank: a whole stage costs t_f=1, t_b=2, a chunk of it 1/v of that.
    times = {"1f1b": (1, 2), "interleaved": (Fraction(1, v), Fraction(2, v))}
    end = max(pipeline.simulate(runs[n], *times[n]).step_time for n in runs)
    ok, out = True, {}
    for name, schedule in runs.items():
        pipeline.validate(schedule, m)
        dist.barrier()  # the ranks start together, so their measured timelines line up
        chunks, result = pipeline.pipeline_step(cfg, schedule, dist.group.WORLD, embed_group, full, microbatches)
        kept = pipeline.pipeline_step(cfg, schedule, dist.group.WORLD, embed_group, full, microbatches, False)[1]
        worst = pipeline.differences(chunks, result, ref_loss, ref_grads)
        good, sim, ranks = demos.report_pipeline(env, name, schedule.lists, pipeline.simulate(schedule, *times[name]),
                                                 worst, result, kept, say, *times[name], end=end, width=150)
        ok &= good
        out[name] = sim, ranks
    demos.report_interleaving(say, pp, v, m, out["1f1b"], out["interleaved"])
    demos.write_trace(env, args.trace, {n: ranks for n, (_, ranks) in out.items()}, say)
    say(f"\n{'PASS' if ok else 'FAIL'}")
    return ok


# ----------------------------------------------------------------------------------------------
# After the concept: the schedule's checks, and the demo's command line.


def check_interleaving(pp, m, v):
    if v < 1:
        raise ValueError(f"the number of virtual stages v={v} must be at least 1")
    if m < 1:
        raise ValueError(f"the number of microbatches m={m} must be at least 1")
    if v > 1 and m % pp:
        raise ValueError(f"interleaving sends microbatches through the chunks in groups of pp: "
                         f"m={m} must be divisible by pp={pp}")


@dataclass
class DemoConfig(pipeline.PipelineDemoConfig):
    pp: int = 4  # pipeline ranks: CPU ranks started here, or torchrun's world
    virtual_stages: int = 2  # v: model chunks per rank


def parser():
    return cli.demo_parser(__doc__, DemoConfig, tensor_parallel.GPTConfig, vocab_size=1001, block_size=64, n_layer=8,
                           n_head=4, n_embd=64)


if __name__ == "__main__":
    run_main(lambda: pipeline.main(parser, demo))
