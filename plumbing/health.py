"""Which rank is at fault: the two ideas of MegaScale's robustness half (Jiang et al. 2024) worth
teaching, as pure functions of made-up or collected records. The machinery that collects the
records (a side channel, a hang watchdog, per-step timers) is plumbing/watch.py.

    diagnose(records, world)     a hang: follow who waits for whom to the rank outside
                                 communication, dead or silent; or a cycle of waits (Section 5.2)
    stragglers(busy, stage_of)   the ranks at least 1.3x the median busy time of the other ranks of
                                 their stage, and at least 20 ms more (Section 5.1)
    heat_map(busy, grid)         busy ms per rank, drawn on the pp x dp (x tp) grid

A record is one rank's view of itself, a dict (JSON-able, as the side channel carries it):
    step, phase         where its training loop is ("forward 3", "optimizer", ...)
    groups              {group name: [entered, left, op]}: how many collectives the rank entered
                        (launched) and left (completed) on each process group, and the one it waits
                        in now (op, or None: the group's next to complete, number left + 1). A
                        group is named by its global ranks, "0,2,4,6"
    waiting_for         [peer, ...]: the ranks a point-to-point exchange it is inside waits on
    state               "running" (it answers), "dead: <exit code or signal>", or "silent" (it was
                        alive but wrote no record within the deadline: stopped, or stuck in C code)
    quiet_s             (optional) how long since it last made progress, as the watchdog saw: of
                        several ranks that wait for no one, the others wait for the quietest
"""
import statistics
from dataclasses import dataclass, field


@dataclass
class Diagnosis:
    culprits: list  # the ranks at fault (one, except for a cycle)
    kind: str  # "dead", "silent", "outside communication", "cycle", or "none" (nothing stuck)
    group: str = ""  # the group the others wait in, e.g. "0,4"
    op: str = ""  # the collective they wait in
    step: int | None = None  # the culprit's step, as it last said
    waiting: list = field(default_factory=list)  # the ranks stuck waiting, directly or not, on them
    why: str = ""  # a sentence for the report
    stacks: list | None = None  # the ranks whose Python stacks were written (plumbing/watch.py), if asked


def members(group):
    return [int(r) for r in group.split(",")]


def waits_for(records):
    """{rank: set of ranks it waits for}: waiting in a collective on group G, the members of G that
    have not yet entered the one it waits in (they have not reached it); inside a
    point-to-point exchange, its peers. A rank in no collective waits for no one."""
    edges = {}
    for r, rec in records.items():
        if not rec.get("state", "running").startswith("running"):
            continue
        out = set(rec.get("waiting_for") or [])
        for group, (entered, left, op) in (rec.get("groups") or {}).items():
            if op is None:
                continue
            need = left + 1  # the collective it waits in: the next of the group's to complete
            for q in members(group):
                theirs = (records.get(q) or {}).get("groups", {}).get(group)
                if q != r and (theirs is None or theirs[0] < need):
                    out.add(q)
        edges[r] = out
    return edges


def diagnose(records, world):
    """The rank(s) a hang waits for, from every rank's record ({rank: record}; a rank with no record
    is silent). MegaScale, Section 5.2: in a hung 3D-parallel job most ranks are blocked inside some
    collective or point-to-point exchange, as victims; following who waits for whom from any of them
    leads to the one that is not communicating at all (computing, stuck in Python, sleeping), or
    that died or went silent. A cycle instead of such an end means ranks called collectives in
    different orders: every rank of it is inside one, waiting for another that is inside another."""
    records = {r: records.get(r) or {"state": "silent"} for r in range(world)}
    edges = waits_for(records)
    stuck = sorted(r for r, out in edges.items() if out)
    if not stuck:
        dead = [r for r, rec in records.items() if not rec.get("state", "running").startswith("running")]
        if dead:
            return _blame(records, dead[:1], [], "", "")
        return Diagnosis([], "none", why="no rank is waiting in a collective or an exchange")
    # Follow the edges from the first stuck rank, always to the lowest rank waited for: it ends at
    # a rank waiting for no one (the culprit) or comes back to one already seen (a cycle).
    path, r = [], stuck[0]
    while r not in path and edges.get(r):
        path.append(r)
        r = min(edges[r])
    if r not in path:  # an end: of several, the one quiet longest, when the records say (quiet_s)
        r = _longest_quiet(records, edges, stuck, r)
    waiting = sorted(q for q in stuck if _reaches(edges, q, r))
    if r in path:  # a cycle
        cycle = path[path.index(r):]
        ops = [_inside(records[q]) for q in cycle]
        what = "; ".join(f"rank {q} is in {op or 'an exchange'} on {g or 'its peers'}" for q, (g, op) in zip(cycle, ops))
        return Diagnosis(sorted(cycle), "cycle", step=records[cycle[0]].get("step"), waiting=waiting,
                         why=f"ranks {sorted(cycle)} wait for each other: {what}: they call collectives in "
                             f"different orders")
    group, op = _inside(records[path[-1]])  # what the last victim before the culprit waits in
    direct = {q: _inside(records[q]) for q in waiting if r in edges[q]}  # those waiting on it themselves
    return _blame(records, [r], waiting, group, op, direct)


