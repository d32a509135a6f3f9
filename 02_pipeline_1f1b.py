"""02 - Pipeline parallelism: GPipe and 1F1B (Narayanan et al. 2021, Section 2.2).

What this file adds on top of 01: the GPT-2 cut into pp stages of contiguous layers, one per rank, and the
batch into m microbatches that flow through them. GPipe (Huang et al. 2019) runs all forwards, then all
backwards, and keeps all m microbatches' activations; 1F1B (PipeDream-Flush: Narayanan et al. 2021b) starts
backwards as soon as it can and keeps at most pp - stage. Both idle (pp - 1) / m.
  - The lesson, read first: Stage, gpipe_step and one_f_one_b_step, the loops one writes on a whiteboard,
    every dist.send and dist.recv inline.
  - The machine, read second, which 03 and 05-09 build on: a schedule is a pure function (pp, m, stage) ->
    that stage's actions ("F3": forward of microbatch 3, "B3" its backward); Schedule.plan() derives each
    rank's messages; Executor runs a plan. After it: plumbing/transport.py (Wire, Exchange, BackgroundSends).

Run it:
    python 02_pipeline_1f1b.py                                  # pp=4 CPU ranks, m=8, both schedules
    python 02_pipeline_1f1b.py --pp 2 --microbatches 3 --schedule 1f1b --trace pipe.json
    torchrun --nproc-per-node 4 02_pipeline_1f1b.py             # one stage per GPU

The demo runs the lesson, then the machine, against the serial model in float64 (exit 1 past 1e-10; the
machine against the lesson, 1e-12); docs/GUIDE.md explains each line. n_layer must be divisible by pp.
"""
import importlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from plumbing import cli, demos
from plumbing.demos import differences  # noqa: F401 (03's and 06's demos call it as 02's)
from plumbing.checks import check_world, split_batch  # noqa: F401 (02's, re-exported)
from plumbing.launch import printer, run_main
from plumbing.meter import ActivationMeter, StepRecord, StepResult  # noqa: F401 (the step's figures, re-exported)
from plumbing.reference import pipeline_reference
from plumbing.simulate import Simulation, peak_in_flight, simulate  # noqa: F401 (02's, re-exported)
from plumbing.transport import BackgroundSends, Exchange, Wire  # noqa: F401 (how a boundary travels: 02's, re-exported)
from plumbing.validate import ScheduleError, check_lists, check_plans, validate  # noqa: F401 (02's, re-exported)

tensor_parallel = importlib.import_module("01_tensor_parallel")


# ----------------------------------------------------------------------------------------------
# The lesson: rank s is stage s of pp (the world, or 05's pp_group), holding every microbatch; every message is here.


def split_layers(n_layer, n_stages):
    """Contiguous, equal layer ranges; an uneven split is refused rather than silently unbalanced."""
    if n_layer % n_stages:  # more stages than layers included
        raise ValueError(f"n_layer={n_layer} is not divisible by {n_stages} pipeline stages (uneven ones are refused)")
    per = n_layer // n_stages
    return [range(k * per, (k + 1) * per) for k in range(n_stages)]


class Stage(tensor_parallel.ParallelGPT):
    """01's GPT built whole, then cut to a stage: its blocks `layers`; `first` keeps the embeddings, `last` ln_f,
    the output layer and the loss, with a copy of wte (they are tied). Without `first` it takes (b, T, C), without
    `last` returns it. (01's machine GPT, which 02's machine and the trainers run, builds only its part.)"""

    def __init__(self, cfg, layers, first, last, **gpt_kwargs):  # gpt_kwargs: 01's (group: tp)
        super().__init__(cfg, **gpt_kwargs)
        tr, self.pre_process, self.post_process = self.transformer, first, last
        tr["h"] = nn.ModuleDict({str(i): tr.h[str(i)] for i in layers})
        if not first:
            del tr["wpe"]
        if not last:
            del tr["ln_f"], self.lm_head
        if not (first or last):
            del tr["wte"]

    def forward(self, x, targets=None):  # ids (b, T) on the first stage, else (b, T, C)
        x = self.embed(x) if self.pre_process else x
        for block in self.transformer.h.values():
            x = block(x)
        return self.head(x, targets) if self.post_process else x


