"""Pipeline schedules: ours (02_pipeline_1f1b.py, 03_interleaved.py) against torch's pipelining.

One step without the optimizer of our GPipe, 1F1B (02) and interleaved 1F1B (03) against
torch.distributed.pipelining's schedules over the very same chunk modules; also our
interleaved step against the simulator's prediction, and each stage's peak activations.
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_pipeline.py                                  # pp=2 and pp=4, all schedules
    python benchmarks/bench_pipeline.py --pp 4 --schedules 1f1b --repeats 7
    python benchmarks/bench_pipeline.py --pp 4 --profile                 # where the time goes
"""
import os
import statistics
import time
from datetime import timedelta
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

import harness
from harness import interleaved, pipeline, rel, tensor_parallel

SCHEDULES = ("gpipe", "1f1b", "interleaved")
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}

# float32 on both sides, same modules and same loss code; what may differ is the scaling of the m
# microbatch gradients (ours scales each loss by 1/m before backward, torch divides the sum by m
# afterwards). With m a power of two both are exact and the difference is 0; otherwise it moves the
# last bits only (~1e-7). A wrong microbatch, a missing 1/m or an unsynchronised tied weight shows
# up at 1e-2 or more.
PEER_LOSS_RTOL = 1e-6
PEER_GRAD_RTOL = 1e-5
# Ours against the serial model on the whole batch: one GEMM over B rows against m GEMMs of B/m.
SERIAL_LOSS_RTOL = 1e-5
SERIAL_GRAD_RTOL = 1e-4


# ----------------------------------------------------------------------------------------------
# The two sides of each comparison. A contender runs one step and returns the mean loss on the
# rank that holds the last stage (None elsewhere); its chunks carry the gradients.


