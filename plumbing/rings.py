"""08's ring schedules read as data, and what its demo prints of them: the validator (a schedule is
causal attention exactly once, on a ring), and the demo's reports (each split's balance per ring step,
every ring message of one layer with its bytes, every gradient's worst difference and the peak
activation bytes). Each reads only a RingSchedule's fields (name, split, steps, owner, cp, n) and what
08 hands it (its SPLITS, simulate, messages); it imports no numbered file. 08 re-exports validate,
report_balance, message_bytes, report_messages and report_parity.
"""
from collections import Counter

from plumbing.validate import ScheduleError


def validate(sched):
    """Refuse a schedule that is not causal attention exactly once, or not a ring: every rank the same
    number of rows and of steps; every block causal (q >= kv); at step s only the rank's own blocks and
    its visitor's, (r - s) mod cp, and at least one side its own; every causal pair of blocks computed
    exactly once, on some rank at some step. Messages then match by construction (08's messages())."""
    cp, n = sched.cp, sched.n
    if sorted(sched.owner) != list(range(n)) or len(sched.owner) != n or len({len(b) for b in sched.split}) != 1:
        raise ScheduleError(f"{sched.name}: the split {sched.split} does not give every rank as many of "
                            f"the {n} blocks, each to one rank")
    if len({len(steps) for steps in sched.steps}) != 1 or len(sched.steps) != cp:
        raise ScheduleError(f"{sched.name}: every rank must run as many ring steps")
    done = Counter()
    for r in range(cp):
        for s, blocks in enumerate(sched.steps[r]):
            for blk in blocks:
                if not (0 <= blk.kv <= blk.q < n):
                    raise ScheduleError(f"{sched.name}: rank {r} step {s} computes {blk}, not causal")
                owners = {sched.owner[blk.q], sched.owner[blk.kv]}
                if r not in owners or not owners <= {r, (r - s) % cp}:
                    raise ScheduleError(f"{sched.name}: rank {r} step {s} computes {blk}, which needs "
                                        f"ranks {sorted(owners)}; at step {s} it meets rank {(r - s) % cp}")
                done[blk.q, blk.kv] += 1
    want = Counter((i, j) for i in range(n) for j in range(i + 1))
    for q, kv in want - done:  # named as 08's Block prints itself
        raise ScheduleError(f"{sched.name}: Block(q={q}, kv={kv}) is never computed")
    for q, kv in done - want:
        raise ScheduleError(f"{sched.name}: Block(q={q}, kv={kv}) is computed {done[q, kv]} times")


def report_balance(say, splits, simulate, cps, show):
    """Each split of `splits` ({name: make(cp)}) at each cp, validated and simulated (08's simulate):
    its balance factor, steps and lockstep time; at cp == show, every rank's work per step."""
    say("\n=== causal balance: each rank's attention per ring step, in (T/cp)^2 blocks ===")
    for cp in cps:
        for name, make in splits.items():
            sched = make(cp)
            validate(sched)
            b = simulate(sched)
            say(f"cp={cp} {name:10s}: balance factor {float(b.factor):.2f} (the busiest rank over the mean), "
                f"{len(b.work[0])} steps, lockstep time {float(b.time):.2f} against {float(b.ideal):.2f} if even")
            if cp == show:
                for r, row in enumerate(b.work):
                    say(f"    rank {r}: " + " ".join(f"{str(x):>4s}" for x in row) + f"  = {b.totals[r]}")


def message_bytes(kind, shape, backward, elt):
    """A message's bytes: shape (B, nh, c, hs), and its kind's width in head-size columns."""
    B, nh, c, hs = shape
    width = {"kv": 2 * hs, "q": 2 * hs + 2 if backward else hs, "out": hs + 2, "dq": hs, "dkv": 2 * hs}[kind]
    return B * nh * c * width * elt


def report_messages(say, splits, messages, cfg, B, T, cp, elt=8):
    """Every exchange of one layer's attention at cp, each split, forward and backward, as 08's
    messages(sched, s, backward) derives it: who sends what to whom, its bytes, and the totals."""
    say(f"\n=== every ring message of one layer's attention at cp={cp}, B={B}, T={T}, float64 ===")
    hs, nh = cfg.n_embd // cfg.n_head, cfg.n_head
    for name, make in splits.items():
        sched = make(cp)
        for backward in (False, True):
            total = 0
            for s in range(len(sched.steps[0]) + 1):
                msgs = messages(sched, s, backward)
                nbytes = [message_bytes(kind, (B, nh, T // sched.n, hs), backward, elt) for *_, kind, _ in msgs]
                total += sum(nbytes)
                say(f"{name:10s} {'backward' if backward else 'forward '} exchange {s}: " + (", ".join(
                    f"{a}->{b} {kind}[{blk}] {n:,} B" for (a, b, kind, blk), n in zip(msgs, nbytes)) or "nothing"))
            say(f"{name:10s} {'backward' if backward else 'forward '}: {total:,} bytes in all, "
                f"{total / cp:,.0f} per rank")


def report_parity(say, worst, peaks):
    """Every gradient's worst relative difference ({what: difference}), then each cp's peak activation
    bytes per rank ({cp: gathered rows}) beside cp = 1's."""
    say("\n=== every gradient's worst relative difference from serial, over cp = 2, 4 and the three schedules ===")
    for key, d in worst.items():
        say(f"{key:45s} {d:.2e}")
    say("\n=== peak activation bytes per rank (what autograd saves for backward), Megatron's split ===")
    for cp, rows in peaks.items():
        mine = [int(r[0]) for r in rows]
        say(f"cp={cp}: " + ", ".join(f"{x:,}" for x in mine) + f"  ({max(mine) / max(int(r[0]) for r in peaks[1]):.2f} "
            f"of cp=1's)")
