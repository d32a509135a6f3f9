"""Every rank runs the same configuration, or none trains: checked before the first training
collective, so that ranks started with different flags (two torchrun agents on two nodes, each
given its own command line) are refused together, in one sentence, instead of training a hybrid
model, saving half a checkpoint or dying later in a collective whose sizes do not match.

    check(env, cfg, tc, resumed, start)   refuse, on every rank, a world whose ranks differ

What must agree, each under the flag that sets it: the program; the model (every field of
GPTConfig, as resolved: flags, or the weights of --init-from); every flag of the trainer's config
(06 and 07 add theirs), by its value, with what a default resolves to in its place where it is
resolved by the flags and the device (--hang-s, --dtype, --fused-kernels, --cuda-graphs,
--graph-scope), so that a default and the value it stands for agree; paths resolved (links
followed, from each rank's working directory); the data by its identity (size and a hash of its
head and tail, plumbing/data.identity), not by its path, so that a copy of the same file
elsewhere agrees, and --loss-mask's the same way; the checkpoint resumed (resolved) and the step it
holds.

Two exchanges, both of fixed size, so that they cannot fail on ranks that disagree about sizes
or layouts (they run on the default group, before any other group exists): every rank's SHA-256
digest of all of it (32 bytes), and only when the digests differ, every rank's items as JSON
bytes (launch.gather_json: the lengths first, then the padded rows). Every rank then builds the
same sentence from the same items and raises it. A rank that never comes is named, after the
collective timeout, from the default group's store, where each rank leaves a mark before it waits.
"""
import dataclasses
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from plumbing.checks import acceleration, flag
from plumbing.data import identity
from plumbing.launch import gather_json, side_channel

PATHS = ("save", "snapshot_dir", "metrics", "trace", "init_from")  # compared resolved
SHOWN = 3  # the differing flags named in the sentence; the rest are counted


def resolved(tc, device):
    """{field: the value its default stands for on this device}, for the flags whose unset or
    "auto" value is resolved from the others (the watch's --hang-s, checks.acceleration's)."""
    from plumbing.watch import hang_seconds
    fused, graphs = acceleration(tc, device)
    auto_dtype = "bfloat16" if device.type == "cuda" else "float32"  # 05's resolve_dtype
    return dict(hang_s=hang_seconds(tc), dtype=auto_dtype if tc.dtype == "auto" else tc.dtype, fused_kernels=fused,
                cuda_graphs=graphs is not None, graph_scope=graphs or "off")


def items(cfg, tc, resumed, start, device=torch.device("cpu")):
    """{what: [compared value, shown value]} for everything that must agree. `what` is the flag
    (or "the program"); the shown value is what the sentence says."""
    out = {"the program": [os.path.basename(sys.argv[0])] * 2}
    for f in dataclasses.fields(cfg):
        out[flag(f.name)] = [repr(getattr(cfg, f.name)), str(getattr(cfg, f.name))]
    stands_for = resolved(tc, device)
    for f in dataclasses.fields(tc):
        value = getattr(tc, f.name)
        if f.name in stands_for:
            meant = stands_for[f.name]
            out[flag(f.name)] = [repr(meant), str(value) if meant == value else f"{value} ({meant})"]
        elif f.name == "rehearse_fault":  # the same faults, in any order
            out[flag(f.name)] = [repr(sorted(value)), " ".join(value) or "none"]
        elif f.name == "data":
            ident = identity(value)
            where = value or "the built-in corpus"
            out["--data"] = [json.dumps(ident, sort_keys=True),
                             f"{where} ({ident['bytes']:,} bytes, head and tail {ident['head_tail_sha256'][:12]})"]
        elif f.name == "loss_mask":  # by identity, as the data: a copy of the same mask agrees
            ident = identity(value) if value else None
            out["--loss-mask"] = [json.dumps(ident, sort_keys=True), f"{value} ({ident['bytes']:,} bytes, head and "
                                  f"tail {ident['head_tail_sha256'][:12]})" if value else "none"]
        elif f.name == "resume":
            real = os.path.realpath(resumed) if resumed else ""
            out["--resume"] = [f"{real} {start}", f"{real} (step {start})" if resumed else
                               f"no checkpoint{f' in {value}' if value else ''} (step 0)"]
        elif f.name in PATHS:
            real = os.path.realpath(value) if value else ""
            out[flag(f.name)] = [real, real or "none"]
        else:
            out[flag(f.name)] = [repr(value), str(value)]
    return out