def _longest_quiet(records, edges, stuck, end):
    """Of the ranks waited for (directly or in turn) that wait for no one, the dead or silent one, else
    the one that made no progress for the longest (a record's quiet_s, the watchdog's measure); end
    when the records do not say. A rank that is slow for long while another computes briefly before
    its next collective: the one the others have waited for since."""
    ends = {q for p in stuck for q in edges[p] if not edges.get(q)}
    if len(ends) < 2 or any("quiet_s" not in (records[q] or {}) for q in ends):
        return end
    return max(sorted(ends), key=lambda q: (not records[q].get("state", "running").startswith("running"),
                                             records[q]["quiet_s"]))


def _reaches(edges, start, target):
    seen, todo = set(), [start]
    while todo:
        q = todo.pop()
        if q == target:
            return True
        if q not in seen:
            seen.add(q)
            todo += sorted(edges.get(q, ()))
    return False


def _inside(rec):
    for group, (entered, left, op) in (rec.get("groups") or {}).items():
        if op is not None:
            return group, op
    return "", ""


def _blame(records, culprits, waiting, group, op, direct=None):
    """direct: {rank: (group, op)} of the ranks that wait on the culprit itself, not through another."""
    rec = records[culprits[0]]
    kind, what = state_of(rec)
    if not direct:
        where = f" in {op} on group [{group}]" if op else ""
        return Diagnosis(culprits, kind, group, op, rec.get("step"), waiting,
                         f"rank {culprits[0]} {what}; ranks {waiting} wait for it{where}")
    inside = {}  # (group, op) -> the ranks waiting on the culprit there
    for q, (g, o) in sorted(direct.items()):
        inside.setdefault((g, o), []).append(q)
    said = "; ".join(f"{_ranks(qs)} for it "
                     + (f"in {o} on group [{g}]" if o else "in a point-to-point exchange") for (g, o), qs in inside.items())
    rest = [q for q in waiting if q not in direct]
    return Diagnosis(culprits, kind, group, op, rec.get("step"), waiting,
                     f"rank {culprits[0]} {what}; {said}" + (f"; {_ranks(rest)} on them in turn" if rest else ""))


def state_of(rec):
    """(kind, what it does in words) of a rank that others wait for, from its record: "dead" ("died
    (<how>)"), "silent" ("stopped answering ...") or "outside communication" ("is not in any
    collective (at step S, <phase>)"). The hang report and the timeout report (plumbing/watch.py)
    say it in these words."""
    state = rec.get("state", "running")
    kind = "dead" if state.startswith("dead") else "silent" if state == "silent" else "outside communication"
    return kind, {"dead": f"died ({state[6:]})", "silent": "stopped answering (no record within the deadline)",
                  "outside communication": f"is not in any collective (at step {rec.get('step')}, "
                                           f"{rec.get('phase') or 'no phase said'})"}[kind]


def _ranks(qs):
    return f"rank {qs[0]} waits" if len(qs) == 1 else f"ranks {qs} wait"


def stragglers(busy, stage_of, ratio=1.3, margin_ms=20.0):
    """The ranks whose busy time (ms: the step minus its waits in p2p and collectives) is at least
    `ratio` times the median of the other ranks of their pipeline stage, and at least `margin_ms`
    more. MegaScale, Section 5.1: a few slow machines set the pace of the whole job (about 0.5% of
    them in its runs), and a rank's busy time, compared with ranks that do the same work (the same
    stage), shows it where the step time cannot: the others' waits absorb the slowness. (The others'
    median, not the stage's: with two ranks a stage, the slow one would move its own yardstick.)
    busy: {rank: ms}; stage_of: {rank: stage}."""
    out = []
    for r, ms in sorted(busy.items()):
        others = [b for q, b in busy.items() if q != r and stage_of[q] == stage_of[r]]
        if others and ms >= ratio * statistics.median(others) and ms >= statistics.median(others) + margin_ms:
            out.append(r)
    return out


def heat_map(busy, tp, dp, pp):
    """Busy ms per rank as a grid: a row per (pp stage, tp rank), a column per dp replica, in the rank
    order of 05's rank_grid (rank = (p dp + d) tp + t)."""
    lines = [f"busy ms per step (median): rows pp stage x tp rank, columns dp replica 0-{dp - 1}"]
    for p in range(pp):
        for t in range(tp):
            cells = [busy.get((p * dp + d) * tp + t) for d in range(dp)]
            row = " ".join(f"{c:7.1f}" if c is not None else "      -" for c in cells)
            lines.append(f"  pp {p} tp {t} |{row}")
    return "\n".join(lines)
