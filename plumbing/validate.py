"""02's validator: it proves, before any rank starts, that a Schedule (02's, or a later file's
subclass) can run: every rank runs each kind of its table once for each microbatch and chunk, in
order (check_lists), and every rank's plan gets through, its messages matched with its peers' in
the order they are posted, even if every send waits for its receive, as a large NCCL send does
(check_plans). A deadlock found here is a hang that never happens. It reads only the Schedule's
lists, kinds and plans, so a later file's kinds and plans are checked by the same code; 07 adds
the order of its collectives. 02 re-exports validate, check_lists, check_plans and ScheduleError.
"""
from collections import Counter


class ScheduleError(ValueError):
    """A list of actions that cannot run: something missing, out of order, or deadlocking."""


def validate(schedule, m):
    """Raise ScheduleError unless the lists are complete and ordered (check_lists) and the plans
    deadlock-free (check_plans)."""
    check_lists(schedule, m)
    check_plans(schedule)


def check_lists(schedule, m):
    """Every rank runs each kind of schedule.kinds once for each microbatch and chunk, each after
    its Kind.after, and an action fed by another chunk of its own rank after that one."""
    Action = next((type(a) for acts in schedule.lists for a in acts), None)  # 02's, from the lists themselves
    if Action is None:
        raise ScheduleError("no rank runs any action")
    for r, acts in enumerate(schedule.lists):
        want = Counter(Action(k, i, c) for k in schedule.kinds for i in range(m) for c in range(schedule.v))
        have = Counter(acts)
        for a in want - have:
            raise ScheduleError(f"rank {r} never runs {a}")
        for a in have - want:
            raise ScheduleError(f"rank {r} runs {a} more often than once, or it does not exist")
        at = {a: i for i, a in enumerate(acts)}
        for a in acts:
            after = schedule.kinds[a.kind].after
            if after and at[a] < at[Action(after, a.mb, a.chunk)]:
                raise ScheduleError(f"rank {r} runs {a} before {'its forward' if after == 'F' else after + str(a.mb)}")
            got = schedule.needs(a, schedule.stage(r, a.chunk))
            if got and schedule.where[got[1]][0] == r:  # fed by this rank itself: it must come earlier
                dep = Action(a.kind, a.mb, schedule.where[got[1]][1])
                if at[dep] > at[a]:
                    raise ScheduleError(f"deadlock: rank {r} runs {a} before {dep}, which feeds it")


def check_plans(schedule):
    """Every channel's sends and receives match, and every rank gets through its plan when a send
    completes only once its receive is posted (a large NCCL send does so) and an action waits for
    the actions of other ranks its kind names (Kind.waits)."""
    pp, plans = schedule.pp, [schedule.plan(r) for r in range(schedule.pp)]
    posts, at = {}, {}  # (src, dst, side) -> [(message, step)]; (rank, action) -> its step
    for r, plan in enumerate(plans):
        for i, (kind, *what) in enumerate(plan):
            for side, peer, msg in what[0] if kind == "post" else []:
                posts.setdefault((r, peer, side) if side == "send" else (peer, r, side), []).append((msg, i))
            at.update({(r, what[0]): i} if kind == "run" else {})
    # Messages between two ranks are matched in the order they are posted: the sender's order and
    # the receiver's must agree message by message, or data would land in the wrong buffer.
    blocked = [[[] for _ in plan] for plan in plans]  # blocked[r][i]: [(rank, step it must have passed)]
    for src, dst in {(s, d) for s, d, _ in posts}:
        sends, recvs = posts.get((src, dst, "send"), []), posts.get((src, dst, "recv"), [])
        for n, ((x, bs), (y, br)) in enumerate(zip(sends, recvs)):
            if x != y:
                raise ScheduleError(f"rank {src} -> rank {dst}: message {n} is {x} when sent but {y} when received")
            blocked[src][_wait_of(plans[src], bs)].append((dst, br))  # each side's wait needs the other's post
            blocked[dst][_wait_of(plans[dst], br)].append((src, bs))
        if len(sends) != len(recvs):
            raise ScheduleError(f"rank {src} -> rank {dst}: {len(sends)} sends but {len(recvs)} receives")
    for r, plan in enumerate(plans):
        for i, (kind, *what) in enumerate(plan):
            kind_of = schedule.kinds[what[0].kind] if kind == "run" else None
            if kind_of and kind_of.waits:
                blocked[r][i] += [(q, at[(q, b)]) for q, b in kind_of.waits(what[0], r, schedule)]
    pos, moved = [0] * pp, True  # each rank's next step; a step can run once its peers passed theirs
    while moved:
        moved = False
        for r in range(pp):
            while pos[r] < len(plans[r]) and all(pos[q] > i for q, i in blocked[r][pos[r]]):
                pos[r] += 1
                moved = True
    stuck = [r for r in range(pp) if pos[r] < len(plans[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(_waiting(r, plans[r][pos[r]], blocked[r][pos[r]], plans)
                                                     for r in stuck))


def _wait_of(plan, i):
    """The index of the wait of the boundary posted at plan[i]."""
    return next(j for j in range(i + 1, len(plan)) if plan[j][0] == "wait" and plan[j][1] is plan[i][1])


def _waiting(r, step, blocked, plans):
    kind, what = step[:2]
    if kind == "wait":
        return f"rank {r} waits to {' and '.join(f'{o[0]} {o[2]} with rank {o[1]}' for o in what)}"
    return f"rank {r} waits to run {what} until " + " and ".join(
        f"rank {q} has run {plans[q][i][1]}" for q, i in blocked if plans[q][i][0] == "run")
