"""02's simulator, after the concept: it replays a Schedule's lists (02's, or a later file's) with
per-action times, t_f and t_b one for every rank or a list of each rank's; sends are buffered (a
stage starts once its input arrived). Exact with ints and Fractions: 02's demo prints its bubble
beside the paper's formula, (pp - 1) / m. It reads only the lists, the placement and the kinds'
table. 02 re-exports simulate, Simulation and peak_in_flight.
"""
import importlib
from dataclasses import dataclass
from fractions import Fraction

from plumbing.validate import ScheduleError


@dataclass
class Simulation:
    step_time: object
    idle: list  # per rank: the step time less its busy time
    bubble: object  # total idle / total busy time: (pp - 1) / m for uniform times
    peak_in_flight: list  # per rank: most microbatches (x chunks) forwarded but not yet backwarded
    timeline: list  # per rank: [(start, end, action)]
    span_idle: list  # per rank: idle between its own first start and last end


def peak_in_flight(actions, kinds=None):
    """The most microbatches (x chunks) forwarded ("act") and not yet backwarded ("grad"); kinds: 02's KINDS unless given."""
    kinds, live, peak = kinds or importlib.import_module("02_pipeline_1f1b").KINDS, 0, 0
    for a in actions:
        live += {"act": 1, "grad": -1}.get(kinds[a.kind].flow, 0)
        peak = max(peak, live)
    return peak


def simulate(schedule, t_f=1, t_b=2, t_comm=0, times=None):
    """Deterministic replay: each action starts when its rank is free and what it waits for has
    ended: its input (t_comm later from another rank), the action of kind Kind.after on its stage,
    and any actions of other ranks (Kind.waits; t_comm later). times: {kind: time} for kinds
    other than F and B (a later file's), each a number or a list per rank, as t_f and t_b are."""
    pp, lists = schedule.pp, schedule.lists
    per_rank = lambda t: list(t) if isinstance(t, (list, tuple)) else [t] * pp  # noqa: E731
    times = {kind: per_rank(t) for kind, t in {"F": t_f, "B": t_b, **(times or {})}.items()}
    done, clock, nxt, timeline = {}, [0] * pp, [0] * pp, [[] for _ in range(pp)]
    while any(nxt[r] < len(lists[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while nxt[r] < len(lists[r]):
                a = lists[r][nxt[r]]
                k, kind = schedule.stage(r, a.chunk), schedule.kinds[a.kind]
                got = schedule.needs(a, k)  # (key of what it waits for, delay once that ended)
                deps = ([((kind.flow, got[1], a.mb), t_comm * (schedule.where[got[1]][0] != r))] if got else []) \
                    + ([((kind.after, k, a.mb), 0)] if kind.after else []) \
                    + [(w, t_comm) for w in (kind.waits(a, r, schedule) if kind.waits else [])]
                if any(dep not in done for dep, _ in deps):
                    break
                start = max([clock[r]] + [done[dep] + delay for dep, delay in deps])
                end = clock[r] = start + times[a.kind][r]
                done[(a.kind, k, a.mb)] = done[(kind.flow, k, a.mb)] = done[(r, a)] = end
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
    return Simulation(step, idle, bubble, [peak_in_flight(acts, schedule.kinds) for acts in lists], timeline, span_idle)
