"""05's --self-check: each rank and each group of the layout, tried briefly before training (and
before each restart), so that a bad machine or link is named before it costs a run. MegaScale's
diagnostic tests (Jiang et al. 2024, Section 4.3) in miniature: its intra-host and NCCL tests run
the collectives the job will run, on the groups it will run them on, with short timeouts.

    self_check(env, grid, timeout_s, faults)   a fixed matmul timed on every rank; a small all-reduce
                                               in every tp and dp group, its sum checked; a ping-pong
                                               between neighbouring pipeline stages. Each under its
                                               own short timeout. Rank 0 prints one table and
                                               returns the problems in it (empty: all well).

A rank is out of line when its matmul takes at least twice the median of the others and 50 ms more
(CPU ranks, which share cores, are timed one at a time; a shared machine's noise stays below that).
A group whose all-reduce did not complete names the members that never entered it: each member
says on the side channel that it is entering, so the ones that waited know who did not come.
"""
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from plumbing.launch import launch, side_channel

SIZE, REPEATS, ROUNDS = 256, 5, 4  # the matmul: (256 x 256) @ (256 x 256), 5 times a round; the fastest round


def self_check(env, grid, timeout_s=5.0, faults=(), where_is=str):
    """Run the checks on every rank (all call it with the same grid) and return the list of problems
    found anywhere; rank 0 prints the table. Results travel on the side channel, not on a training
    group, since a group whose collective timed out is no longer to be trusted. faults:
    --rehearse-fault's, acted out here too (slow: the matmul sleeps; hang: the rank enters none of
    its groups' collectives)."""
    store, rows = side_channel(timeout_s + 30), []
    slow = sum(arg for kind, r, arg in faults if kind == "slow" and r == env.rank)
    skips = any(kind == "hang" and r == env.rank for kind, r, _ in faults)
    a = torch.randn(SIZE, SIZE, generator=torch.Generator().manual_seed(0)).to(env.device)
    # Every group first, all ranks together (making one is a collective of the whole world, which a
    # rank still starting up may join late): under a generous timeout; each check then waits for its
    # own collective under the short one (work.wait), so that one slow start is not a failed group.
    groups = {(kind, tuple(ranks)): dist.new_group(ranks, timeout=timedelta(seconds=timeout_s + 60))
              for kind in ("tp", "dp") for ranks in grid[kind] if len(ranks) > 1}
    turns = env.device.type == "cpu"  # CPU ranks share the cores: timed one at a time, or the timing
    if turns and env.rank:  # says which rank the scheduler preferred, not which one is slow
        store.wait([f"selfcheck/turn/{env.rank}"], timedelta(seconds=timeout_s + 30))
    rounds = []  # the fastest of a few rounds: a round the scheduler interrupted says nothing of the rank
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(REPEATS):
            a = (a @ a).div_(a.norm())
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        time.sleep(slow / 1e3)
        rounds.append(1e3 * (time.perf_counter() - t0))
    store.set(f"selfcheck/matmul/{env.rank}", str(min(rounds)))
    if turns:
        store.set(f"selfcheck/turn/{env.rank + 1}", "go")
    # The groups' checks start together, once every rank is timed: none waits out its timeout on a
    # rank that is still taking its turn.
    store.wait([f"selfcheck/matmul/{r}" for r in range(env.world_size)], timedelta(seconds=timeout_s + 60))
    for (kind, ranks), group in groups.items():
        if env.rank in ranks:
            name = ",".join(map(str, ranks))
            rows.append((f"{kind} group [{name}] all-reduce", _all_reduce(env, group, ranks, name, store, skips, timeout_s)))
    for ranks in grid["pp"]:
        for a_rank, b_rank in zip(ranks, ranks[1:]):
            if env.rank in (a_rank, b_rank):
                status = "skipped here (a rehearsed hang)" if skips else _ping_pong(env, a_rank, b_rank, timeout_s)
                rows.append((f"stages of ranks {a_rank} and {b_rank}, ping-pong", status))
    store.set(f"selfcheck/rows/{env.rank}", json.dumps(rows))
    return _table(env, store, timeout_s, where_is) if env.rank == 0 else []


