"""03 - The interleaved 1F1B schedule with virtual stages (Narayanan et al. 2021, Section 2.2.2).

What this file adds on top of 02: of pp*v virtual stages, rank r holds v chunks, stages r, r + pp, ... (8 layers,
pp=2, v=2: rank 0 holds layers 1-2 and 5-6). A microbatch crosses every rank v times: the bubble shrinks from
(pp-1)/m to (pp-1)/(v m), for (pp v - 1)/(pp - 1) times the p2p messages (7/3 at pp=4, v=2). The lesson, read first:
interleaved_step, the whiteboard loop, every message inline. The machine, read second, which 05-09 build on: the
same order as 02's Actions (interleaved), run by 02's executor (InterleavedSchedule). v=1 is 1F1B; m must be a
multiple of pp, n_layer of pp*v.

Run it:
    python 03_interleaved.py                         # pp=4 CPU ranks, v=2, m=8
    python 03_interleaved.py --pp 2 --virtual-stages 3 --microbatches 4 --n-layer 6
    torchrun --nproc-per-node 4 03_interleaved.py    # one rank per GPU

The demo runs the lesson, then 1F1B and interleaved 1F1B on the machine, each against serial in float64
(1e-10; the machine against the lesson, 1e-12), on microbatches counting unequal numbers of targets, and
prints their timelines, bubbles, p2p messages and peak activation bytes; it exits 1 on a mismatch.
"""
import importlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plumbing import demos
from plumbing.interleaved_demo import DemoConfig, check_interleaving, parser, prove_machine  # flags, check, demo
from plumbing.launch import printer, run_main
from plumbing.reference import pipeline_reference

tensor_parallel = importlib.import_module("01_tensor_parallel")
pipeline = importlib.import_module("02_pipeline_1f1b")


# ----------------------------------------------------------------------------------------------
# Read first: the lesson, interleaved 1F1B as one writes it on a whiteboard, and the demo that runs it against serial.


def chunk_layers(n_layer, pp, v, rank):
    """The layer ranges of rank's chunks: chunk c is virtual stage c*pp + rank of 02's pp*v stages."""
    return pipeline.split_layers(n_layer, pp * v)[rank::pp]


def chunk_models(cfg, v, **gpt_kwargs):
    """This rank's v chunks, 02's Stages of their layers: stage 0 with the embeddings, S - 1 with the loss."""
    r, pp = dist.get_rank(), dist.get_world_size()
    return [pipeline.Stage(cfg, layers, c * pp + r == 0, c * pp + r == pp * v - 1, **gpt_kwargs)
            for c, layers in enumerate(chunk_layers(cfg.n_layer, pp, v, r))]


def chunk_and_microbatch(k, pp, v, forward=True):
    """(chunk, microbatch) of a rank's k-th forward (or backward): groups of pp microbatches go through
    chunk 0, then chunk 1, ..., chunk v - 1 (backwards: v - 1 first), then the next group of pp."""
    chunk, mb = (k % (pp * v)) // pp, (k // (pp * v)) * pp + k % pp
    return (chunk if forward else v - 1 - chunk), mb


