"""Week 4's fault-diagnosis records, a fresh instance per seed: what plumbing/watch.py's watchdog
collects from a hung 3D-parallel job of 8 ranks (every rank's record, in plumbing/health.py's
format), and the busy times of a job with a slow rank, for the exercise of docs/COURSE.md's Week 4
and docs/course/week4.md. The teacher gives each cohort a seed; the student's file holds the records
and the questions only, and the answer key, printed apart, is what plumbing/health.py's diagnose()
and stragglers() say of those very records.

    python3 scripts/fault_records.py --seed 7 --out records.json    # the students' file
    python3 scripts/fault_records.py --seed 7 --key                 # the teacher's answer key
    python3 scripts/fault_records.py --seed 7 --key --out key.txt

The same seed gives the same bytes (no clock, no set order, Python's own seeded generator); another
seed another layout, fault and numbers. How an instance is made: a layout tp x pp x dp of 8 ranks
(05's rank_grid order, rank = (p dp + d) tp + t), a fault (a rank outside communication, dead,
silent, or a cycle of waits), and a tree of who waits for whom grown from the faulty rank(s) along
the grid's groups (the members of a tp or dp group in a collective it has not entered) and its
pipeline neighbours (a receive it has not sent); every record is written to say exactly that, and
the script checks that diagnose() names the planted rank(s) and that stragglers() names the planted
slow rank before it writes anything.
"""
import argparse
import copy
import json
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
sys.path.insert(0, ROOT)

from plumbing import health  # noqa: E402

WORLD = 8  # 05's default world
LAYOUTS = [(2, 2, 2), (1, 2, 4), (2, 4, 1), (1, 4, 2), (4, 2, 1)]  # (tp, pp, dp): pp >= 2, so that ranks exchange
KINDS = ["outside communication", "dead", "silent", "cycle"]
OPS = {"tp": ["all_reduce", "all_reduce", "all_gather", "reduce_scatter"], "dp": ["all_reduce", "reduce_scatter"]}
QUESTIONS = [
    "(1) Draw who waits for whom (plumbing.health.waits_for): a rank in a collective waits for the members of its "
    "group that have not entered that collective; a rank inside a point-to-point exchange, for its peers.",
    "(2) Which rank(s) does diagnose() name, as what kind of fault, and in which group and collective do the "
    "others wait? Say it on paper first, then check it in a Python shell with plumbing.health.",
    "(3) Change one record so that the kind of fault changes (a single rank to a cycle, or a cycle to a single "
    "rank), and say what a cycle of waits means about the code.",
    "(4) With the busy times below (ms per step), which rank does stragglers() name, and why would comparing "
    "each rank with the median of the whole world name more?",
    "(5) Why does the watchdog wait until no rank has made progress, and some rank waits, before it diagnoses "
    "anything?",
]