def _table(env, store, timeout_s, where_is):
    """Rank 0: every rank's results, as one table, and the problems in it."""
    keys = [f"selfcheck/rows/{r}" for r in range(env.world_size)]
    deadline = time.monotonic() + timeout_s + 10
    while time.monotonic() < deadline and not store.check(keys):
        time.sleep(0.05)
    lines, problems = [f"self-check of world {env.world_size}, each part under a {timeout_s:g} s timeout:"], []
    times = {r: float(store.get(f"selfcheck/matmul/{r}")) for r in range(env.world_size)
             if store.check([f"selfcheck/matmul/{r}"])}
    for r in range(env.world_size):
        if r not in times:
            lines.append(f"  matmul   rank {r:<3} ({where_is(r)})  no answer")
            problems.append(f"rank {r} ({where_is(r)}) did not answer")
            continue
        others = [t for q, t in times.items() if q != r]
        median = statistics.median(others) if others else times[r]
        out = times[r] >= 2 * median and times[r] >= median + 50
        lines.append(f"  matmul   rank {r:<3} ({where_is(r)}) {times[r]:8.1f} ms"
                     + (f"   OUT OF LINE: the others' median is {median:.1f} ms" if out else ""))
        if out:
            problems.append(f"rank {r} ({where_is(r)}) is slow: its matmul took {times[r]:.1f} ms against the "
                            f"others' {median:.1f} ms")
    seen = {}
    for r in range(env.world_size):
        if store.check([keys[r]]):
            for what, status in json.loads(store.get(keys[r])):
                rank = 0 if status == "ok" else 1 if status.startswith("skipped") else 2
                if rank >= seen.get(what, (-1, ""))[0]:  # what a member saw fail outranks the rest
                    seen[what] = (rank, status)
    seen = {what: status for what, (_, status) in seen.items()}
    for what, status in seen.items():
        lines.append(f"  {what}: {status}")
        if status != "ok":
            problems.append(f"{what}: {status}")
    print("\n".join(lines), flush=True)
    return problems


def _all_reduce(env, group, ranks, name, store, skips, timeout_s):
    key = f"selfcheck/{name}/{{}}"
    if skips:
        return "skipped here (a rehearsed hang)"
    store.set(key.format(env.rank), "in")
    x = torch.full((4,), float(env.rank + 1), device=env.device)
    try:
        dist.all_reduce(x, group=group, async_op=True).wait(timedelta(seconds=timeout_s))
    except Exception:
        absent = [r for r in ranks if not store.check([key.format(r)])]
        return f"did not complete: rank(s) {absent} never entered it" if absent else "did not complete"
    want = float(sum(r + 1 for r in ranks))
    return "ok" if torch.all(x == want) else f"wrong sum {x[0].item():g} (want {want:g})"


def _ping_pong(env, a, b, timeout_s):
    """Rank a sends to b and waits for the answer; b receives, then answers."""
    x, peer = torch.zeros(1024, device=env.device), b if env.rank == a else a
    order = (dist.isend, dist.irecv) if env.rank == a else (dist.irecv, dist.isend)
    try:
        for op in order:
            for work in dist.batch_isend_irecv([dist.P2POp(op, x, peer)]):
                work.wait(timedelta(seconds=timeout_s))
    except Exception:
        return f"no answer from rank {peer} within {timeout_s:g} s"
    return "ok"


def run(tc, grid, prefix=""):
    """05's --self-check (and the check before a restart): self_check on every rank of tc's layout,
    whose groups are grid (05's rank_grid), launched here; a ValueError listing what it found, else a
    line saying all is well."""
    # Each check has its own short timeout; the launch's bounds joining and building groups, which on
    # a loaded machine can outlast a short --timeout-s (gloo's connection waits on the launch's store).
    from plumbing.checks import world_size
    ranks = launch(_check_layout, world_size(tc), tc, grid, timeout_s=max(tc.timeout_s, 60.0))
    problems = sorted({p for rank in ranks for p in rank})
    if problems:
        raise ValueError(f"{prefix}the self-check found {len(problems)} problem(s):\n"
                         + "\n".join(f"  - {p}" for p in problems))
    print("self-check: every rank, group and link answered in line", flush=True)


def _check_layout(env, tc, grid):
    from plumbing import watch
    return self_check(env, grid, min(5.0, tc.timeout_s), watch.parse_faults(tc.rehearse_fault, env.world_size),
                      lambda r: watch.coords(r, tc))
