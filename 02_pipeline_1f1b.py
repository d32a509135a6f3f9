"""02 - Pipeline parallelism: GPipe and 1F1B as pure data (Narayanan et al. 2021, Section 2.2).

What this file adds on top of 01: the GPT-2 is cut into pp stages of contiguous layers (the first
holds the embeddings, the last ln_f, the tied output layer and the loss). A schedule is a pure
function (pp, m, stage) -> that stage's ordered list of actions, "F3" = forward of microbatch 3,
"B3" = its backward. Everything else only reads those lists:
  - rank_plan() derives the point-to-point messages around each action, batched per boundary;
  - validate() proves every microbatch runs once each way, backward after forward, and that the
    messages can be matched without deadlock even if every send waits for its receive;
  - simulate() replays the lists with per-action times: step time, idle time, bubble, peak
    microbatches in flight (Section 2.2.1: bubble = (pp - 1) / m for GPipe and 1F1B alike);
  - execute() runs one rank's list over real batched isend/irecv; pipeline_step() is one training
    step's forward and backward on a rank: build its chunks, execute its list, sync the tied embedding.
After the concept, one optimization: BackgroundSends, which 05's trainer turns on.
GPipe (Huang et al. 2019: all forwards, then all backwards) keeps all m microbatches' activations
alive; 1F1B (PipeDream-Flush: Narayanan et al. 2021b, "Memory-Efficient Pipeline-Parallel DNN
Training") starts backwards as soon as possible and keeps at most pp - stage alive.

Run it:
    python 02_pipeline_1f1b.py                                  # pp=4 CPU ranks, m=8, both schedules
    python 02_pipeline_1f1b.py --pp 2 --microbatches 3 --schedule 1f1b --trace pipe.json
    torchrun --nproc-per-node 4 02_pipeline_1f1b.py             # one stage per GPU

The demo checks GPipe and 1F1B against the serial model in float64 (loss and every gradient within
1e-10, else exit 1), draws the simulated and measured timelines, and prints the bubble against its
formula and each stage's peak stored activation bytes, with and without Megatron's deallocation.
Layer split: n_layer must be divisible by the number of stages; uneven splits are refused.
"""
import contextlib
import importlib
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction
from typing import Literal

import torch
import torch.distributed as dist

from plumbing import cli, demos
from plumbing.launch import printer, run_main
from plumbing.meter import ActivationMeter  # what execute() counts of activation memory
from plumbing.trace import write_timelines

tensor_parallel = importlib.import_module("01_tensor_parallel")


