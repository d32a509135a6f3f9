"""Pipeline schedules: ours (02_pipeline_1f1b.py, 03_interleaved.py) against torch's pipelining.

What it measures, on CPU ranks fork-started with gloo by 01's launch (one thread each):

  (a) the step time of our GPipe and our 1F1B against torch's ScheduleGPipe and Schedule1F1B;
  (b) our interleaved 1F1B against torch's ScheduleInterleaved1F1B (v PipelineStages per rank);
  (c) our interleaved step time against our own 1F1B step time, beside the ratio 02's simulator
      predicts for the same schedules (per-chunk times t_f/v and t_b/v);
  (d) the peak stored activation bytes per stage of our GPipe and our 1F1B (StepResult).

A step is one training step without the optimizer: every microbatch forward and backward through
the whole pipeline, gradients accumulated in the chunks. Both sides run the SAME modules: the GPT
chunks that build_chunks() returns, with the same weights, on the same microbatches. torch's
PipelineStage wraps those very chunk objects; only the last one gets a small adapter, because
torch wants the last stage to return an output and computes the loss with the schedule's loss_fn
(our cross-entropy function, so the arithmetic is identical). torch's schedules divide every
gradient by m at the end (scale_grads=True) and report unscaled per-microbatch losses; our
executor weights each microbatch loss by its share of the tokens (1/m here) before backward. Both
give the mean loss over the batch and its gradient; the check below proves it before any timing.

Tied embeddings: the first and the last stage each hold a copy of wte (the output layer is tied
to it). Neither runtime ties across ranks by itself, so both get the same fix, 02's
sync_tied_embeddings() (an all-reduce of the two copies' gradients), after the step. It runs in
the correctness check and is left out of the timed region, for both.

Timing: every contender runs one untimed step first (torch's first step infers shapes), then the
check. Each of --repeats rounds (after --warmup extra untimed steps of each) runs, per schedule,
--steps timed steps of ours and of the peer alternately, step by step, with who goes first
alternating between steps and between rounds; a barrier precedes each timed step. A step's wall
time is its slowest rank's; its CPU time (main thread, and the other threads: gloo's) is summed
over ranks. Reported per schedule: the medians, the ratio of the medians, the median of the
paired ratios (ours step i / peer step i, run back to back, so under the same machine load) with
its quartiles, and the per-round ratios. The machine is usually shared: read the paired ratio and
the CPU columns, and treat differences of less than about 10 % as noise.

Run it (from the repository root; it starts its own ranks, do not use torchrun):
    python benchmarks/bench_pipeline.py                                  # pp=2 and pp=4, all schedules
    python benchmarks/bench_pipeline.py --pp 4 --schedules 1f1b --repeats 7
    python benchmarks/bench_pipeline.py --pp 2 --n-embd 256 --seq-len 128 --microbatch-size 4
    python benchmarks/bench_pipeline.py --pp 4 --profile                 # where the time goes
"""
import argparse
import importlib
import os
import statistics
import sys
import time
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
tp = importlib.import_module("01_tensor_parallel")  # the names start with a digit
pipe = importlib.import_module("02_pipeline_1f1b")
inter = importlib.import_module("03_interleaved")

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

    def __init__(self, name, chunks, actions, microbatches, act_shape):
        self.name, self.chunks, self.actions = name, chunks, actions
        self.microbatches, self.act_shape = microbatches, act_shape
        self.last = None  # the last StepResult: its events and peak activation bytes

    def step(self):
        self.last = pipe.execute(self.actions, self.chunks, dist.group.WORLD, self.microbatches,
                                 self.act_shape)
        return self.last.loss


class Peer:
    """torch.distributed.pipelining over the same chunk modules: one PipelineStage per chunk
    (stage index c*pp + rank for this rank's chunk c, the same placement as ours)."""

    def __init__(self, name, chunks, pp, rank, m, idx, targets, vocab_size):
        self.name, self.chunks = name, chunks
        S = pp * len(chunks)
        stages = []
        for c, chunk in enumerate(chunks):
            k = c * pp + rank
            module = LastStageOutput(chunk) if k == S - 1 else chunk
            stages.append(PipelineStage(module, k, S, torch.device("cpu"), group=dist.group.WORLD))

        def loss_fn(logits, target):  # our cross-entropy (tp=1): the same arithmetic as our last chunk
            return tp.vocab_parallel_cross_entropy(logits, target, None, vocab_size)

        cls = TORCH_SCHEDULES[name]
        single = cls is not ScheduleInterleaved1F1B
        self.schedule = cls(stages[0] if single else stages, m, loss_fn=loss_fn, scale_grads=True)
        has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        # The whole batch goes in; torch splits it into m microbatches along dim 0, the same rows
        # as 02's split_batch. Only the first stage reads the input, only the last the target.
        self.args = (idx,) if has_first else ()
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
        for p in c.parameters():
            p.grad = None