def stage_model(cfg, pp_group=None, **gpt_kwargs):
    """This rank's stage s of pp: split_layers' range s, the embeddings on the first, the loss on the last."""
    s, pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    return Stage(cfg, split_layers(cfg.n_layer, pp)[s], s == 0, s == pp - 1, **gpt_kwargs)


def loss_weights(microbatches, ignore_index=-100):
    """Microbatch i's mean loss weighs valid_i / sum(valid): the step's loss is the batch's mean over its
    counted targets (docs/LOSS.md), not the means' mean (1/m). One counting none weighs 0: no 0/0."""
    valid = [int((t != ignore_index).sum()) for _, t in microbatches]
    return [v / sum(valid) if v else 0.0 for v in valid]


def recv_from(src, like, pp_group=None):
    """dist.recv of a tensor shaped like `like` from stage src; None where there is none (before the
    first stage, which reads tokens; after the last, whose backward starts from its loss)."""
    if not 0 <= src < dist.get_world_size(pp_group):
        return None
    buf = torch.empty_like(like)
    dist.recv(buf, dist.get_global_rank(pp_group or dist.group.WORLD, src), pp_group)  # blocks until it arrived
    return buf


def send_to(t, dst, pp_group=None):
    """dist.send of t to stage dst, if there is one (the last stage's output is the loss: kept)."""
    if 0 <= dst < dist.get_world_size(pp_group):
        dist.send(t.detach(), dist.get_global_rank(pp_group or dist.group.WORLD, dst), pp_group)