def exchange(sends, receives, box, like):
    """A boundary: sends {(kind, k, i): tensor}, each to stage k's rank k mod pp, and receives {message: rank} into
    box, as one batch_isend_irecv, all waited for: two neighbours that each sent first would wait for each other."""
    box.update({msg: torch.empty_like(like) for msg in receives})  # filled by the time the batch is waited for
    ops = [dist.P2POp(dist.isend, t, msg[1] % dist.get_world_size()) for msg, t in sends.items()]
    ops += [dist.P2POp(dist.irecv, box[msg], peer) for msg, peer in receives.items()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def interleaved_step(chunks, microbatches):
    """Interleaved 1F1B on this rank's v chunks: warm-up forwards, steady forward-backward steps, the drain; the
    loss on the last rank, else None. A message's key (kind, k, i) names its receiver: F's (B's) input on stage k."""
    r, pp, v, m = dist.get_rank(), dist.get_world_size(), len(chunks), len(microbatches)
    if v == 1:
        return pipeline.one_f_one_b_step(chunks[0], microbatches)
    if m % pp:  # refused before any message, as check_interleaving refuses it
        raise ValueError(f"interleaving runs microbatches in groups of pp: m={m} must be divisible by pp={pp}")
    S, n, w, losses = pp * v, m * v, pipeline.loss_weights(microbatches), []
    like = next(chunks[0].parameters()).new_empty(*microbatches[0][0].shape, chunks[0].cfg.n_embd)  # (b, T, C)
    # (v - 1) pp forwards take microbatch 0 to this rank's last chunk, 2 (pp - r - 1) more its round trip to the last
    # rank and back. Fewer: a steady B (no boundary after its F) waits for r + 1, which waits for that F's output.
    warmup = min(2 * (pp - r - 1) + (v - 1) * pp, n)
    fwd, bwd = ([(kind, *chunk_and_microbatch(k, pp, v, kind == "F")) for k in range(n)] for kind in "FB")
    steps = [[f] for f in fwd[:warmup]] + [[f, b] for f, b in zip(fwd[warmup:], bwd)] + [[b] for b in bwd[n - warmup:]]
    box, flight, sends, src = {}, {}, {}, {"F": -1, "B": 1}  # F's input comes from the stage before, B's from after
    for step in steps + [[]]:  # exchange: last step's sends, this step's receives; the empty [] sends the final B's
        exchange(sends, {(kind, c * pp + r, i): (r + src[kind]) % pp for kind, c, i in step
                         if pp > 1 and 0 <= c * pp + r + src[kind] < S}, box, like)
        sends = {}
        for kind, c, i in step:
            k, x = c * pp + r, box.pop((kind, c * pp + r, i), None)  # F's input, B's output gradient (None at the ends)
            if kind == "F":
                flight[c, i] = pipeline.forward_step(chunks[c], microbatches[i], x, w[i], losses)
                out, dst = flight[c, i][1].detach(), k + 1
            else:
                out, dst = pipeline.backward_step(*flight.pop((c, i)), x), k - 1
            if 0 <= dst < S:
                (sends if pp > 1 else box)[(kind, dst, i)] = out  # pp = 1: handed over on this rank
    if pp > 1:  # the tied embedding's copies: on stage 0 (rank 0's chunk 0) and S - 1 (rank pp - 1's chunk v - 1)
        pipeline.sum_tied_grads(chunks[0] if r == 0 else chunks[-1])
    else:  # both on this rank: added
        first, last = (c.transformer.wte.weight.grad for c in (chunks[0], chunks[-1]))
        last.copy_(first.add_(last))
    return sum(losses) if r == pp - 1 else None


def demo(env, cfg, args):
    pp, m, v, say = args.pp, args.microbatches, args.virtual_stages, printer(env)
    pipeline.check_world(pp, env.world_size)  # every check runs before the first collective
    chunks = chunk_models(cfg, v, dtype=torch.float64, device=env.device)  # refuses n_layer % (pp v)
    microbatches, full, ref_loss, ref_grads = pipeline_reference(cfg, args, m, env.device, unequal=True)
    say(f"{cfg}\npp={pp} v={v} m={m} global batch B={args.batch_size} T={args.seq_len} float64, world={env.world_size} "
        f"({dist.get_backend()})\ntargets counted per microbatch: {[int((t != -100).sum()) for _, t in microbatches]}")
    for chunk in chunks:
        chunk.load_full_state_dict(full)  # the serial model's weights
    lesson = interleaved_step(chunks, microbatches), {n: p.grad for c in chunks for n, p in c.named_parameters()}
    worst = demos.worst_difference(lesson, ref_loss, ref_grads)
    say(f"the lesson, interleaved_step: max relative difference against serial (loss and every gradient): "
        f"{worst:.2e} {'PASS' if worst <= 1e-10 else 'FAIL'} (tolerance 1e-10)")
    return prove_machine(env, cfg, args, (microbatches, full, ref_loss, ref_grads), lesson, say) and worst <= 1e-10


# ----------------------------------------------------------------------------------------------
# Read second: the machine, which 05-09 build on: the lesson's order as data, a list of 02's Actions per rank.


def interleaved(pp, m, stage, v):
    """Interleaved 1F1B on rank `stage`: m*v forwards and m*v backwards over its v chunks, the lesson's order."""
    check_interleaving(pp, m, v)
    if v == 1:
        return pipeline.one_f_one_b(pp, m, stage)

    def at(k, forward, steady=False):  # the lesson's k-th forward or backward as an Action
        chunk, mb = chunk_and_microbatch(k, pp, v, forward)
        return pipeline.Action("F" if forward else "B", mb, chunk, steady)

    total = m * v
    # The lesson's warm-up (interleaved_step). A steady pair runs F and B with no boundary between, so with
    # fewer warm-up forwards rank r's B would wait for rank r+1, which waits for the F output rank r sends
    # only after that B (validate() finds it: v = 2, m = 2 pp).
    warmup = min((pp - stage - 1) * 2 + (v - 1) * pp, total)
    acts = [at(k, True) for k in range(warmup)]
    for i in range(total - warmup):
        acts += [at(warmup + i, True, steady=True), at(i, False, steady=True)]
    return acts + [at(k, False) for k in range(total - warmup, total)]


@dataclass
class InterleavedSchedule(pipeline.Schedule):
    """02's Schedule, whose steady forward and the backward after it run as one group, with no boundary
    between them (the lesson's steady step): at v > 1 a boundary there could make two ranks wait on each other."""

    def groups(self, rank):
        groups, acts, i = [], self.lists[rank], 0
        while i < len(acts):  # a steady F pairs with the steady B after it; any other action runs alone
            pair = acts[i].steady and acts[i].kind == "F" and i + 1 < len(acts) and acts[i + 1].steady
            groups.append(acts[i:i + 1 + pair])
            i += 1 + pair
        return groups


if __name__ == "__main__":
    run_main(lambda: pipeline.main(parser, demo))