# ----------------------------------------------------------------------------------------------
# Schedules as data


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward or "B" backward (06 splits B into "I" and "W": see KINDS)
    mb: int  # microbatch
    chunk: int = 0  # which of this rank's model chunks (03's virtual stages); always 0 here
    # 03: a steady-state forward runs with the backward after it as one pair, with no exchange in
    # between (see rank_plan). A property of the position in a list: it takes no part in equality.
    steady: bool = field(default=False, compare=False)

    def __str__(self):
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def gpipe(pp, m, stage):
    """All m forwards, then all m backwards."""
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(pp, m, stage):
    """PipeDream-Flush: warm up, then alternate one forward and one backward, then drain."""
    # Stage s must run pp - s - 1 forwards before the first backward can come back to it: that
    # is how long the first microbatch takes to reach the last stage and return.
    warmup = min(pp - stage - 1, m)
    acts = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: the forward of a new microbatch, the oldest backward
        acts += [Action("F", warmup + i), Action("B", i)]
    return acts + [Action("B", i) for i in range(m - warmup, m)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


class ScheduleError(ValueError):
    """A list of actions that cannot run: something missing, out of order, or deadlocking."""


# ----------------------------------------------------------------------------------------------
# Messages. Chunk c of rank r is virtual stage c*pp + r of S = pp*v (the "looped" placement; 06 adds
# another). The forward of stage k sends its output to stage k+1 as message ("act", k+1, mb); the
# backward of stage k sends the gradient of its input to stage k-1 as ("grad", k-1, mb). Stages on
# the same rank hand over locally.


@dataclass(frozen=True)
class Kind:
    """What an action of one kind exchanges, as rank_plan, validate and simulate read it."""
    flow: str | None  # "act": waits for its input from stage k-1, sends its output to k+1; "grad":
    # waits for its output's gradient from k+1, sends its input's to k-1; None: no messages
    after: str = ""  # the kind that must have run before it, on the same stage and microbatch
    # (kind, "last" | "every"): an action of that kind and the same microbatch that must have run on
    # the last stage's rank, or on every rank. A kind with waits runs once a microbatch on every rank
    # (chunk 0), and is a collective: every rank issues them in the same order.
    waits: tuple = ()


# The kinds of action, named here once. F and B are this file's; 06 (zero bubble) splits B in two,
# I (the input's gradient, sent on as B's is) and W (the weights' gradients: no messages), and runs
# W later. 07 (vocabulary parallelism) adds the output layer's passes, run by every rank on its slice
# of the vocabulary: S after the last stage's F (which hands its output to every rank), T after
# every rank's S (whose all-reduce brings the softmax's statistics). A later file's kind is one more entry.
KINDS = {"F": Kind("act"), "B": Kind("grad", "F"), "I": Kind("grad", "F"), "W": Kind(None, "I"),
         "S": Kind(None, waits=(("F", "last"),)), "T": Kind(None, "S", waits=(("S", "every"),))}


def looped(pp, chunk, rank):
    """The placement of 02 and 03: chunk c of rank r is virtual stage c*pp + r. A placement is
    part of a schedule; execute, rank_plan, validate and simulate take it (06's V is another)."""
    return chunk * pp + rank


def stage_map(pp, v, placement=looped):
    """{virtual stage: (rank, chunk)} for the pp*v stages."""
    return {placement(pp, c, r): (r, c) for r in range(pp) for c in range(v)}


def n_chunks(actions):
    return 1 + max(a.chunk for a in actions)


def waits_for(a, rank, pp, v, placement=looped, grad_from=None):
    """[(rank, action)] that action a on `rank` waits for beyond 02's messages: its kind's waits and,
    given grad_from (07: the kind whose all-reduce brings the last stage its output's gradient), the
    last stage's backward waits for that pass on every rank."""
    last = stage_map(pp, v, placement)[pp * v - 1]
    waits = KINDS[a.kind].waits + (((grad_from, "every"),) if grad_from and a.kind in "BI" and (rank, a.chunk) == last
                                   else ())
    return [(last[0], Action(kind, a.mb, last[1])) if where == "last" else (q, Action(kind, a.mb))
            for kind, where in waits for q in ([None] if where == "last" else range(pp))]


def needs(a, k, S=None):
    """(the message action a on virtual stage k of S waits for, the stage that sends it), or None."""
    flow = KINDS[a.kind].flow
    if flow == "act" and k > 0:
        return ("act", k, a.mb), k - 1
    if flow == "grad" and (S is None or k < S - 1):  # S None: the caller handles the last stage
        return ("grad", k, a.mb), k + 1
    return None


def produces(a, k, S):
    flow = KINDS[a.kind].flow
    if flow == "act":
        return ("act", k + 1, a.mb) if k < S - 1 else None
    if flow == "grad":
        return ("grad", k - 1, a.mb) if k > 0 else None
    return None


def run_groups(actions):
    """Actions that run back to back: a steady forward and the backward after it (03), else one."""
    groups, i = [], 0
    while i < len(actions):
        pair = actions[i].steady and actions[i].kind == "F" \
            and i + 1 < len(actions) and actions[i + 1].steady and actions[i + 1].kind == "B"
        groups.append(actions[i:i + 1 + pair])
        i += 1 + pair
    return groups


def lockstep(schedule, pp, placement=looped):
    """Every rank's list run in rounds: in each round each rank runs its next group of actions if the
    messages they wait for were sent in an earlier round. Returns ({message: (round, n)}, n counting
    the messages in the order they were sent; [the round each group ran in, per rank])."""
    v = n_chunks([a for acts in schedule for a in acts])
    S, where, groups = pp * v, stage_map(pp, v, placement), [run_groups(acts) for acts in schedule]
    sent, ran, t = {}, [[] for _ in range(pp)], 0
    while any(len(ran[r]) < len(groups[r]) for r in range(pp)):
        now, moved = {}, False
        for r in range(pp):
            group = groups[r][len(ran[r])] if len(ran[r]) < len(groups[r]) else []
            inputs = [needs(a, placement(pp, a.chunk, r), S) for a in group]
            if group and all(got is None or where[got[1]][0] == r or got[0] in sent for got in inputs):
                ran[r].append(t)
                moved = True
                for a in group:
                    out = produces(a, placement(pp, a.chunk, r), S)
                    now.update({out: (t, len(sent) + len(now))} if out else {})
        if not moved:
            raise ScheduleError("deadlock: in lockstep, no rank can run its next action")
        sent.update(now)
        t += 1
    return sent, ran


def rank_plan(actions, rank, pp, placement=looped, schedule=None):
    """This rank's steps: ("comm", ops) boundaries and ("run", action). Each boundary is one
    batch: the sends of the previous group's outputs and the receives of the next group's inputs,
    posted together so that two ranks exchanging with each other both make progress (Megatron's
    send_forward_recv_backward and friends). In 03's interleaved steady state a forward and a
    backward form one group: a boundary between them can make two ranks wait on each other, and
    validate() finds that cycle. At v = 1 each action has its own, or F would wait for B's input.
    Messages between two ranks are matched in the order they are posted, and each receive is
    posted in the boundary before the action that needs it: for 02's and 03's lists that is the
    order their senders send in. Not for 06's, where activations and gradients travel the same way
    between two ranks: given schedule (every rank's list), a receive is posted at the boundary this
    rank has reached when, with every list run in lockstep, its sender sends it (torch's pipelining
    lowers its schedules so too). Receives are then posted in the order sent, and every boundary's
    sends and receives meet their peers' at the same round: no rank can wait on another in a cycle."""
    v = n_chunks(schedule[rank] if schedule else actions)
    S, where = pp * v, stage_map(pp, v, placement)
    groups = run_groups(actions)
    wanted = []  # (group, source rank, message): every receive, in the order needed
    for g, group in enumerate(groups):
        for a in group:
            got = needs(a, placement(pp, a.chunk, rank), S)
            if got and where[got[1]][0] != rank:  # from this rank itself it is a local hand-over
                wanted.append((g, where[got[1]][0], got[0]))
    post, sent = {msg: g for g, _, msg in wanted}, {}  # the boundary each receive is posted at
    if schedule:
        sent, ran = lockstep(schedule, pp, placement)
        post = {msg: next(g for g, t in enumerate(ran[rank]) if t > sent[msg][0]) for msg in post}
    # 07's vocabulary passes exchange nothing of 02's: the boundary before the next action is posted
    # before them and waited for after them (see during), so that it stays one batch (sends cut from
    # the receives could deadlock) and the passes never wait for the pipeline's messages.
    first = list(range(len(groups)))
    for g in range(1, len(groups)):
        if all(KINDS[a.kind].waits for a in groups[g - 1]):
            first[g] = first[g - 1]
    incoming = {}  # group -> [("recv", src, message)], in the order posted
    for _, src, msg in sorted(wanted, key=lambda w: (post[w[2]], sent.get(w[2], 0))):
        incoming.setdefault(first[post[msg]], []).append(("recv", src, msg))
    steps, outgoing = [], []
    for g, group in enumerate(groups):
        if outgoing or incoming.get(g):
            steps.append(("comm", outgoing + incoming.get(g, [])))
            outgoing = []
        for a in group:
            steps.append(("run", a))
            out = produces(a, placement(pp, a.chunk, rank), S)
            if out and where[out[1]][0] != rank:
                outgoing.append(("send", where[out[1]][0], out))
    if outgoing:
        steps.append(("comm", outgoing))
    return steps


def validate(schedule, pp, m, placement=looped, lockstep=False, grad_from=None):
    """Raise ScheduleError unless the per-rank lists are complete, ordered and deadlock-free.
    lockstep: check the plans whose receives are posted in lockstep with their senders (rank_plan
    given every list), which execute(schedule=...) runs; 06's schedules need them. grad_from: 07's
    (see waits_for); its passes' collectives must be issued in the same order on every rank."""
    v = n_chunks([a for acts in schedule for a in acts])
    where = stage_map(pp, v, placement)
    passes = sorted({a.kind for acts in schedule for a in acts if KINDS[a.kind].waits})  # 07's, once a microbatch
    for r, acts in enumerate(schedule):
        kinds = "FIW" if any(a.kind in "IW" for a in acts) else "FB"  # B, or its two halves (06)
        want = Counter(Action(k, i, c) for k in kinds for i in range(m) for c in range(v))
        want += Counter(Action(k, i) for k in passes for i in range(m))
        have = Counter(acts)
        for a in want - have:
            raise ScheduleError(f"rank {r} never runs {a}")
        for a in have - want:
            raise ScheduleError(f"rank {r} runs {a} more often than once, or it does not exist")
        at = {a: i for i, a in enumerate(acts)}
        for a in acts:
            before = KINDS[a.kind].after and Action(KINDS[a.kind].after, a.mb, a.chunk)
            if before and at[a] < at[before]:
                raise ScheduleError(f"rank {r} runs {a} before {'its forward' if before.kind == 'F' else before}")
            got = needs(a, placement(pp, a.chunk, r), pp * v)
            if got and where[got[1]][0] == r:  # fed by this rank itself: it must come earlier in the list
                dep = Action(a.kind, a.mb, where[got[1]][1])
                if at[dep] > at[a]:
                    raise ScheduleError(f"deadlock: rank {r} runs {a} before {dep}, which feeds it")
        order = [a for a in acts if a.kind in passes]  # collectives: gloo and NCCL match them by order
        first = [a for a in schedule[0] if a.kind in passes]
        if order != first:
            n = next(i for i, (x, y) in enumerate(zip(order + [None], first + [None])) if x != y)
            raise ScheduleError(f"rank {r} issues its collectives in another order than rank 0: the "
                                f"{n}th is {order[n] if n < len(order) else 'none'} there, "
                                f"{first[n] if n < len(first) else 'none'} on rank 0")
    _check_channels_and_progress([rank_plan(acts, r, pp, placement, schedule if lockstep else None)
                                  for r, acts in enumerate(schedule)], pp,
                                 lambda r, a: waits_for(a, r, pp, v, placement, grad_from))


def during(plan, i):
    """The steps after plan[i], a boundary, that run while its messages travel: 07's passes."""
    j = i + 1
    while j < len(plan) and plan[j][0] == "run" and KINDS[plan[j][1].kind].waits:
        j += 1
    return plan[i + 1:j]


def _check_channels_and_progress(plans, pp, waits=lambda rank, action: []):
    """Every channel's sends and receives match, and every rank gets through its plan. waits(rank,
    action): [(rank, action)] it waits for beyond the messages (07's vocabulary passes)."""
    posts = {}  # (src, dst, "send" | "recv") -> [(message, step index at the posting rank)]
    for r, plan in enumerate(plans):
        for i, (kind, ops) in enumerate(plan):
            for side, peer, msg in ops if kind == "comm" else []:
                ch = (r, peer) if side == "send" else (peer, r)
                posts.setdefault((*ch, side), []).append((msg, i))
    # Messages between two ranks are matched in the order they are posted: the sender's order and
    # the receiver's must agree message by message, or data would land in the wrong buffer.
    needs_peer = [[[] for _ in plan] for plan in plans]  # what each step waits for: (peer, step it reached)
    for src, dst in {(s, d) for s, d, _ in posts}:
        sends, recvs = posts.get((src, dst, "send"), []), posts.get((src, dst, "recv"), [])
        for n, ((x, bs), (y, br)) in enumerate(zip(sends, recvs)):
            if x != y:
                raise ScheduleError(f"rank {src} -> rank {dst}: message {n} is {x} when sent but {y} when received")
            needs_peer[src][bs].append((dst, br))
            needs_peer[dst][br].append((src, bs))
        if len(sends) != len(recvs):
            raise ScheduleError(f"rank {src} -> rank {dst}: {len(sends)} sends but {len(recvs)} receives")
    # Each rank's events: a boundary is posted, the passes during it run, then it is waited for.
    events, at = [[] for _ in plans], {}  # at: (rank, step index) -> index of its post or run event
    for r, plan in enumerate(plans):
        quiet = set()
        for i, (kind, step) in enumerate(plan):
            if i in quiet:
                continue
            at[(r, i)] = len(events[r])
            events[r].append(("post", i) if kind == "comm" else ("run", i))
            if kind == "comm":
                for j in range(i + 1, i + 1 + len(during(plan, i))):
                    quiet.add(j)
                    at[(r, j)] = len(events[r])
                    events[r].append(("run", j))
                events[r].append(("wait", i))
    ran = {(r, step): at[(r, i)] for r, plan in enumerate(plans) for i, (kind, step) in enumerate(plan) if kind == "run"}
    blocked = [[[(q, at[(q, j)] + 1) for q, j in needs_peer[r][i]] if kind == "wait" else  # its peers posted
                [(q, ran[(q, b)] + 1) for q, b in waits(r, plans[r][i][1])] if kind == "run" else []  # 07's
                for kind, i in evs] for r, evs in enumerate(events)]
    # Progress with rendezvous semantics (a send completes only once its receive is posted, as a
    # large NCCL send does): a rank leaves a boundary once every op in it has been posted by its peer.
    # execute()'s background sends only relax this (a boundary waits for its receives and for the
    # previous boundary's sends, each a wait this model makes no later), so what passes runs either way.
    pos, moved = [0] * pp, True
    while moved:
        moved = False
        for r in range(pp):
            while pos[r] < len(events[r]) and all(pos[q] >= e for q, e in blocked[r][pos[r]]):
                pos[r] += 1
                moved = True
    stuck = [r for r in range(pp) if pos[r] < len(events[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(_waiting(r, plans[r][events[r][pos[r]][1]], waits) for r in stuck))


def _waiting(r, step, waits):
    kind, what = step
    if kind == "comm":
        return f"rank {r} waits to {' and '.join(f'{o[0]} {o[2]} with rank {o[1]}' for o in what)}"
    return f"rank {r} waits to run {what} until " + " and ".join(f"rank {q} has run {b}" for q, b in waits(r, what))


# ----------------------------------------------------------------------------------------------
# The simulator: replay the lists with per-action times, t_f and t_b one for every rank or a list of
# each rank's. Sends are buffered (a stage starts once its input has arrived); exact with ints.


@dataclass
class Simulation:
    step_time: object
    idle: list  # per rank: the step time less its busy time
    bubble: object  # total idle / total busy time: (pp - 1) / m for uniform times
    peak_in_flight: list  # per rank: most microbatches (x chunks) forwarded but not yet backwarded
    timeline: list  # per rank: [(start, end, action)]
    span_idle: list = field(default_factory=list)  # per rank: idle between its own first start and last end
    peak_memory: list = field(default_factory=list)  # per rank: peak_in_flight, with what W still holds (06)


def peak_in_flight(actions, w_share=0):
    """The most microbatches (x chunks) forwarded and not yet backwarded. w_share (06): a backward
    split in two frees all but w_share of a microbatch's activations at I, the rest at W."""
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1, "I": w_share - 1, "W": -w_share}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


def simulate(schedule, pp, t_f=1, t_b=2, t_comm=0, times=None, placement=looped, w_share=0, grad_from=None):
    """Deterministic replay: each action starts when its rank is free and its input has arrived.
    times: {kind: time} for kinds other than F and B (06's I and W, 07's S and T), each a number or
    a list per rank as t_f and t_b are; w_share: see peak_in_flight; grad_from: 07's (waits_for):
    an action waiting for actions of other ranks starts t_comm after the last of them ends."""
    v = n_chunks([a for acts in schedule for a in acts])
    S, where = pp * v, stage_map(pp, v, placement)
    per_rank = lambda t: list(t) if isinstance(t, (list, tuple)) else [t] * pp  # noqa: E731
    times = {kind: per_rank(t) for kind, t in {"F": t_f, "B": t_b, **(times or {})}.items()}
    done, ran, clock, nxt = {}, {}, [0] * pp, [0] * pp
    timeline = [[] for _ in range(pp)]
    while any(nxt[r] < len(schedule[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while nxt[r] < len(schedule[r]):
                a = schedule[r][nxt[r]]
                k, kind = placement(pp, a.chunk, r), KINDS[a.kind]
                got = needs(a, k, S)  # the message from another stage, and what runs before on this one
                deps = ([(kind.flow, got[1])] if got else []) + ([(kind.after, k)] if kind.after else [])
                others = waits_for(a, r, pp, v, placement, grad_from)  # 07's: actions of other ranks
                if any((dep, st, a.mb) not in done for dep, st in deps) or any(w not in ran for w in others):
                    break
                start = max([clock[r]] + [done[(dep, st, a.mb)] + (t_comm if where[st][0] != r else 0)
                                          for dep, st in deps] + [ran[w] + t_comm for w in others])
                end = start + times[a.kind][r]
                done[(a.kind, k, a.mb)] = done[(kind.flow, k, a.mb)] = ran[(r, a)] = clock[r] = end
                timeline[r].append((start, end, a))
                nxt[r] += 1
                moved = True
        if not moved:
            raise ScheduleError("deadlock: no rank can start its next action")
    step = max(clock)
    busy = [sum(e - s for s, e, _ in tl) for tl in timeline]
    idle = [step - b for b in busy]
    bubble = Fraction(sum(idle), sum(busy)) if all(isinstance(x, int) for x in idle + busy) else sum(idle) / sum(busy)
    span_idle = [tl[-1][1] - tl[0][0] - b if tl else 0 for tl, b in zip(timeline, busy)]
    return Simulation(step, idle, bubble, [peak_in_flight(acts) for acts in schedule], timeline, span_idle,
                      [peak_in_flight(acts, w_share) for acts in schedule])


def render(timeline, width=100, end=None):
    """ASCII timeline, one row per rank as in the paper's Figures 3 and 4: forwards are written
    F<mb> padded with spaces, backwards B<mb> padded with '=' (06's I<mb> too, and W<mb> with '-'),
    idle time '.'; odd model chunks (03) in lower case, f<mb> and b<mb>. `end` fixes the time at the
    right edge, so that two timelines can share one scale."""
    end = end or max(e for tl in timeline for _, e, _ in tl) or 1
    scale = width / float(end)
    rows = []
    for r, tl in enumerate(timeline):
        row = ["."] * width
        for s, e, a in tl:
            lo, hi = round(s * scale), max(round(e * scale), round(s * scale) + 1)
            name = (a.kind if a.chunk % 2 == 0 else a.kind.lower()) + str(a.mb)
            text = name.ljust(hi - lo, {"F": " ", "W": "-"}.get(a.kind, "="))[: hi - lo]
            row[lo:hi] = text
        rows.append(f"rank {r} |{''.join(row)[:width]}|")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------
# Stages: the GPT-2 of 01, cut into contiguous chunks of layers.


def split_layers(n_layer, n_stages):
    """Contiguous, equal layer ranges; an uneven split is refused rather than silently unbalanced."""
    if n_stages > n_layer:
        raise ValueError(f"{n_stages} pipeline stages is more than n_layer={n_layer}")
    if n_layer % n_stages:
        raise ValueError(f"n_layer={n_layer} is not divisible by {n_stages} pipeline stages; "
                         f"uneven splits are not supported")
    per = n_layer // n_stages
    return [range(k * per, (k + 1) * per) for k in range(n_stages)]


def build_chunks(cfg, pp, rank, v=1, group=None, placement=looped, **gpt_kwargs):
    """This rank's model chunks: chunk c is virtual stage placement(pp, c, rank) of pp*v (v=1 in this
    file). They share one tracked random stream (03's chunks hold different layers: different masks)."""
    ranges, S, chunks = split_layers(cfg.n_layer, pp * v), pp * v, []
    for c in range(v):
        k = placement(pp, c, rank)
        chunks.append(tensor_parallel.GPT(cfg, group, layers=ranges[k], pre_process=k == 0, post_process=k == S - 1,
                                          rng=chunks[0].rng if chunks else None, **gpt_kwargs))
    return chunks


def split_batch(idx, targets, m):
    """Cut the global batch (B, T) into m microbatches of B/m rows."""
    B = idx.shape[0]
    if m < 1:
        raise ValueError(f"the number of microbatches m={m} must be at least 1")
    if B % m:
        raise ValueError(f"the global batch of {B} sequences is not divisible by m={m} microbatches")
    return list(zip(idx.chunk(m), targets.chunk(m)))


def check_world(pp, world_size):
    if pp != world_size:
        raise ValueError(f"the world size {world_size} does not match pp={pp} (one stage per rank)")


# ----------------------------------------------------------------------------------------------
# The executor: runs exactly one rank's list, with the messages rank_plan derives from it. 05 plugs
# into it through two arguments, each named here once: wire= is how a boundary tensor travels (05's
# scatter/gather), clock= reads the time of its events (05's --trace); exchange= is an optimization
# (BackgroundSends, at the end of this file). 06 (zero bubble) through three: placement= and
# schedule= (see rank_plan), and split=, the backward split that runs its I and W actions. 07
# (vocabulary parallelism) through one: vocab=, the vocabulary passes that run its S and T actions.


@dataclass
class StepResult:
    loss: object  # the global mean loss on the rank holding the last stage, else None
    events: list  # [(start_s, end_s, action)] in the order they ran
    peak_activation_bytes: int  # most bytes saved for backward (plus kept outputs) at a boundary
    messages: int
    bytes_sent: int
    waits: list = field(default_factory=list)  # [(start_s, end_s, n_ops)]: each batched exchange


@dataclass
class Wire:
    """A boundary tensor travels as itself, in buffers of `shape`."""
    shape: tuple

    def pack(self, t):
        return t

    def unpack(self, buf):
        return buf


class Exchange:
    """A boundary's sends and receives, posted as one batch and all waited for before the next
    action runs. Returns the messages sent: their tensors may now change, or be freed."""

    def __call__(self, ops, sent, meanwhile=lambda: None):
        works = dist.batch_isend_irecv(ops)
        meanwhile()  # what runs while the messages travel: 07's vocabulary passes (rank_plan)
        for work in works:
            work.wait()
        return sent

    def flush(self):
        """At the step's end: the messages whose sends are still in flight, once they completed."""
        return []


def execute(actions, chunks, pp_group, microbatches, act_shape, *, deallocate=True, valid=None,
            ignore_index=-100, wire=None, exchange=None, clock=time.perf_counter, t0=None,
            placement=looped, schedule=None, split=None, vocab=None):
    """Run this rank's actions. chunks[c] is virtual stage placement(pp, c, rank); microbatches is
    the list of (idx, targets); act_shape is the shape of a stage's output. Gradients accumulate in
    the chunks' parameters; the loss of microbatch i is weighted by its share valid[i] / sum(valid)
    of the tokens that count (not ignore_index), so the sum is the serial model's mean loss. Pass
    valid, counted on the host, to keep device read-backs out of the loop (None: counted here).
    deallocate: free each sent output's storage once its send completed (Megatron's trick).
    schedule: every rank's list (receives in their sender's order, rank_plan). split: 06's
    BackwardSplit, for lists with I and W: split.input(key) is the context in which I's backward
    computes input gradients only, split.held(key) what it kept for W (counted as activations until
    then), split.weight(key) runs W. vocab: 07's vocabulary passes, for lists with S and T:
    vocab.start(microbatches, valid) runs the input layer, whose output vocab.input(mb) is the
    first stage's input; the last stage's output goes to vocab.output(mb, y) instead of a loss, and
    its backward starts from vocab.output_grad(mb); vocab.run(action) runs S and T; vocab.finish()
    runs the input layer's backward and returns the loss (on the last stage's rank, else None)."""
    wire, exchange = wire or Wire(act_shape), exchange or Exchange()
    rank, pp = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    S, where = pp * len(chunks), stage_map(pp, len(chunks), placement)
    dtype, device = next(chunks[0].parameters()).dtype, next(chunks[0].parameters()).device
    valid = valid or [int((t != ignore_index).sum()) for _, t in microbatches]
    n_valid = max(sum(valid), 1)  # a microbatch with no valid target weighs 0: it adds nothing
    inbox, outbox, inputs, outputs = {}, {}, {}, {}
    meter, t0 = ActivationMeter(chunks, outputs), clock() if t0 is None else t0
    events, waits, loss, n_msgs, n_bytes = [], [], None, 0, 0
    if vocab:
        vocab.start(microbatches, valid)

    def sent(msg):  # its send completed: the tensor may change now
        if msg[0] == "act":
            key = (where[msg[1] - 1][1], msg[2])  # the output's chunk; its backward may have run already
            meter.unsent.discard(key)
            if deallocate and key in outputs:  # backward does not read a stage's output (its last op
                outputs[key].untyped_storage().resize_(0)  # is an add): free it, keep its graph

    def run(a):
        nonlocal loss
        start = clock() - t0
        k, key = placement(pp, a.chunk, rank), (a.chunk, a.mb)
        idx, targets = microbatches[a.mb]
        if a.kind == "F":  # receive -> forward -> send
            x = (vocab.input(a.mb) if vocab else idx) if k == 0 else inbox.pop(("act", k, a.mb)).requires_grad_()
            with meter.forward(key):
                y = chunks[a.chunk](x, targets if k == S - 1 and not vocab else None)
            if k == S - 1 and vocab:  # 07: the output layer is every rank's, in S and T
                vocab.output(a.mb, y)
            elif k == S - 1:
                y = y[1] * (valid[a.mb] / n_valid)
                loss = y.detach() if loss is None else loss + y.detach()
            elif where[k + 1][0] == rank:  # the next stage is one of this rank's own chunks
                inbox[("act", k + 1, a.mb)] = y.detach()
            else:
                outbox[("act", k + 1, a.mb)] = wire.pack(y.detach())
                meter.unsent.add(key)
            inputs[key], outputs[key] = x, y
        elif a.kind == "W":  # 06: the weight gradients its I left for later; no messages
            split.weight(key)
            meter.saved.pop(key)
        elif KINDS[a.kind].waits:  # 07: S or T, on this rank's slice of the vocabulary
            vocab.run(a)
        else:  # B, or 06's I: receive the output's gradient -> backward -> send the input's gradient
            x, y = inputs.pop(key), outputs.pop(key)
            meter.saved.pop(key)
            grad = inbox.pop(("grad", k, a.mb)) if k < S - 1 else vocab.output_grad(a.mb) if vocab else None
            with split.input(key) if a.kind == "I" else contextlib.nullcontext():
                torch.autograd.backward(y, grad)
            if a.kind == "I":
                meter.saved[key] = split.held(key)  # what W still needs, until it runs
            if k > 0:
                box = inbox if where[k - 1][0] == rank else outbox
                box[("grad", k - 1, a.mb)] = x.grad if box is inbox else wire.pack(x.grad)
        events.append((start, clock() - t0, a))
        meter.measure()

    plan = rank_plan(actions, rank, pp, placement, schedule)
    i = 0
    while i < len(plan):
        kind, step = plan[i]
        if kind == "run":
            run(step)
            i += 1
            continue
        ops, start = [], clock() - t0  # one batch: this boundary's sends and receives, posted together
        for side, peer, msg in step:
            if side == "send":
                t = outbox.pop(msg)
                ops.append(dist.P2POp(dist.isend, t, dist.get_global_rank(pp_group, peer), pp_group))
                n_msgs, n_bytes = n_msgs + 1, n_bytes + t.numel() * t.element_size()
            else:  # poisoned, so a receive that never happened shows up as NaN
                inbox[msg] = torch.full(wire.shape, float("nan"), dtype=dtype, device=device)
                ops.append(dist.P2POp(dist.irecv, inbox[msg], dist.get_global_rank(pp_group, peer), pp_group))
        quiet = during(plan, i)  # 07's passes, while the messages travel

        def meanwhile():
            nonlocal start
            for _, a in quiet:
                run(a)
            start = clock() - t0 if quiet else start  # the wait begins after them

        for msg in exchange(ops, [msg for side, _, msg in step if side == "send"], meanwhile):
            sent(msg)
        for side, _, msg in step:
            if side == "recv":
                inbox[msg] = wire.unpack(inbox[msg])
        waits.append((start, clock() - t0, len(ops)))
        meter.measure()
        i += 1 + len(quiet)
    for msg in exchange.flush():  # the end of the step: nothing is left in flight when the caller goes on
        sent(msg)
    if vocab:
        loss = vocab.finish()
    return StepResult(loss, events, meter.peak, n_msgs, n_bytes, waits)


def sync_tied_embeddings(chunks, embed_group, grad_of=lambda p: p.grad):
    """The output layer is tied to the token embedding. With pp > 1 the first and the last stage
    each hold a copy; summing their gradients over the embedding group (Megatron's) keeps the
    copies identical and gives both the serial model's gradient. grad_of(p) is where p's gradient
    lives (05: 04's flat buffer); it is updated in place."""
    grads = [grad_of(c.transformer.wte.weight) for c in chunks if "wte" in c.transformer]
    if len(grads) > 1:  # first and last chunk on this rank (pp=1 with v>1): add locally
        total = sum(grads)
        for g in grads:
            g.copy_(total)
    if embed_group is not None and grads:
        dist.all_reduce(grads[0], group=embed_group)
        for g in grads[1:]:
            g.copy_(grads[0])


def pipeline_step(cfg, actions, pp_group, embed_group, full, microbatches, deallocate=True):
    """One forward and backward of the whole batch on this rank: its chunks built from the full
    weights, its list of actions run, the tied embedding's gradients summed. Returns (chunks, result)."""
    pp, rank, dtype = dist.get_world_size(pp_group), dist.get_rank(pp_group), full["transformer.wte.weight"].dtype
    device = microbatches[0][0].device
    chunks = build_chunks(cfg, pp, rank, n_chunks(actions), init=False, dtype=dtype, device=device)
    for c in chunks:
        c.load_full_state_dict(full)
    act_shape = (*microbatches[0][0].shape, cfg.n_embd)  # a stage's output: (b, T, C)
    result = execute(actions, chunks, pp_group, microbatches, act_shape, deallocate=deallocate)
    sync_tied_embeddings(chunks, embed_group)
    return chunks, result


def differences(chunks, result, ref_loss, ref_grads):
    """The largest relative difference of this rank's loss (on the last stage) and gradients from serial."""
    diffs = [tensor_parallel.max_rel_diff(p.grad, ref_grads[n]) for c in chunks for n, p in c.named_parameters()]
    return max(diffs + ([tensor_parallel.max_rel_diff(result.loss, ref_loss)] if result.loss is not None else []))


# ----------------------------------------------------------------------------------------------
# Optimization, after the concept: 05's trainer turns it on (--background-sends, the default).


class BackgroundSends(Exchange):
    """Exchange, with the sends left in flight. Before: a boundary waits for its sends as for its
    receives, so a rank whose peer is busy sits idle until that peer posts the matching receive.
    Now: a boundary waits for its receives only (the next action needs them); its sends complete
    while that action runs, and are waited for at the next boundary or the step's end, when their
    tensors may change or be freed. MegaScale (Jiang et al. 2024, Section 3.3) decouples the sends
    and receives of pipeline parallelism so. validate()'s rendezvous model is the conservative one:
    this only relaxes it (a wait moved later), so what validates runs either way."""

    def __init__(self):
        self.in_flight = []  # [(work, message)] from the previous boundary

    def __call__(self, ops, sent, meanwhile=lambda: None):
        works = dist.batch_isend_irecv(ops)
        meanwhile()
        if len(works) != len(ops):  # NCCL: one work for the whole batch, which the receives need
            for work in works:
                work.wait()
            return self.flush() + sent
        for work, op in zip(works, ops):
            if op.op is not dist.isend:
                work.wait()
        done = self.flush()  # the previous boundary's sends: they had its actions' time to complete
        self.in_flight = list(zip([w for w, op in zip(works, ops) if op.op is dist.isend], sent))
        return done

    def flush(self):
        for work, _ in self.in_flight:
            work.wait()
        done, self.in_flight = [msg for _, msg in self.in_flight], []
        return done


# ----------------------------------------------------------------------------------------------
# Demo: GPipe and 1F1B against the serial model, float64, same weights, same batch. Printing the
# figures is plumbing (plumbing/demos.py); the step and the comparison are here.


def serial_reference(cfg, args, m, device):
    """What the demo compares against: the batch cut into m microbatches, the full float64
    weights, and the serial model's loss and gradients on that batch."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx, targets = torch.randint(cfg.vocab_size, (2, args.batch_size, args.seq_len), generator=gen).to(device)
    full = tensor_parallel.init_state_dict(cfg, args.seed, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float64, device=device)
    serial.load_full_state_dict(full)
    loss = serial(idx, targets)[1]
    loss.backward()
    return split_batch(idx, targets, m), full, loss.detach(), {n: p.grad for n, p in serial.named_parameters()}


def run_schedule(env, cfg, schedule, ref, embed_group):
    """One step of `schedule` (every rank's list) against the serial reference, twice: outputs
    deallocated once sent, then kept (to show what deallocation saves). This rank's figures."""
    microbatches, full, ref_loss, ref_grads = ref
    dist.barrier()  # the ranks start together, so their measured timelines line up
    chunks, result = pipeline_step(cfg, schedule[env.rank], dist.group.WORLD, embed_group, full, microbatches)
    kept = pipeline_step(cfg, schedule[env.rank], dist.group.WORLD, embed_group, full, microbatches, deallocate=False)[1]
    return differences(chunks, result, ref_loss, ref_grads), result, kept


def demo(env, cfg, args):
    pp, m, say = args.pp, args.microbatches, printer(env)
    check_world(pp, env.world_size)  # every check runs before the first collective
    split_layers(cfg.n_layer, pp)
    ref = serial_reference(cfg, args, m, env.device)
    say(f"{cfg}\npp={pp} m={m} global batch B={args.batch_size} T={args.seq_len} float64, "
        f"world={env.world_size} ({dist.get_backend()})")
    embed_group = dist.new_group([0, pp - 1], timeout=timedelta(seconds=60)) if pp > 1 else None
    ok, measured = True, {}
    for name in (["gpipe", "1f1b"] if args.schedule == "both" else [args.schedule]):
        schedule = [SCHEDULES[name](pp, m, s) for s in range(pp)]
        validate(schedule, pp, m)
        worst, result, kept = run_schedule(env, cfg, schedule, ref, embed_group)
        good, _, measured[name] = demos.report_pipeline(env, name, schedule, simulate(schedule, pp), worst,
                                                        result, kept, render, say)
        ok &= good
    if args.trace and env.rank == 0:
        write_timelines(args.trace, {n: [r.events for r in ranks] for n, ranks in measured.items()}, 1.0)
        say(f"\nChrome trace of the measured steps ({', '.join(measured)}): {args.trace} "
            f"(open it in chrome://tracing or ui.perfetto.dev)")
    return ok


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