def send_recv(t, peer, like, pp_group=None):
    """Send t to stage peer and receive a tensor shaped like `like` from it, as one batch: 1F1B's
    send_forward_recv_backward (to the next stage) and send_backward_recv_forward (to the previous).
    Two neighbours that each sent first, waiting for the other to receive, would wait forever."""
    if not 0 <= peer < dist.get_world_size(pp_group):
        return None
    buf, peer = torch.empty_like(like), dist.get_global_rank(pp_group or dist.group.WORLD, peer)  # a global rank
    ops = [dist.P2POp(dist.isend, t.detach(), peer, pp_group), dist.P2POp(dist.irecv, buf, peer, pp_group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return buf


def forward_step(stage, mb, x, weight, losses):
    """Microbatch mb = (idx, targets) through this stage from x, the previous stage's output (b, T, C), or
    idx on the first (x None). Returns (input, output (b, T, C)); on the last stage output = weight x its
    mean loss, also appended to losses."""
    x = mb[0] if x is None else x.requires_grad_()  # backward wants the gradient of a received input
    if not stage.post_process:
        return x, stage(x)
    loss = stage(x, mb[1])[1] * weight
    losses.append(loss.detach())
    return x, loss


def backward_step(x, y, dy):
    """Backward of one microbatch through this stage, from dy, its output's gradient (None on the last
    stage, whose output is the loss). Returns its input's gradient (None on the first: token ids)."""
    torch.autograd.backward(y, dy)
    return x.grad


def sum_tied_grads(stage, pp_group=None):
    """The output layer is tied to wte; with pp > 1 the first and the last stage hold a copy each, and
    swap and add their gradients (Megatron: an all-reduce over the two, the same sum)."""
    s, pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    if pp > 1 and s in (0, pp - 1):
        g = stage.transformer.wte.weight.grad
        g += send_recv(g, pp - 1 - s, g, pp_group)


def gpipe_step(stage, microbatches, pp_group=None, weights=None):
    """GPipe (Huang et al. 2019) on this rank's stage: every microbatch forward (receive, forward, send),
    then each backward in the same order; all m in flight. Returns the loss on the last stage, else None.
    weights: each microbatch mean's (05: its share of the global batch; by default loss_weights')."""
    s, w, losses, flight, g = dist.get_rank(pp_group), weights or loss_weights(microbatches), [], [], pp_group
    out = next(stage.parameters()).new_empty(*microbatches[0][0].shape, stage.cfg.n_embd)  # (b, T, C) travels
    for i, mb in enumerate(microbatches):
        flight.append(forward_step(stage, mb, recv_from(s - 1, out, g), w[i], losses))
        send_to(flight[-1][1], s + 1, g)
    while flight:
        x, y = flight.pop(0)
        send_to(backward_step(x, y, recv_from(s + 1, out, g)), s - 1, g)
    sum_tied_grads(stage, g)
    return sum(losses) if stage.post_process else None


def one_f_one_b_step(stage, microbatches, pp_group=None, weights=None):
    """1F1B (PipeDream-Flush) on this rank's stage: warm up with forwards, then alternate a new forward
    and the oldest backward, then drain the backwards left: at most pp - s in flight (GPipe: m)."""
    s, pp, m, g = dist.get_rank(pp_group), dist.get_world_size(pp_group), len(microbatches), pp_group
    w, losses, flight = weights or loss_weights(microbatches), [], []
    out = next(stage.parameters()).new_empty(*microbatches[0][0].shape, stage.cfg.n_embd)  # (b, T, C) travels
    # Stage s runs pp - s - 1 forwards before the steady state: how long microbatch 0 takes to reach
    # the last stage and come back. The steady state's first forward makes pp - s in flight.
    warmup = min(pp - s - 1, m)
    for i in range(warmup):
        flight.append(forward_step(stage, microbatches[i], recv_from(s - 1, out, g), w[i], losses))
        send_to(flight[-1][1], s + 1, g)
    x = recv_from(s - 1, out, g) if warmup < m else None
    for i in range(warmup, m):  # steady: forward microbatch i, then backward the oldest in flight
        flight.append(forward_step(stage, microbatches[i], x, w[i], losses))
        dy = send_recv(flight[-1][1], s + 1, out, g)  # send forward, receive backward
        dx = backward_step(*flight.pop(0), dy)
        if i + 1 < m:  # send backward, receive forward: the next microbatch's input
            x = send_recv(dx, s - 1, out, g)
        else:
            send_to(dx, s - 1, g)
    while flight:  # drain: the backwards left, oldest first
        x, y = flight.pop(0)
        send_to(backward_step(x, y, recv_from(s + 1, out, g)), s - 1, g)
    sum_tied_grads(stage, g)
    return sum(losses) if stage.post_process else None


# ----------------------------------------------------------------------------------------------
# Demo: the lesson against the serial model, then the machine below against the lesson (float64, one batch).


STEP_NAMES = {"gpipe": "gpipe_step", "1f1b": "one_f_one_b_step"}  # the demo's --schedule names, as functions


def demo(env, cfg, args):
    pp, m, say = args.pp, args.microbatches, printer(env)
    check_world(pp, env.world_size)  # every check runs before the first collective
    split_layers(cfg.n_layer, pp)
    microbatches, full, ref_loss, ref_grads = pipeline_reference(cfg, args, m, env.device, unequal=True)
    say(f"{cfg}\npp={pp} m={m} global batch B={args.batch_size} T={args.seq_len} float64, "
        f"world={env.world_size} ({dist.get_backend()})")
    say(f"targets counted per microbatch: {[int((t != -100).sum()) for _, t in microbatches]}")
    ok, lessons, names = True, {}, ["gpipe", "1f1b"] if args.schedule == "both" else [args.schedule]
    for name in names:
        stage = stage_model(cfg, dtype=torch.float64, device=env.device)
        stage.load_full_state_dict(full)  # the serial model's weights
        loss = {"gpipe": gpipe_step, "1f1b": one_f_one_b_step}[name](stage, microbatches)
        lessons[name] = loss, {n: p.grad for n, p in stage.named_parameters()}
        worst = demos.worst_difference(lessons[name], ref_loss, ref_grads)
        say(f"the lesson, {STEP_NAMES[name]}: max relative difference against serial (loss and every gradient): "
            f"{worst:.2e} {'PASS' if worst <= 1e-10 else 'FAIL'} (tolerance 1e-10)")
        ok &= worst <= 1e-10
    return prove_machine(env, cfg, args, names, (microbatches, full, ref_loss, ref_grads), lessons, say) and ok


# ----------------------------------------------------------------------------------------------
# Read second: the machine, the lesson's general form, which 03 and 05-09 build on. Schedules as data.


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward or "B" backward (KINDS)
    mb: int  # microbatch
    chunk: int = 0  # which of this rank's model chunks (03's virtual stages); always 0 here
    steady: bool = field(default=False, compare=False)  # 03: runs paired with the next action

    def __str__(self):
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def gpipe(pp, m, stage):
    """All m forwards, then all m backwards."""
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(pp, m, stage):
    """PipeDream-Flush: warm up, then alternate one forward and one backward, then drain."""
    warmup = min(pp - stage - 1, m)  # the lesson's warm-up (one_f_one_b_step)
    acts = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: the forward of a new microbatch, the oldest backward
        acts += [Action("F", warmup + i), Action("B", i)]
    return acts + [Action("B", i) for i in range(m - warmup, m)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


# ----------------------------------------------------------------------------------------------
# Read second: messages. Chunk c of rank r is virtual stage placement(pp, c, r) of S = pp*v. The
# forward of stage k sends its output to stage k+1 as message ("act", k+1, mb); the backward of stage
# k sends the gradient of its input to stage k-1 as ("grad", k-1, mb). One rank's stages hand over locally.


@dataclass(frozen=True)
class Kind:
    """What an action of one kind waits for and sends; plan, simulate and validate read it."""
    flow: str | None  # "act": input from stage k-1, output to k+1; "grad": the reverse; None: no messages
    after: str = ""  # the kind that must have run before it on the same stage and microbatch
    waits: object = None  # (action, rank, schedule) -> [(rank, action)] of other ranks it waits for


KINDS = {"F": Kind("act"), "B": Kind("grad", "F")}


def looped(pp, chunk, rank):
    """02's and 03's placement: chunk c of rank r is virtual stage c*pp + r."""
    return chunk * pp + rank


@dataclass
class Schedule:
    """Every rank's list of actions, with where each rank's chunks sit (placement) and the kinds of action."""
    lists: list  # lists[r]: rank r's actions
    placement: object = looped  # (pp, chunk, rank) -> virtual stage
    kinds: dict = field(default_factory=lambda: KINDS)

    def __post_init__(self):
        self.pp, self.v = len(self.lists), 1 + max((a.chunk for acts in self.lists for a in acts), default=0)
        self.S = self.pp * self.v  # virtual stages; where[k] = (rank, chunk) of stage k
        self.where = {self.placement(self.pp, c, r): (r, c) for r in range(self.pp) for c in range(self.v)}

    def stage(self, rank, chunk):
        return self.placement(self.pp, chunk, rank)

    def needs(self, a, k):
        """(the message action a on stage k waits for, the stage that sends it), or None."""
        flow, src = self.kinds[a.kind].flow, {"act": k - 1, "grad": k + 1}
        return ((flow, k, a.mb), src[flow]) if flow and 0 <= src[flow] < self.S else None

    def produces(self, a, k):
        """(the message action a on stage k sends, the stage it goes to), or None."""
        flow, dst = self.kinds[a.kind].flow, {"act": k + 1, "grad": k - 1}
        return ((flow, dst[flow], a.mb), dst[flow]) if flow and 0 <= dst[flow] < self.S else None

    def groups(self, rank):
        """The actions of rank's list that run back to back, with no boundary between: one each here."""
        return [[a] for a in self.lists[rank]]

    def plan(self, rank):
        """This rank's steps: ("run", action, stage), and between groups a boundary, ("post", ops) then
        ("wait", ops), ops = [("send" | "recv", peer, message)]: the last group's sends and the next's
        receives in one batch, so two ranks exchanging both progress (send_forward_recv_backward)."""
        groups, steps, sends = self.groups(rank), [], []
        receives = self.receives(rank, groups)
        for g, group in enumerate(groups):
            ops = sends + receives.get(g, [])
            steps += [("post", ops), ("wait", ops)] if ops else []
            steps += [("run", a, self.stage(rank, a.chunk)) for a in group]
            sends = self.remote(rank, group, self.produces, "send")
        return steps + ([("post", sends), ("wait", sends)] if sends else [])

    def receives(self, rank, groups):
        """{group: the receives posted at the boundary before it}: here its own inputs, in the order it
        needs them, which for 02's and 03's lists is the order they are sent in (messages match in order)."""
        return {g: self.remote(rank, group, self.needs, "recv") for g, group in enumerate(groups)}

    def remote(self, rank, group, messages, side):
        """[(side, peer rank, message)]: the group's messages (needs or produces) from or to another rank."""
        got = filter(None, (messages(a, self.stage(rank, a.chunk)) for a in group))
        return [(side, self.where[k][0], msg) for msg, k in got if self.where[k][0] != rank]  # else handed over

    def executor(self, chunks, pp_group, wire, exchange=None, deallocate=True):
        """What runs this schedule's actions on a rank (a later file's schedule returns its own)."""
        return Executor(self, chunks, pp_group, wire, exchange, deallocate)


# ----------------------------------------------------------------------------------------------
# Read second: the executor. It runs exactly one rank's plan. Receive -> compute -> send, for each action.


class Executor:
    """One rank's part of one step. chunks[c] is virtual stage schedule.stage(rank, c); wire and exchange:
    how a boundary tensor travels and is posted (Wire, Exchange); deallocate: free each output once sent."""

    def __init__(self, schedule, chunks, pp_group, wire, exchange=None, deallocate=True):
        self.schedule, self.chunks, self.group, self.wire = schedule, chunks, pp_group, wire
        self.exchange, self.deallocate = exchange or Exchange(), deallocate
        self.plan, self.last = schedule.plan(dist.get_rank(pp_group)), schedule.S - 1
        self.record = StepRecord(self)  # the step's timeline, messages and memory, from outside

    def run(self, microbatches, valid=None, norm=None, ignore_index=-100):
        """Run the plan on microbatches [(idx, targets)], valid[i] counted targets each (from the host). Microbatch
        i's summed loss counts norm[i] = (num, den): num / den; 1 / sum(valid) by default (docs/LOSS.md)."""
        self.micro, self.valid = microbatches, valid or [int((t != ignore_index).sum()) for _, t in microbatches]
        self.norm = norm or [(1, sum(self.valid))] * len(microbatches)
        self.box, self.inputs, self.outputs, self.sending, self.loss = {}, {}, {}, {}, None  # box: messages
        for kind, *step in self.plan:
            {"run": self.act, "post": self.post, "wait": self.wait}[kind](*step)
        for msg in self.exchange.flush():  # nothing is left in flight when the caller goes on
            self.sent(msg)
        return self.record.result(self.loss)

    def act(self, a, k):  # an action of kind K runs as run_K: here F and B
        getattr(self, "run_" + a.kind)(a, k)

    def run_F(self, a, k):  # receive -> forward -> send
        x = self.input(a.mb) if k == 0 else self.box.pop(("act", k, a.mb)).requires_grad_()
        y = self.chunks[a.chunk](x, self.micro[a.mb][1] if k == self.last else None)
        if k == self.last:
            y = self.output(a.mb, y)
        else:  # for the next stage: sent from the box at the next boundary, or handed over here
            self.box[("act", k + 1, a.mb)] = y.detach()
        self.inputs[(a.chunk, a.mb)], self.outputs[(a.chunk, a.mb)] = x, y

    def run_B(self, a, k):  # receive the output's gradient -> backward -> send the input's gradient
        x, y = self.inputs.pop((a.chunk, a.mb)), self.outputs.pop((a.chunk, a.mb))
        torch.autograd.backward(y, self.box.pop(("grad", k, a.mb)) if k < self.last else self.output_grad(a.mb))
        if k > 0:
            self.box[("grad", k - 1, a.mb)] = x.grad

    def input(self, mb):  # the first stage's input: the token ids
        return self.micro[mb][0]

    def output(self, mb, y):  # the last stage's (logits, loss): the mean times valid num / den (none: 0)
        loss = y[1] * (self.valid[mb] * self.norm[mb][0] / self.norm[mb][1] if self.valid[mb] else 0.0)
        self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
        return loss

    def output_grad(self, mb):  # the last stage's output is the loss: its backward starts from 1
        return None

    def post(self, ops):
        p2p, peer, like = [], lambda r: dist.get_global_rank(self.group, r), next(self.chunks[0].parameters())
        for side, r, msg in ops:
            if side == "send":
                self.sending[msg] = self.box.pop(msg)  # kept until its send completed (sent)
                t = self.wire.pack(self.sending[msg])
            else:  # poisoned, so a receive that never happened shows up as NaN
                t = self.box[msg] = torch.full(self.wire.shape, float("nan"), dtype=like.dtype, device=like.device)
            p2p.append(dist.P2POp(dist.isend if side == "send" else dist.irecv, t, peer(r), self.group))
        self.p2p, self.works = p2p, self.exchange.post(p2p)  # Exchange: dist.batch_isend_irecv(p2p)

    def wait(self, ops):
        for msg in self.exchange.wait(self.works, self.p2p, [msg for side, _, msg in ops if side == "send"]):
            self.sent(msg)
        self.box.update({msg: self.wire.unpack(self.box[msg]) for side, _, msg in ops if side == "recv"})

    def sent(self, msg):  # its send completed: the tensor may change or be freed now
        t = self.sending.pop(msg)
        if self.deallocate and msg[0] == "act":  # a stage output: backward needs its graph, not its values
            t.untyped_storage().resize_(0)


def execute(schedule, chunks, pp_group, microbatches, wire, valid=None, exchange=None, deallocate=True):
    """Run this rank's part of `schedule` (see Executor) on microbatches; returns a StepResult."""
    return schedule.executor(chunks, pp_group, wire, exchange, deallocate).run(microbatches, valid)


# ----------------------------------------------------------------------------------------------
# Read second: the machine's stages (v chunks a rank, 03's), one step on one rank, the demo's machine part.


def build_chunks(cfg, pp, rank, v=1, group=None, placement=looped, **gpt_kwargs):
    """This rank's chunks, c being stage placement(pp, c, rank) of pp*v, on one random stream (03's: unlike masks)."""
    ranges, S, chunks = split_layers(cfg.n_layer, pp * v), pp * v, []
    for c in range(v):
        k = placement(pp, c, rank)
        chunks.append(tensor_parallel.GPT(cfg, group, layers=ranges[k], pre_process=k == 0, post_process=k == S - 1,
                                          rng=chunks[0].rng if chunks else None, **gpt_kwargs))
    return chunks


def sync_tied_embeddings(chunks, embed_group, grad_of=lambda p: p.grad):
    """The output layer is tied to the token embedding: the first and last stage each hold a copy, and
    summing their gradients (grad_of(p), in place) over the embedding group keeps them equal (Megatron's)."""
    grads = [grad_of(c.transformer.wte.weight) for c in chunks if "wte" in c.transformer]
    for g in grads[1:]:  # the first and the last chunk on this rank (pp=1 with v>1): added here
        grads[0].add_(g)
    if embed_group is not None and grads:
        dist.all_reduce(grads[0], group=embed_group)
    for g in grads[1:]:
        g.copy_(grads[0])


def pipeline_step(cfg, schedule, pp_group, embed_group, full, microbatches, deallocate=True):
    """One step of the whole batch on this rank: chunks from the full weights, list run, tied gradients summed."""
    rank, dtype = dist.get_rank(pp_group), full["transformer.wte.weight"].dtype
    chunks = build_chunks(cfg, schedule.pp, rank, schedule.v, init=False, dtype=dtype, device=microbatches[0][0].device)
    for c in chunks:
        c.load_full_state_dict(full)
    wire = Wire((*microbatches[0][0].shape, cfg.n_embd))  # a stage's output: (b, T, C)
    result = execute(schedule, chunks, pp_group, microbatches, wire, deallocate=deallocate)
    sync_tied_embeddings(chunks, embed_group)
    return chunks, result


def prove_machine(env, cfg, args, names, reference, lessons, say):
    """Each schedule as lists, validated, executed, reported; its loss and gradients against the lesson's."""
    (microbatches, full, ref_loss, ref_grads), pp, m = reference, args.pp, args.microbatches
    embed_group = dist.new_group([0, pp - 1], timeout=timedelta(seconds=60)) if pp > 1 else None
    ok, measured = True, {}
    for name in names:
        schedule = Schedule([SCHEDULES[name](pp, m, s) for s in range(pp)])
        validate(schedule, m)
        dist.barrier()  # the ranks start together, so their measured timelines line up
        chunks, result = pipeline_step(cfg, schedule, dist.group.WORLD, embed_group, full, microbatches)
        kept = pipeline_step(cfg, schedule, dist.group.WORLD, embed_group, full, microbatches, deallocate=False)[1]
        worst = demos.differences(chunks, result, ref_loss, ref_grads)
        good, _, measured[name] = demos.report_pipeline(env, name, schedule.lists, simulate(schedule), worst,
                                                        result, kept, say)
        got = result.loss, {n: p.grad for n, p in chunks[0].named_parameters()}
        same = demos.worst_difference(got, *lessons[name])
        say(f"the machine (execute) against the lesson's {STEP_NAMES[name]} (loss and every gradient): {same:.2e} "
            f"{'PASS' if same <= 1e-12 else 'FAIL'} (tolerance 1e-12)")
        ok &= good and same <= 1e-12
    demos.write_trace(env, args.trace, measured, say)
    return ok


# ----------------------------------------------------------------------------------------------
# After the concept: the demo's command line.


@dataclass
class PipelineDemoConfig:  # the flags 02's demo and 03's share
    microbatches: int = 8  # m, microbatches the batch is cut into
    batch_size: int | None = None  # global batch B, in sequences (unset: 2 m)
    seq_len: int = 32  # T, tokens per sequence
    seed: int = 1234  # for the weights and the batch
    trace: str = ""  # write the measured steps as one Chrome trace to this file


@dataclass
class DemoConfig(PipelineDemoConfig):
    pp: int = 4  # pipeline stages: CPU ranks started here, or torchrun's world
    schedule: Literal["gpipe", "1f1b", "both"] = "both"  # which schedules to run and compare


def parser():
    return cli.demo_parser(__doc__, DemoConfig, tensor_parallel.GPTConfig, vocab_size=1001, block_size=64, n_layer=4,
                           n_head=4, n_embd=64)


def main(parser=parser, demo=demo):
    """Parse, launch `demo` on pp ranks, exit 0 if every rank passed (03 passes its own pair)."""
    cfg, args = cli.demo_args(parser(), batch_size=lambda a: 2 * max(a.microbatches, 1) if a.batch_size is None
                              else a.batch_size)
    return all(tensor_parallel.launch(demo, args.pp, cfg, args))


if __name__ == "__main__":
    run_main(main)