def grid(tp, pp, dp):
    """05's rank_grid(8, tp, dp, pp) (rank = (p dp + d) tp + t), restated here so that the script also
    runs where 05 is a student's stub; tests/test_fault_records.py checks the two agree."""
    rank = lambda t, d, p: (p * dp + d) * tp + t  # noqa: E731
    return {"tp": [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "dp": [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
            "pp": [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)]}


def name(group):
    return ",".join(map(str, sorted(group)))


def _waits(rng, g, roots, preset):
    """{rank: (the rank it waits for, how)} for every rank not in roots, grown from them: how is
    ("group", G, op) or ("p2p",). A group carries waits only once, and only to members not yet placed
    (they all wait in its next collective for the one that has not entered it); a pipeline neighbour
    waits on a receive. None when the growth gets stuck (the caller draws again)."""
    groups_of = {r: [(kind, name(grp)) for kind in ("tp", "dp") for grp in g[kind] if r in grp and len(grp) > 1]
                 for r in range(WORLD)}
    peers = {r: [c[i + d] for c in g["pp"] if r in c for i in [c.index(r)] for d in (-1, 1) if 0 <= i + d < len(c)]
             for r in range(WORLD)}
    waits, used = dict(preset), {how[1] for _, how in preset.values() if how[0] == "group"}
    placed = set(roots) | set(preset)
    while len(placed) < WORLD:
        options = [("group", q, kind, grp) for q in sorted(placed) for kind, grp in groups_of[q]
                   if grp not in used and not placed & (set(health.members(grp)) - {q})]
        options += [("p2p", q, nb) for q in sorted(placed) for nb in peers[q] if nb not in placed]
        if not options:
            return None
        pick = rng.choice(options)
        if pick[0] == "group":
            _, q, kind, grp = pick
            op = rng.choice(OPS[kind])
            used.add(grp)
            for r in health.members(grp):
                if r != q:
                    waits[r] = (q, ("group", grp, op))
                    placed.add(r)
        else:
            waits[pick[2]] = (pick[1], ("p2p",))
            placed.add(pick[2])
    return waits


def _cycle(rng, g, tp):
    """(the ranks of a cycle of waits, their waits): two pipeline neighbours each receiving from the other
    first; or, with tp = 2, a square: a waits in its tp group's collective for b, b receives from the next
    stage's c, c waits in its tp group for d, d receives from a."""
    chain = rng.choice(g["pp"])
    i = rng.randrange(len(chain) - 1)
    a, c_ = chain[i], chain[i + 1]
    if tp != 2 or rng.random() < 0.4:
        return [a, c_], {a: (c_, ("p2p",)), c_: (a, ("p2p",))}
    pair = next(grp for grp in g["tp"] if a in grp)
    b = next(r for r in pair if r != a)
    below = next(ch for ch in g["pp"] if b in ch)[i + 1]  # b's neighbour on the next stage
    d = next(r for r in next(grp for grp in g["tp"] if below in grp) if r != below)
    return [a, b, below, d], {a: (b, ("group", name(pair), rng.choice(OPS["tp"]))), b: (below, ("p2p",)),
                              below: (d, ("group", name([below, d]), rng.choice(OPS["tp"]))), d: (a, ("p2p",))}


def _records(rng, g, waits, step, culprit, kind):
    """Every rank's record saying exactly `waits`: a group's members all entered its first n collectives
    (n drawn per group); a rank waiting in one has entered the (n + 1)-th, the one it waits for has not."""
    count = {name(grp): rng.randint(8, 80) if kind_ == "tp" else rng.randint(2, 30)
             for kind_ in ("tp", "dp") for grp in g[kind_] if len(grp) > 1}
    micro = rng.randint(0, 7)
    out = {}
    for r in range(WORLD):
        mine = {grp: [n, n, None] for grp, n in count.items() if r in health.members(grp)}
        out[r] = dict(step=step, phase=f"backward {micro}", groups=mine, waiting_for=[], state="running")
    for r, (q, how) in sorted(waits.items()):
        if how[0] == "group":
            grp, op = how[1], how[2]
            n = count[grp]
            out[r]["groups"][grp] = [n + 1, n, op]
            out[r]["phase"] = f"{rng.choice(['forward', 'backward'])} {micro}" if grp in map(name, g["tp"]) else \
                "gradient reduction"
        else:
            out[r]["waiting_for"] = [q]
            stage = {x: p for ch in g["pp"] for p, x in enumerate(ch)}
            out[r]["phase"] = f"{'forward' if stage[q] < stage[r] else 'backward'} {micro}"  # activations come down
    if kind == "outside communication":
        out[culprit]["phase"] = rng.choice([f"forward {micro}", "loss", "optimizer", "data loading"])
    elif kind == "dead":
        out[culprit]["state"] = rng.choice(["dead: signal 9 (SIGKILL)", "dead: exit code 1",
                                            "dead: signal 11 (SIGSEGV)"])
    elif kind == "silent":
        out[culprit]["state"] = "silent"
    return out


def _busy(rng, g):
    """({rank: busy ms}, {rank: stage}, the planted slow rank): one stage does more work than the others
    (the last, with the logits and the loss, or the first, with the embedding), one rank is slow."""
    stage = {r: p for ch in g["pp"] for p, r in enumerate(ch)}
    pp = len(g["pp"][0])
    heavy = rng.choice([0, pp - 1])
    while True:
        base = rng.uniform(90, 110)
        busy = {r: base * (rng.uniform(1.8, 2.2) if stage[r] == heavy else 1) * rng.uniform(0.97, 1.03)
                for r in range(WORLD)}
        slow = rng.choice([r for r in range(WORLD) if sum(stage[q] == stage[r] for q in range(WORLD)) > 1])
        busy[slow] *= rng.uniform(1.45, 1.8)
        busy = {r: round(ms) for r, ms in busy.items()}
        naive = health.stragglers(busy, {r: 0 for r in busy})  # against the whole world
        if health.stragglers(busy, stage) == [slow] and len(naive) > 1:
            return busy, stage, slow


def instance(seed):
    """(the students' records as a dict, the key as a dict): see the module's docstring."""
    rng = random.Random(seed)
    tp, pp, dp = rng.choice(LAYOUTS)
    g = grid(tp, pp, dp)
    kind = rng.choice(KINDS)
    step = rng.randint(3, 40)
    for _ in range(1000):  # a growth that gets stuck is drawn again, from the same generator
        if kind == "cycle":
            roots, preset = _cycle(rng, g, tp)
            culprit = None
        else:
            culprit, preset = rng.randrange(WORLD), {}
            roots = [culprit]
        waits = _waits(rng, g, roots, preset)
        if waits is not None:
            break
    records = _records(rng, g, waits, step, culprit, kind)
    busy, stage, slow = _busy(rng, g)
    planted = sorted(roots) if kind == "cycle" else [culprit]
    waiting = list(range(WORLD)) if kind == "cycle" else [r for r in range(WORLD) if r != culprit]  # all, in turn
    found = health.diagnose(records, WORLD)
    if (found.culprits, found.kind, found.waiting) != (planted, kind, waiting):  # the records must say what was planted
        raise AssertionError(f"seed {seed}: planted {kind} at {planted} with {waiting} waiting, diagnose() says "
                             f"{found.kind} at {found.culprits} with {found.waiting} waiting")
    student = {
        "what": "every rank's last record, as plumbing/watch.py's watchdog collected them when the job hung "
                "(plumbing/health.py's docstring says what each field means), and the busy times of another step",
        "layout": {"world": WORLD, "tp": tp, "pp": pp, "dp": dp, "rank": "(p dp + d) tp + t, 05's rank_grid"},
        "groups": {k: g[k] for k in ("tp", "dp", "pp")},
        "load": "records = {int(r): rec for r, rec in data['records'].items()}; "
                "plumbing.health.diagnose(records, 8)",
        "records": {str(r): rec for r, rec in records.items()},
        "busy_ms": {str(r): ms for r, ms in busy.items()},
        "questions": QUESTIONS,
    }
    return student, _key(seed, records, busy, stage, found, kind, g, (tp, pp, dp))


def _key(seed, records, busy, stage, found, kind, g, layout):
    edges = health.waits_for(records)
    change, changed = _change(records, found, g)
    naive = health.stragglers(busy, {r: 0 for r in busy})
    return {
        "seed": seed, "layout": "tp {} x pp {} x dp {}".format(*layout),
        "waits_for": {r: sorted(out) for r, out in sorted(edges.items())},
        "diagnosis": {"culprits": found.culprits, "kind": found.kind, "group": found.group, "op": found.op,
                      "step": found.step, "waiting": found.waiting, "why": found.why},
        "change": change, "changed_diagnosis": f"{changed.kind} at {changed.culprits}: {changed.why}",
        "stragglers": health.stragglers(busy, stage), "against_the_world": naive,
        "medians": "each rank against the median of the other ranks of its stage; stage "
                   + ", ".join(f"{p}: {sorted(busy[r] for r in busy if stage[r] == p)}"
                               for p in sorted(set(stage.values()))),
    }


def _change(records, found, g):
    """One record changed so that the kind of fault changes, and diagnose()'s new answer: a single rank
    made to receive from a pipeline neighbour (which waits on it, in turn: a cycle), or a rank of a
    cycle taken out of its wait (it goes on computing: the one the others wait for)."""
    changed = copy.deepcopy(records)
    if found.kind == "cycle":
        r = found.culprits[0]
        rec = changed[r]
        rec["waiting_for"] = []
        rec["groups"] = {grp: [e, left, None] for grp, (e, left, op) in rec["groups"].items()}
        rec["phase"] = "optimizer"
        what = f"rank {r}: waiting_for [] and no collective waited in (op None), phase 'optimizer'"
    else:
        r = found.culprits[0]
        nb = next(ch[ch.index(r) + (1 if ch.index(r) == 0 else -1)] for ch in g["pp"] if r in ch)
        changed[r]["state"], changed[r]["waiting_for"] = "running", [nb]
        what = f"rank {r}: state 'running' and waiting_for [{nb}] (a receive from its pipeline neighbour)"
    return what, health.diagnose(changed, WORLD)


def student_text(student):
    """The students' file: JSON, a record to a line, the same bytes for the same instance."""
    lines = ["{"]
    for k, v in student.items():
        if k in ("records", "busy_ms", "groups"):
            inner = [f"    {json.dumps(kk)}: {json.dumps(vv)}" for kk, vv in v.items()]
            lines.append(f"  {json.dumps(k)}: {{\n" + ",\n".join(inner) + "\n  },")
        elif k == "questions":
            lines.append(f"  {json.dumps(k)}: [\n" + ",\n".join(f"    {json.dumps(q)}" for q in v) + "\n  ],")
        else:
            lines.append(f"  {json.dumps(k)}: {json.dumps(v)},")
    lines[-1] = lines[-1].rstrip(",")
    return "\n".join(lines) + "\n}\n"


def key_text(key):
    """The teacher's key, for the questions of the students' file, in their order."""
    d = key["diagnosis"]
    where = f" in {d['op']} on group [{d['group']}]" if d["op"] else ""
    lines = [f"Fault records, seed {key['seed']}: the answer key (the teacher's; not in the students' file)",
             f"layout {key['layout']}", "",
             "(1) waits_for: " + "; ".join(f"{r} -> {out}" for r, out in key["waits_for"].items()),
             f"(2) diagnose(): {d['kind']} at {d['culprits']} (step {d['step']}){where}; waiting: {d['waiting']}",
             f"    its sentence: {d['why']}",
             f"(3) one change that works: {key['change']}", f"    then diagnose() says: {key['changed_diagnosis']}",
             "    a cycle means the ranks called collectives (or sends and receives) in different orders: each is "
             "inside one, waiting for another that is inside another",
             f"(4) stragglers(): {key['stragglers']} ({key['medians']}); against the whole world's median: "
             f"{key['against_the_world']}, since a stage that does more work (the embedding's or the loss's) is "
             f"slower on every rank of it",
             "(5) a rank that makes progress is not hung (a long step is not a hang); with no rank waiting there is "
             "nothing to follow to a culprit, and a diagnosis drawn from records that still change names a rank "
             "that is merely busy (MegaScale, Section 5.2)"]
    return "\n".join(lines) + "\n"


def main(argv=None, out=print):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="the instance (default 0): one per cohort")
    parser.add_argument("--key", action="store_true", help="print the teacher's answer key instead of the records")
    parser.add_argument("--out", help="write to this file (default: print)")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed {args.seed}: must be 0 or more")
    student, key = instance(args.seed)
    text = key_text(key) if args.key else student_text(student)
    if args.out:
        with open(args.out, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        out(f"wrote {args.out}")
    else:
        out(text.rstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
