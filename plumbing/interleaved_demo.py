"""03_interleaved.py's demo, the part that is not the concept: its flags, the schedule's check, and
the demo's machine part (prove_machine), which runs 03's machine and prints it. 03 imports each name
back, so `interleaved.prove_machine` and the rest are where they were.

    check_interleaving(pp, m, v)   v and m at least 1, and m a multiple of pp when v > 1
    DemoConfig, parser()           the demo's flags (02's, with pp and v)
    prove_machine(env, ...)        1F1B and interleaved 1F1B as 02's lists, run, drawn, each against
                                   serial; the interleaved one against 03's lesson

It imports 02 (whose flags it extends) at import, and 03 only when called: 03 imports this module.
"""
import importlib
from dataclasses import dataclass
from datetime import timedelta
from fractions import Fraction

import torch.distributed as dist

from plumbing import cli, demos

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")


def check_interleaving(pp, m, v):
    """Microbatches go through the chunks in groups of pp, so m must be divisible by pp (the paper's
    requirement, kept here; Megatron Core now groups by microbatch_group_size_per_vp_stage, pp by
    default, and lets the last group be shorter)."""
    if v < 1:
        raise ValueError(f"the number of virtual stages v={v} must be at least 1")
    if m < 1:
        raise ValueError(f"the number of microbatches m={m} must be at least 1")
    if v > 1 and m % pp:
        raise ValueError(f"interleaving runs microbatches in groups of pp: m={m} must be divisible by pp={pp}")


@dataclass
class DemoConfig(pipeline.PipelineDemoConfig):
    pp: int = 4  # pipeline ranks: CPU ranks started here, or torchrun's world
    virtual_stages: int = 2  # v: model chunks per rank


def parser():
    """03's parser, described by 03's docstring (read at call time: 03 imports this module)."""
    return cli.demo_parser(importlib.import_module("03_interleaved").__doc__, DemoConfig, tensor_parallel.GPTConfig,
                           vocab_size=1001, block_size=64, n_layer=8, n_head=4, n_embd=64)


def prove_machine(env, cfg, args, reference, lesson, say):
    """1F1B and interleaved 1F1B as lists, validated, executed through 02's pipeline_step, reported, each
    against serial; the interleaved one's loss and gradients against the lesson's."""
    interleaved = importlib.import_module("03_interleaved")  # at call time: 03 imports this module
    (microbatches, full, ref_loss, ref_grads), pp, m, v = reference, args.pp, args.microbatches, args.virtual_stages
    say("layers per rank (1-based): " + "; ".join(
        f"rank {r}: " + ", ".join(f"{c.start + 1}-{c.stop}" for c in interleaved.chunk_layers(cfg.n_layer, pp, v, r))
        for r in range(pp)))
    embed_group = dist.new_group([0, pp - 1], timeout=timedelta(seconds=60)) if pp > 1 else None
    runs = {"1f1b": pipeline.Schedule([pipeline.one_f_one_b(pp, m, s) for s in range(pp)]),
            "interleaved": interleaved.InterleavedSchedule([interleaved.interleaved(pp, m, s, v) for s in range(pp)])}
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
        if name == "interleaved":
            got = result.loss, {n: p.grad for c in chunks for n, p in c.named_parameters()}
            same = demos.worst_difference(got, *lesson)
            say(f"the machine (InterleavedSchedule through pipeline_step) against the lesson's interleaved_step "
                f"(loss and every gradient): {same:.2e} {'PASS' if same <= 1e-12 else 'FAIL'} (tolerance 1e-12)")
            ok &= same <= 1e-12
    demos.report_interleaving(say, pp, v, m, out["1f1b"], out["interleaved"])
    demos.write_trace(env, args.trace, {n: ranks for n, (_, ranks) in out.items()}, say)
    say(f"\n{'PASS' if ok else 'FAIL'}")
    return ok