def grads_of(chunks):
    return {(c, n): p.grad.detach().clone() for c, chunk in enumerate(chunks)
            for n, p in chunk.named_parameters()}


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


# ----------------------------------------------------------------------------------------------
# The worker: one launch per pp. It builds every contender, checks that ours and the peer compute
# the same loss and gradients, then times them alternately.


def actions_of(name, pp, m, rank, v):
    """Our action list for `rank`: 02's GPipe or 1F1B, or 03's interleaved 1F1B over v chunks."""
    if name == "interleaved":
        return inter.interleaved(pp, m, rank, v)
    return pipe.SCHEDULES[name](pp, m, rank)


def timed_step(run):
    """One step after a barrier. Returns this rank's wall seconds (the report keeps the slowest
    rank's), its main thread's CPU seconds and its other threads' (gloo's TCP loop). CPU time is
    what the step cost whatever else runs on the machine; the report sums it over ranks."""
    dist.barrier()
    t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
    run()
    wall, main = time.perf_counter() - t0, time.thread_time() - c0
    return wall, main, time.process_time() - p0 - main


def check_same(ours, peer, embed_group, serial_grads, serial_loss):
    """Loss and every gradient: peer against ours, ours against the serial model."""
    out = {}
    for side in (ours, peer):
        zero_grads(side.chunks)
        loss = side.step()
        pipe.sync_tied_embeddings(side.chunks, embed_group)
        out[side] = (None if loss is None else loss.detach().item(), grads_of(side.chunks))
    (l_ours, g_ours), (l_peer, g_peer) = out[ours], out[peer]
    peer_grad = max(tp.max_rel_diff(g_peer[k], g_ours[k]) for k in g_ours)
    serial_grad = max(tp.max_rel_diff(g, serial_grads[n]) for (_, n), g in g_ours.items())
    res = {"peer grad": peer_grad, "serial grad": serial_grad}
    if l_ours is not None:
        res.update({"ours loss": l_ours, "peer loss": l_peer, "serial loss": serial_loss,
                    "peer loss diff": rel(l_peer, l_ours), "serial loss diff": rel(l_ours, serial_loss)})
    zero_grads(ours.chunks)
    return res


