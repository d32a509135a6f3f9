"""The pipeline demos' harness (02 and 03): the serial reference, one step of a schedule run and
compared with it, and the report of timelines, bubble, memory and traffic.

Each function takes the pipeline module (02) as its first argument rather than importing it, so
that 02's own demo can use it without an import cycle:

    ref = serial_reference(pipeline, env, cfg, args, m)
    ok, sim, ranks = check_and_report(pipeline, env, cfg, "1f1b", schedule, ref, embed_group, say)
"""
import importlib
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from plumbing.launch import gather_numbers

tensor_parallel = importlib.import_module("01_tensor_parallel")


def serial_reference(pipeline, env, cfg, args, m):
    """What every demo compares against: the batch cut into m microbatches, the full float64
    weights, and the serial model's loss and gradients on that batch."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx, targets = torch.randint(cfg.vocab_size, (2, args.batch_size, args.seq_len), generator=gen).to(env.device)
    full = tensor_parallel.init_state_dict(cfg, args.seed, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float64, device=env.device)
    serial.load_full_state_dict(full)
    loss = serial(idx, targets)[1]
    loss.backward()
    return pipeline.split_batch(idx, targets, m), full, loss.detach(), {n: p.grad for n, p in serial.named_parameters()}


@dataclass
class RankFigures:
    """One rank's figures from a demo step, gathered to every rank as numbers (no pickling)."""
    worst: float  # max relative difference against serial, over its loss and gradients
    events: list  # [(start_s, end_s, Action)] as executed
    peak_bytes: int  # peak stored activation bytes, outputs deallocated
    peak_bytes_kept: int  # the same with outputs kept
    messages: int
    bytes_sent: int


def run_and_compare(pipeline, env, cfg, schedule, ref, embed_group):
    """One step of `schedule` (every rank's list) from the reference's weights, twice (outputs
    deallocated, then kept); every rank's RankFigures."""
    microbatches, full, ref_loss, ref_grads = ref
    B, T = microbatches[0][0].shape
    runs = []
    for deallocate in (True, False):
        chunks = pipeline.build_chunks(cfg, len(schedule), env.rank, pipeline.n_chunks(schedule[env.rank]), init=False,
                              dtype=torch.float64, device=env.device)
        for c in chunks:
            c.load_full_state_dict(full)
        dist.barrier()
        runs.append(pipeline.execute(schedule[env.rank], chunks, dist.group.WORLD, microbatches, (B, T, cfg.n_embd),
                            deallocate=deallocate))
        pipeline.sync_tied_embeddings(chunks, embed_group)
        if deallocate:
            diffs = [tensor_parallel.max_rel_diff(p.grad, ref_grads[n]) for c in chunks for n, p in c.named_parameters()]
            diffs += [tensor_parallel.max_rel_diff(runs[0].loss, ref_loss)] if runs[0].loss is not None else []
    res, kept = runs
    flat = [max(diffs), res.peak_activation_bytes, kept.peak_activation_bytes, res.messages, res.bytes_sent]
    flat += [t for s, e, _ in res.events for t in (s, e)]  # the i-th event is the i-th action of the list
    return [RankFigures(row[0], [(row[5 + 2 * i], row[6 + 2 * i], a) for i, a in enumerate(schedule[r])],
                        *(int(x) for x in row[1:5]))
            for r, row in enumerate(gather_numbers(flat, device=env.device))]


def check_and_report(pipeline, env, cfg, name, schedule, ref, embed_group, say, t_f=1, t_b=2, end=None,
                     width=100):
    """Run `schedule`, compare with the serial reference, and print its timelines, bubble, memory
    and traffic. Returns (ok, the simulation, every rank's RankFigures)."""
    pp, m, v = len(schedule), len(ref[0]), pipeline.n_chunks(schedule[0])
    ranks = run_and_compare(pipeline, env, cfg, schedule, ref, embed_group)
    worst, sim, formula = max(r.worst for r in ranks), pipeline.simulate(schedule, pp, t_f, t_b), Fraction(pp - 1, v * m)
    busy = sum(e - s for r in ranks for s, e, _ in r.events)
    span = max(r.events[-1][1] for r in ranks) - min(r.events[0][0] for r in ranks)
    say(f"\n=== {name}: pp={pp} v={v} m={m} ===")
    say(f"simulated timeline (t_f={t_f}, t_b={t_b} per chunk):\n{pipeline.render(sim.timeline, width, end)}")
    say(f"bubble: simulated {sim.bubble} = {float(sim.bubble):.4f}, formula (pp-1)/(v m) = {formula}"
        f"  {'(equal)' if sim.bubble == formula else '(DIFFERENT)'}")
    say(f"measured timeline (this run):\n{pipeline.render([r.events for r in ranks])}\n"
        f"measured idle / busy: {(pp * span - busy) / busy:.3f}")
    if env.device.type == "cpu":
        say(f"  not the simulated {float(sim.bubble):.3f}: the simulator gives every rank a device of "
            f"its own, while here\n  {pp} ranks share this machine's cores, and time spent waiting "
            f"for a core counts as idle")
    say(f"peak microbatches in flight per stage (simulated, all chunks): {sim.peak_in_flight}")
    say(f"peak stored activation bytes per stage, outputs deallocated: {[r.peak_bytes for r in ranks]}")
    say(f"                                          outputs kept:        {[r.peak_bytes_kept for r in ranks]}")
    say(f"p2p messages sent per stage: {[r.messages for r in ranks]}, bytes: {[r.bytes_sent for r in ranks]}")
    say(f"max relative difference against serial (loss and every gradient): {worst:.2e} "
        f"{'PASS' if worst <= 1e-10 else 'FAIL'} (tolerance 1e-10)")
    return worst <= 1e-10 and sim.bubble == formula, sim, ranks