def digest(mine):
    return hashlib.sha256(json.dumps({k: v[0] for k, v in mine.items()}, sort_keys=True).encode()).digest()


def check(env, cfg, tc, resumed, start):
    """Refuse, on every rank, a world whose ranks differ in anything that must agree (items());
    returns quietly when they all agree. resumed, start: the checkpoint preflight found and its
    step (None, 0 when none). A collective of the default group: every rank calls it, before any
    other group is made."""
    mine = items(cfg, tc, resumed, start, env.device)
    ours = torch.frombuffer(bytearray(digest(mine)), dtype=torch.uint8).to(env.device)
    every = [torch.empty_like(ours) for _ in range(env.world_size)]
    mark = _arrive(env)
    try:
        dist.all_gather(every, ours)
    except RuntimeError as e:  # gloo: a peer gone or silent; name those that never came, if known
        missing = _missing(mark, env.world_size)
        if missing:
            raise TimeoutError(f"rank {env.rank} of {env.world_size}: {_ranks(missing)} never reached the check that "
                               f"every rank runs the same configuration (within --timeout-s {tc.timeout_s:g} s): "
                               f"still starting, stuck before it, or gone; nothing was trained") from e
        raise
    if all(torch.equal(d, every[0]) for d in every):
        return
    raise ValueError(disagreement(gather_json(mine, device=env.device)))


def disagreement(per_rank):
    """The sentence for every rank's items (a list, in rank order): each differing flag with its
    values and the ranks that hold each."""
    names = list(dict.fromkeys(k for mine in per_rank for k in mine))
    parts = []
    for name in names:
        held = {}  # compared value -> (shown, [ranks])
        for r, mine in enumerate(per_rank):
            compared, shown = mine.get(name, [None, "nothing (the flag does not exist in its program)"])
            held.setdefault(compared, (shown, []))[1].append(r)
        if len(held) > 1:
            parts.append(f"{name} ({'; '.join(f'{_ranks(ranks)}: {shown}' for shown, ranks in held.values())})")
    more = f", and {len(parts) - SHOWN} more" if len(parts) > SHOWN else ""
    return (f"the ranks were started with different configurations, and every rank must run the same one: they differ "
            f"in {', '.join(parts[:SHOWN])}{more}; give every node the same command (and the same data); nothing was "
            f"trained or written")


def _ranks(ranks):
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    runs, ranks = [], sorted(ranks)
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _arrive(env):
    """Leave this rank's mark in the default group's own store (the local launcher's, or torchrun's
    rendezvous store: already connected, so it costs one message; a new client of the launcher's
    store can take seconds to connect), so that a rank waiting for one that never comes can name
    it. Returns (store, key prefix), or None where there is no store to reach."""
    try:
        store = getattr(dist.distributed_c10d, "_get_default_store", side_channel)()
        if store is None:
            return None
        run, attempt = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"agreement/{run}/{attempt}/"
        store.set(prefix + str(env.rank), "here")
        return store, prefix
    except (RuntimeError, OSError, ValueError):  # no store reachable: the timeout alone then
        return None


def _missing(mark, world):
    if mark is None:
        return []
    store, prefix = mark
    try:
        return [r for r in range(world) if not store.check([prefix + str(r)])]
    except (RuntimeError, OSError):
        return []