def profile_table(run, rows):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def worker(env, cfg, args):
    pp, rank, m = env.world_size, env.rank, args.microbatches
    b, T = args.microbatch_size, args.seq_len
    # random_all: non-zero biases and LayerNorm weights, so the check exercises them too.
    full = tp.init_state_dict(cfg, args.seed, dtype=torch.float32, random_all=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx, targets = torch.randint(cfg.vocab_size, (2, m * b, T), generator=gen)
    microbatches = pipe.split_batch(idx, targets, m)
    embed_group = dist.new_group([0, pp - 1], timeout=timedelta(seconds=args.timeout))

    # Every rank computes the serial model's gradients on the whole batch once, for the check.
    serial = tp.GPT(cfg, None, init=False)
    serial.load_full_state_dict(full)
    loss = serial(idx, targets)[1]
    loss.backward()
    serial_loss, serial_grads = loss.detach().item(), {n: p.grad for n, p in serial.named_parameters()}
    del serial, loss

    chunk_sets = {}  # v -> this rank's chunks; ours and the peer share them

    def chunks_for(v):
        if v not in chunk_sets:
            chunk_sets[v] = pipe.build_chunks(cfg, pp, rank, v, init=False, dtype=torch.float32)
            for c in chunk_sets[v]:
                c.load_full_state_dict(full)
        return chunk_sets[v]

    pairs = {}
    for name in args.schedules:
        v = args.virtual_stages if name == "interleaved" else 1
        pipe.validate([actions_of(name, pp, m, r, v) for r in range(pp)], pp, m)
        chunks = chunks_for(v)
        ours = Ours(name, chunks, actions_of(name, pp, m, rank, v), microbatches, (b, T, cfg.n_embd))
        pairs[name] = (ours, Peer(name, chunks, pp, rank, m, idx, targets, cfg.vocab_size))

    # The first step of a torch schedule infers shapes (a real forward and backward on microbatch
    # 0) and exchanges them: run everything once before checking and timing.
    for pair in pairs.values():
        for side in pair:
            zero_grads(side.chunks)
            side.step()

    checks, memory = {}, {}
    for name, (ours, peer) in pairs.items():
        checks[name] = check_same(ours, peer, embed_group, serial_grads, serial_loss)
        memory[name] = ours.last.peak_activation_bytes
    ok = all(c["peer grad"] <= PEER_GRAD_RTOL and c["serial grad"] <= SERIAL_GRAD_RTOL
             and c.get("peer loss diff", 0) <= PEER_LOSS_RTOL
             and c.get("serial loss diff", 0) <= SERIAL_LOSS_RTOL for c in checks.values())
    oks = [None] * pp
    dist.all_gather_object(oks, ok)  # every rank must agree before any of them times anything
    if not all(oks):
        return {"same": False, "checks": checks}

    # rounds[i][(schedule, "ours" | "peer")] = [timed_step() per step] on this rank. The machine is
    # shared, so ours and the peer alternate step by step (the load drifts over seconds); who goes
    # first alternates too, between steps and between rounds.
    rounds = []
    for r in range(args.repeats):
        for pair in pairs.values():
            for side in pair:
                for _ in range(args.warmup):
                    zero_grads(side.chunks)
                    side.step()
        this_round = {(name, s): [] for name in pairs for s in ("ours", "peer")}
        for name, (ours, peer) in pairs.items():
            for i in range(args.steps):
                order = [("ours", ours), ("peer", peer)][:: 1 if (r + i) % 2 == 0 else -1]
                for side_name, side in order:
                    zero_grads(side.chunks)  # not timed: the same for both
                    this_round[(name, side_name)].append(timed_step(side.step))
        rounds.append(this_round)
    # Our last timed step of each schedule: its action timeline and message count.
    events = {name: ours.last.events for name, (ours, _) in pairs.items()}
    messages = {name: ours.last.messages for name, (ours, _) in pairs.items()}

    profiles = {}
    if args.profile:
        for name, pair in pairs.items():
            for side_name, side in zip(("ours", "peer"), pair):
                zero_grads(side.chunks)
                dist.barrier()
                if rank == args.profile_rank:
                    profiles[(name, side_name)] = profile_table(side.step, args.profile_rows)
                else:
                    side.step()

    return {"same": True, "checks": checks, "memory": memory, "rounds": rounds, "events": events,
            "messages": messages, "profiles": profiles}


# ----------------------------------------------------------------------------------------------
# Report: combine the ranks' numbers. A step is as slow as its slowest rank; its CPU cost is the
# sum over ranks.


def step_times(results, i, key):
    """Round i's steps of `key` as (slowest rank's wall s, main-thread CPU s summed over ranks,
    other threads' CPU s summed over ranks)."""
    per_rank = [r["rounds"][i][key] for r in results]
    return [(max(t[0] for t in ts), sum(t[1] for t in ts), sum(t[2] for t in ts))
            for ts in zip(*per_rank)]


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
    tols = (f"peer: loss {PEER_LOSS_RTOL:g}, grad {PEER_GRAD_RTOL:g}; serial: loss "
            f"{SERIAL_LOSS_RTOL:g}, grad {SERIAL_GRAD_RTOL:g}; grad = max |a-b| / max |b|, worst tensor")
    if not all(r["same"] for r in results):
        say(f"FAIL: beyond the tolerances ({tols}); not timing different functions")
        return False
    say(f"  all within tolerance ({tols})")

    rows = {}
    for name in args.schedules:
        row = {}
        steps = {}
        for side in ("ours", "peer"):
            per_round = [step_times(results, i, (name, side)) for i in range(args.repeats)]
            steps[side] = [t for rnd in per_round for t in rnd]
            row[side] = tuple(statistics.median(t[j] for t in steps[side]) for j in range(3))
            row[side + " rounds"] = [statistics.median(t[0] for t in rnd) for rnd in per_round]
        row["ratio"] = row["ours"][0] / row["peer"][0]
        row["round ratios"] = [o / p for o, p in zip(row["ours rounds"], row["peer rounds"])]
        # Step i of ours and step i of the peer ran back to back: their ratio sees the same load.
        paired = sorted(o[0] / p[0] for o, p in zip(steps["ours"], steps["peer"]))
        n = len(paired)
        row["paired"] = (statistics.median(paired), paired[n // 4], paired[(3 * n) // 4])
        rows[name] = row
    say(f"\nstep time, ms: median of {args.repeats} rounds x {args.steps} steps, wall = slowest rank; "
        f"CPU summed over ranks, main thread + other threads (gloo); goal: ours <= 0.8 x torch")
    say(f"  {'schedule':11s} {'ours':>7s} {'torch':>7s} {'ratio':>6s} {'paired [quartiles]':>19s}   "
        f"{'CPU ours':>13s} {'CPU torch':>13s}   per-round ratios")
    for name, row in rows.items():
        (o, om, og), (p, pm, pg) = row["ours"], row["peer"]
        pm_, q1, q3 = row["paired"]
        say(f"  {name:11s} {o * 1e3:7.1f} {p * 1e3:7.1f} {row['ratio']:6.3f} "
            f"{pm_:6.3f} [{q1:.2f}, {q3:.2f}]   "
            f"{om * 1e3:6.1f} + {og * 1e3:4.1f} {pm * 1e3:6.1f} + {pg * 1e3:4.1f}   "
            f"{' '.join(f'{x:.2f}' for x in row['round ratios'])}")
    say("  ratio = ours median / torch median; paired = median over steps of ours step i / torch "
        "step i, which ran back to back (the better gauge on a loaded machine)")

    if "1f1b" in rows and "interleaved" in rows:
        # Uniform per-stage times from our measured 1F1B actions; a chunk of the interleaved
        # schedule holds 1/v of a stage's layers, so the simulator gives it t_f/v and t_b/v.
        t_f, t_b = action_times([r["events"]["1f1b"] for r in results])
        c_f, c_b = action_times([r["events"]["interleaved"] for r in results], v)
        one = pipe.simulate([pipe.one_f_one_b(pp, m, s) for s in range(pp)], pp,
                            Fraction(t_f), Fraction(t_b))
        il = pipe.simulate([inter.interleaved(pp, m, s, v) for s in range(pp)], pp,
                           Fraction(t_f) / v, Fraction(t_b) / v)
        predicted = float(il.step_time / one.step_time)
        measured = rows["interleaved"]["ours"][0] / rows["1f1b"]["ours"][0]
        cpu = [rows[n]["ours"][1:] for n in ("1f1b", "interleaved")]
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

    for r in results:
        for (name, side), table in r["profiles"].items():
            say(f"\n--- profile: {'torch' if side == 'peer' else 'ours'} {name}, rank "
                f"{args.profile_rank}, top {args.profile_rows} by self CPU time")
            say(table)
    return True


# ----------------------------------------------------------------------------------------------
# Command line


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4],
                        help="pipeline sizes to run, one launch (pp CPU ranks) each")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--virtual-stages", type=int, default=2, help="v for the interleaved schedule")
    parser.add_argument("--microbatches", type=int, default=8, help="m")
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--seq-len", type=int, default=64, help="T")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; who goes first alternates")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender per round")
    parser.add_argument("--warmup", type=int, default=0,
                        help="extra untimed steps of each per round (one of each always runs first)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--profile", action="store_true", help="profile one step of each contender")
    parser.add_argument("--profile-rank", type=int, default=0)
    parser.add_argument("--profile-rows", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds per launch")
    tp.add_dataclass_args(parser, tp.GPTConfig, vocab_size=512, block_size=128, n_layer=8,
                          n_head=4, n_embd=128)
    args = parser.parse_args()
    cfg = tp.from_args(tp.GPTConfig, args)
    if "RANK" in os.environ:
        raise ValueError("run this directly, not under torchrun: it starts its own CPU ranks")
    if args.seq_len > cfg.block_size:
        raise ValueError(f"--seq-len {args.seq_len} exceeds --block-size {cfg.block_size}")
    v = args.virtual_stages
    for pp in args.pp:  # refuse what cannot run before starting any rank
        pipe.split_layers(cfg.n_layer, pp * (v if "interleaved" in args.schedules else 1))
        if "interleaved" in args.schedules:
            inter.check_interleaving(pp, args.microbatches, v)
        if args.microbatches < pp:
            raise ValueError(f"torch's Schedule1F1B needs m >= pp; got m={args.microbatches}, pp={pp}")
        if args.profile and not 0 <= args.profile_rank < pp:
            raise ValueError(f"--profile-rank {args.profile_rank} is not a rank of pp={pp}")
    print(f"config: {cfg}; float32, tied embeddings; torch {torch.__version__}")
    for pp in args.pp:
        t0 = time.perf_counter()
        results = tp.launch(worker, pp, cfg, args, timeout_s=args.timeout, deadline_s=args.deadline)
        ok = report(args, pp, results)
        print(f"(pp={pp} took {time.perf_counter() - t0:.0f} s)")
        if not ok:
            return False
    return True


if __name__ == "__main__":
    tp.run_main(main)