class LastStageOutput(nn.Module):
    """torch's last stage must return the output its loss_fn reads: the logits. Our last chunk
    called without targets returns (logits, None); this keeps the logits. No parameters of its own,
    so the parameter names and the computation are the chunk's."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x)[0]


class Ours:
    """02's executor running this rank's action list (GPipe, 1F1B or 03's interleaved 1F1B)."""

    def __init__(self, chunks, actions, microbatches, act_shape):
        self.chunks, self.actions, self.microbatches, self.act_shape = chunks, actions, microbatches, act_shape
        self.last = None  # the last StepResult: its events and peak activation bytes

    def step(self):
        self.last = pipeline.execute(self.actions, self.chunks, dist.group.WORLD, self.microbatches,
                                     self.act_shape)
        return self.last.loss


class Peer:
    """torch.distributed.pipelining over the same chunk modules: one PipelineStage per chunk
    (stage index c*pp + rank for this rank's chunk c, the same placement as ours)."""

    def __init__(self, name, chunks, pp, rank, m, idx, targets, vocab_size):
        self.chunks, S, stages = chunks, pp * len(chunks), []
        for c, chunk in enumerate(chunks):
            k = c * pp + rank
            module = LastStageOutput(chunk) if k == S - 1 else chunk
            stages.append(PipelineStage(module, k, S, torch.device("cpu"), group=dist.group.WORLD))

        def loss_fn(logits, target):  # our cross-entropy (tp=1): the same arithmetic as our last chunk
            return tensor_parallel.vocab_parallel_cross_entropy(logits, target, None, vocab_size)

        cls = TORCH_SCHEDULES[name]
        single = cls is not ScheduleInterleaved1F1B
        self.schedule = cls(stages[0] if single else stages, m, loss_fn=loss_fn, scale_grads=True)
        self.has_last = any(s.is_last for s in stages)
        # The whole batch goes in; torch splits it into m microbatches along dim 0, the same rows
        # as 02's split_batch. Only the first stage reads the input, only the last the target.
        self.args = (idx,) if any(s.is_first for s in stages) else ()
        self.target = targets if self.has_last else None

    def step(self):
        # The mean of the per-microbatch mean losses equals ours (the token-weighted sum) because
        # every microbatch has the same number of tokens; no target is ignored here.
        losses = [] if self.has_last else None
        # return_outputs=False: a training loop has no use for the merged logits, and merging
        # them would be a cost ours does not pay.
        self.schedule.step(*self.args, target=self.target, losses=losses, return_outputs=False)
        return torch.stack(losses).mean() if self.has_last else None


def zero_grads(chunks):
    for c in chunks:
        c.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------
# The worker: one launch per pp. It builds every contender, checks that ours and the peer compute
# the same loss and gradients, then times them alternately.


def actions_of(name, pp, m, rank, v):
    """Our action list for `rank`: 02's GPipe or 1F1B, or 03's interleaved 1F1B over v chunks."""
    if name == "interleaved":
        return interleaved.interleaved(pp, m, rank, v)
    return pipeline.SCHEDULES[name](pp, m, rank)


def check_same(ours, peer, embed_group, serial_grads, serial_loss):
    """Loss and every gradient: peer against ours, ours against the serial model."""
    out = []
    for side in (ours, peer):
        zero_grads(side.chunks)
        loss = side.step()
        pipeline.sync_tied_embeddings(side.chunks, embed_group)
        out.append((None if loss is None else loss.item(),
                    {(c, n): p.grad.detach().clone() for c, chunk in enumerate(side.chunks)
                     for n, p in chunk.named_parameters()}))
    (l_ours, g_ours), (l_peer, g_peer) = out
    res = {"peer grad": harness.worst_rel(g_peer, g_ours),
           "serial grad": max(tensor_parallel.max_rel_diff(g, serial_grads[n]) for (_, n), g in g_ours.items())}
    if l_ours is not None:
        res.update({"ours loss": l_ours, "peer loss": l_peer, "serial loss": serial_loss,
                    "peer loss diff": rel(l_peer, l_ours), "serial loss diff": rel(l_ours, serial_loss)})
    zero_grads(ours.chunks)
    return res


def worker(env, cfg, args):
    pp, rank, m = env.world_size, env.rank, args.microbatches
    b, T = args.microbatch_size, args.seq_len
    full, gen = harness.start(cfg, args.seed)
    idx, targets = torch.randint(cfg.vocab_size, (2, m * b, T), generator=gen)
    microbatches = pipeline.split_batch(idx, targets, m)
    embed_group = dist.new_group([0, pp - 1], timeout=timedelta(seconds=args.timeout))

    # Every rank computes the serial model's gradients on the whole batch once, for the check.
    serial = harness.gpt(cfg, full)
    loss = serial(idx, targets)[1]
    loss.backward()
    serial_loss, serial_grads = loss.detach().item(), {n: p.grad for n, p in serial.named_parameters()}
    del serial, loss

    chunk_sets, pairs = {}, {}  # v -> this rank's chunks, which ours and the peer share
    for name in args.schedules:
        v = args.virtual_stages if name == "interleaved" else 1
        pipeline.validate([actions_of(name, pp, m, r, v) for r in range(pp)], pp, m)
        if v not in chunk_sets:
            chunk_sets[v] = pipeline.build_chunks(cfg, pp, rank, v, init=False, dtype=torch.float32)
            for c in chunk_sets[v]:
                c.load_full_state_dict(full)
        chunks = chunk_sets[v]
        pairs[name] = (Ours(chunks, actions_of(name, pp, m, rank, v), microbatches, (b, T, cfg.n_embd)),
                       Peer(name, chunks, pp, rank, m, idx, targets, cfg.vocab_size))

    # The first step of a torch schedule infers shapes (a real forward and backward on microbatch
    # 0) and exchanges them: everything runs once, and --warmup more times, before the check (which
    # changes no weight) and the timing.
    for pair in pairs.values():
        for side in pair:
            for _ in range(1 + args.warmup):
                zero_grads(side.chunks)
                side.step()

    checks = {name: check_same(ours, peer, embed_group, serial_grads, serial_loss)
              for name, (ours, peer) in pairs.items()}
    memory = {name: ours.last.peak_activation_bytes for name, (ours, _) in pairs.items()}
    ok = all(c["peer grad"] <= PEER_GRAD_RTOL and c["serial grad"] <= SERIAL_GRAD_RTOL
             and c.get("peer loss diff", 0) <= PEER_LOSS_RTOL
             and c.get("serial loss diff", 0) <= SERIAL_LOSS_RTOL for c in checks.values())
    if not harness.agree(ok):  # every rank must agree before any of them times anything
        return {"same": False, "checks": checks}
    sides = {name: {"ours": ours.step, "peer": peer.step} for name, (ours, peer) in pairs.items()}
    zero = {name: (lambda _, c=ours.chunks: zero_grads(c)) for name, (ours, _) in pairs.items()}  # shared chunks
    rounds = {name: harness.alternate(sides[name], args.repeats, args.steps, sweeps=True, setup=zero[name])
              for name in pairs}
    # Our last timed step of each schedule: its action timeline and message count.
    out = {"same": True, "checks": checks, "memory": memory, "rounds": rounds, "profiles": [],
           "events": {name: ours.last.events for name, (ours, _) in pairs.items()},
           "messages": {name: ours.last.messages for name, (ours, _) in pairs.items()}}
    if args.profile:
        for name in pairs:
            out["profiles"] += harness.profiles(sides[name], args.profile_rows, setup=zero[name],
                                                title=f"{name} ").values()
    return out


# ----------------------------------------------------------------------------------------------
# Report and command line. A step is as slow as its slowest rank; its CPU cost is the sum over ranks.


def action_times(events, v=1):
    """Median forward and backward durations (s) over every rank's actions in one step, times v
    (so that a chunk's time is compared with a whole stage's)."""
    f = [e - s for evs in events for s, e, a in evs if a.kind == "F"]
    b = [e - s for evs in events for s, e, a in evs if a.kind == "B"]
    return statistics.median(f) * v, statistics.median(b) * v


def report(args, pp, results):
    say, m, v = print, args.microbatches, args.virtual_stages
    cores = os.cpu_count()
    say(f"\n=== pp={pp}: {pp} gloo ranks x 1 thread on {cores} cores; m={m} microbatches of "
        f"{args.microbatch_size} x {args.seq_len} tokens; v={v} for interleaved ===")
    say("same function (peer against ours; ours against the serial model on the whole batch):")
    for name in args.schedules:
        c = results[pp - 1]["checks"][name]  # the rank that holds the last stage has the loss
        g_peer = max(r["checks"][name]["peer grad"] for r in results)
        g_serial = max(r["checks"][name]["serial grad"] for r in results)
        say(f"  {name:11s} loss ours {c['ours loss']:.7f} peer {c['peer loss']:.7f} (rel "
            f"{c['peer loss diff']:.1e}) serial {c['serial loss']:.7f} "
            f"(rel {c['serial loss diff']:.1e}); "
            f"worst grad peer/ours {g_peer:.1e}, ours/serial {g_serial:.1e}")
    if not harness.verdict(all(r["same"] for r in results),
                           f"peer: loss {PEER_LOSS_RTOL:g}, grad {PEER_GRAD_RTOL:g}; serial: loss {SERIAL_LOSS_RTOL:g}, "
                           f"grad {SERIAL_GRAD_RTOL:g}; grad = max |a-b| / max |b|, worst tensor"):
        return False

    rounds = results[0]["rounds"]  # combined over the ranks: every rank holds the same figures
    say("\nstep time (goal: ours <= 0.8 x torch), in sweeps")
    for name in args.schedules:
        say(f"{name}: {harness.time_table(rounds[name], pp)}\n  {harness.pair_line(rounds[name], 'ours', 'peer', 0.8)}")
    # Ours per schedule: (wall, main-thread CPU, other threads' CPU: gloo's)
    rows = {name: [harness.median_of(rounds[name], "ours", col) for col in range(3)] for name in args.schedules}
    rows = {name: (wall, main, cpu - main) for name, (wall, cpu, main) in rows.items()}

    if "1f1b" in rows and "interleaved" in rows:
        # Uniform per-stage times from our measured 1F1B actions; a chunk of the interleaved
        # schedule holds 1/v of a stage's layers, so the simulator gives it t_f/v and t_b/v.
        t_f, t_b = action_times([r["events"]["1f1b"] for r in results])
        c_f, c_b = action_times([r["events"]["interleaved"] for r in results], v)
        one = pipeline.simulate([pipeline.one_f_one_b(pp, m, s) for s in range(pp)], pp,
                                Fraction(t_f), Fraction(t_b))
        il = pipeline.simulate([interleaved.interleaved(pp, m, s, v) for s in range(pp)], pp,
                               Fraction(t_f) / v, Fraction(t_b) / v)
        predicted = float(il.step_time / one.step_time)
        measured = rows["interleaved"][0] / rows["1f1b"][0]
        cpu = [rows[n][1:] for n in ("1f1b", "interleaved")]
        msgs = [sum(r["messages"][n] for r in results) for n in ("1f1b", "interleaved")]
        say(f"\nours, interleaved (v={v}) / 1F1B step time: measured {measured:.3f}, simulator "
            f"{predicted:.3f} (bubble {float(one.bubble):.3f} -> {float(il.bubble):.3f}; uniform "
            f"t_f={t_f * 1e3:.2f} ms, t_b={t_b * 1e3:.2f} ms per stage from the measured 1F1B actions)")
        say(f"  a chunk's F and B took {c_f / t_f:.2f}x and {c_b / t_b:.2f}x of 1/v of a stage's "
            f"(wall); p2p messages per step {msgs[0]} -> {msgs[1]}; CPU per step, main threads "
            f"{cpu[0][0] * 1e3:.1f} -> {cpu[1][0] * 1e3:.1f} ms, other threads {cpu[0][1] * 1e3:.1f} "
            f"-> {cpu[1][1] * 1e3:.1f} ms")
        # The simulator gives every rank its own processor and free messages. Here the ranks share
        # the cores, so no step can be shorter than the CPU it burns spread over the usable cores.
        floors = [sum(c) / min(pp, cores) for c in cpu]
        say(f"  CPU floor (summed CPU / {min(pp, cores)} usable cores): 1F1B {floors[0] * 1e3:.1f} ms, "
            f"interleaved {floors[1] * 1e3:.1f} ms ({floors[1] / floors[0]:.3f}x)")

    mem = {n: [r["memory"][n] for r in results] for n in args.schedules}
    say("\npeak stored activation bytes per stage, ours (02's saved-tensor count, outputs "
        "deallocated), MiB:")
    for name, per_stage in mem.items():
        say(f"  {name:11s} {' '.join(f'{x / 2**20:7.2f}' for x in per_stage)}")
    if "gpipe" in mem and "1f1b" in mem:
        say(f"  1f1b/gpipe  {' '.join(f'{a / g:7.3f}' for a, g in zip(mem['1f1b'], mem['gpipe']))}"
            f"   (in flight (pp - stage) / m = {' '.join(f'{(pp - s) / m:.3f}' for s in range(pp))})")
    for table in results[0]["profiles"]:
        say(table)
    return True


def main():
    parser = harness.parser(__doc__, repeats=5, steps=3, warmup=0, vocab_size=512, block_size=128,
                            n_layer=8, n_head=4, n_embd=128)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4],
                        help="pipeline sizes to run, one launch (pp CPU ranks) each")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES),
                        help="which of ours against torch's")
    parser.add_argument("--virtual-stages", type=int, default=2, help="v for the interleaved schedule")
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--seq-len", type=int, default=64, help="T")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    args = parser.parse_args()
    cfg = harness.model_config(args, needs_numpy="torch.distributed.pipelining")
    if args.seq_len > cfg.block_size:
        raise ValueError(f"--seq-len {args.seq_len} exceeds --block-size {cfg.block_size}")
    v = args.virtual_stages
    for pp in args.pp:  # refuse what cannot run before starting any rank
        pipeline.split_layers(cfg.n_layer, pp * (v if "interleaved" in args.schedules else 1))
        if "interleaved" in args.schedules:
            interleaved.check_interleaving(pp, args.microbatches, v)
        if args.microbatches < pp:
            raise ValueError(f"torch's Schedule1F1B needs m >= pp; got m={args.microbatches}, pp={pp}")
    print(f"config: {cfg}; float32, tied embeddings; torch {torch.__version__}")
    for pp in args.pp:
        t0 = time.perf_counter()
        results = harness.launch(worker, pp, cfg, args, timeout_s=args.timeout, deadline_s=args.deadline)
        ok = report(args, pp, results)
        print(f"(pp={pp} took {time.perf_counter() - t0:.0f} s)")
        if not ok:
            return False
    return True


if __name__ == "__main__":
    harness.run_main(main)
