"""Checkpoints: sharded, atomic, bit-identical on resume, and loadable in any other layout.

    save_checkpoint(run, step, root, keep)   every rank writes its own shard, then rank 0 writes the
                                             manifest and one rename makes step_N visible
    latest_checkpoint(root)                  the newest complete step under root (or root itself)
    read_checkpoint(path)                    (manifest, full weights, full optimizer state), whatever
                                             layout wrote it: every tensor joined from its shards
    load_checkpoint(run, path)               into a running trainer: same layout, the shards as they
                                             are (random streams too); another, split anew

A crash during a save leaves the previous checkpoint intact (the partial step_N.tmp is skipped on
resume). The data position and the LR schedule follow from the step, so they need no state of
their own. `run` is 05's Run: its chunks, its ZeRO-aware optimizer pieces (04) and its groups.
"""
import dataclasses
import importlib
import json
import os
import re
import time

import torch
import torch.distributed as dist

from plumbing.tokenizer import tokenizer_of

tensor_parallel = importlib.import_module("01_tensor_parallel")

CKPT = re.compile(r"step_(\d+)$")
KEPT_FIELDS = ("batch_size", "seq_len")  # a resumed run must cut the data exactly as before


def save_checkpoint(run, step, root, keep, say=print):
    """Write step `step` (the number of steps done) under root/step_<step>; keep the newest `keep`.
    Rank 0 says where, how many bytes and how long it took."""
    t0 = time.perf_counter()
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    owner = {id(p): (c, n) for c, chunk in enumerate(run.chunks) for n, p in chunk.named_parameters()}
    # Replicas hold the same weights and, without ZeRO-1, the same optimizer state: one copy does.
    first_replica = dist.get_rank(run.groups.dp) == 0
    pieces = []
    for piece in run.opt.pieces if run.tc.zero1 or first_replica else []:
        c, name = owner[id(piece.param)]
        start = piece.weights.storage_offset() - run.ddp.offsets[piece.param]
        state = {k: v.cpu() for k, v in run.opt.optimizer.state.get(piece.master, {}).items()}
        if piece.master is not piece.weights:
            state["master"] = piece.master.detach().cpu()
        pieces.append((c, name, start, start + piece.weights.numel(), state))
    shard = dict(
        coords={k: dist.get_rank(getattr(run.groups, k)) for k in ("tp", "dp", "pp")},
        chunks=[{n: p.detach().cpu() for n, p in c.named_parameters()} for c in run.chunks] if first_replica else [],
        pieces=pieces,
        rng=dict(cpu=torch.get_rng_state(), tracked=[c.rng.state.cpu() for c in run.chunks],
                 cuda=torch.cuda.get_rng_state(run.env.device) if run.env.device.type == "cuda" else None))
    torch.save(shard, os.path.join(tmp, f"rank_{run.env.rank:05d}.pt"))
    dist.barrier()  # every shard is on disk before the step becomes visible
    if run.env.rank == 0:
        tc = run.tc
        manifest = dict(step=step, model=dataclasses.asdict(run.cfg), world=run.env.world_size,
                        layout=dict(tp=tc.tp, pp=tc.pp, dp=tc.dp, v=tc.virtual_stages, zero1=tc.zero1),
                        train={k: getattr(tc, k) for k in KEPT_FIELDS}, dtype=str(run.dtype),
                        tokenizer=tokenizer_of(tc.data))
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(tmp, final)  # atomic: a crash before this line leaves the previous step intact
        size = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
        say(f"saved step {step} to {final}: {size / 1e6:,.2f} MB in {time.perf_counter() - t0:.2f} s")
        for old in sorted(d for d in os.listdir(root) if CKPT.match(d))[:-keep]:
            for name in os.listdir(os.path.join(root, old)):
                os.remove(os.path.join(root, old, name))
            os.rmdir(os.path.join(root, old))
    dist.barrier()


def latest_checkpoint(root, say=print):
    """The newest complete checkpoint under root (a step_N directory, or root itself), or None.
    Interrupted saves (.tmp) are skipped with a message."""
    if os.path.exists(os.path.join(root, "manifest.json")):
        return root
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        if name.endswith(".tmp"):
            say(f"ignoring {os.path.join(root, name)}: an interrupted save, never completed")
    steps = sorted(d for d in os.listdir(root) if CKPT.match(d))
    complete = [d for d in steps if os.path.exists(os.path.join(root, d, "manifest.json"))]
    for d in set(steps) - set(complete):
        say(f"ignoring {os.path.join(root, d)}: it has no manifest.json")
    return os.path.join(root, complete[-1]) if complete else None


def read_checkpoint(path, cfg=None, tc=None):
    """(manifest, full parameters, full optimizer state per parameter name) from any layout. With
    cfg and tc, refuses a checkpoint of another model or another batch, naming what differs."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a checkpoint: no readable manifest.json ({e})") from None
    if cfg is not None:
        diff = [f"{k}={v} (this run {getattr(cfg, k)})" for k, v in manifest["model"].items()
                if getattr(cfg, k) != v]
        diff += [f"{k}={v} (this run {getattr(tc, k)})" for k, v in manifest["train"].items()
                 if getattr(tc, k) != v]
        if diff:
            raise ValueError(f"the checkpoint {path} was written with " + ", ".join(diff))
    lay = manifest["layout"]
    meta = dict(tensor_parallel.GPT(tensor_parallel.GPTConfig(**manifest["model"]), device="meta").named_parameters())
    params, states = {}, {}  # name -> {tp rank: shard}; name -> {tp rank: {key: flat shard}}
    for r in range(manifest["world"]):
        file = os.path.join(path, f"rank_{r:05d}.pt")
        try:
            shard = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated zip, a missing file, garbage: all the same to us
            raise ValueError(f"checkpoint shard {file} is missing, truncated or corrupt: {e}") from None
        t = shard["coords"]["tp"]
        for chunk in shard["chunks"]:
            for name, value in chunk.items():
                params.setdefault(name, {})[t] = value
        for c, name, start, end, state in shard["pieces"]:
            # Shaped like the parameter's shard on this tp rank, which replica 0 (a lower rank,
            # read earlier) wrote even when this file is a ZeRO-1 replica's without weights.
            local = params[name][t]
            flat = states.setdefault(name, {}).setdefault(t, {})
            for key, value in state.items():
                if value.dim() == 0:  # the step counter
                    flat[key] = value
                    continue
                flat.setdefault(key, torch.zeros(local.numel(), dtype=value.dtype))[start:end] = value
    full = {n: tensor_parallel.join_shards([shards[t] for t in range(lay["tp"])], meta[n]) for n, shards in params.items()}
    full_state = {}
    for name, by_rank in states.items():
        shape = params[name][0].shape
        keys = by_rank[0].keys()
        full_state[name] = {k: by_rank[0][k] if by_rank[0][k].dim() == 0 else tensor_parallel.join_shards(
            [by_rank[t][k].view(shape) for t in range(lay["tp"])], meta[name]) for k in keys}
    return manifest, full, full_state


def load_checkpoint(run, path, say=print):
    """Load path into this run, whatever layout wrote it; returns the number of steps done."""
    manifest, full, full_state = read_checkpoint(path, run.cfg, run.tc)
    for c in run.chunks:
        c.load_full_state_dict(full)
    tp_n, tp_r = dist.get_world_size(run.groups.tp), dist.get_rank(run.groups.tp)
    owner = {id(p): n for chunk in run.chunks for n, p in chunk.named_parameters()}
    for piece in run.opt.pieces:
        state = full_state.get(owner[id(piece.param)])
        if not state:
            continue  # saved before the first optimizer step
        start, n = piece.weights.storage_offset() - run.ddp.offsets[piece.param], piece.weights.numel()
        mine = {k: v if v.dim() == 0 else tensor_parallel.split_full(v, piece.param, tp_n, tp_r).reshape(-1)[start:start + n]
                for k, v in state.items()}
        if "master" in mine:
            piece.master.data.copy_(mine.pop("master"))
        elif piece.master is not piece.weights:  # bf16 now, not before: the master starts from the weights
            piece.master.data.copy_(piece.weights.float())
        dev = piece.master.device
        run.opt.optimizer.state[piece.master] = {k: v.to(dev if v.dim() else "cpu").clone() for k, v in mine.items()}
    lay, here = manifest["layout"], dict(tp=run.tc.tp, pp=run.tc.pp, dp=run.tc.dp, v=run.tc.virtual_stages,
                                          zero1=run.tc.zero1)
    if lay == here and manifest["world"] == run.env.world_size:
        shard = torch.load(os.path.join(path, f"rank_{run.env.rank:05d}.pt"), map_location="cpu", weights_only=True)
        torch.set_rng_state(shard["rng"]["cpu"])
        for c, state in zip(run.chunks, shard["rng"]["tracked"]):
            c.rng.state = state.to(c.rng.state.device)
        if shard["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(shard["rng"]["cuda"], run.env.device)
    else:  # another layout: random streams cannot be mapped, so they restart from (seed, step)
        pp_rank = dist.get_rank(run.groups.pp)
        torch.manual_seed(run.tc.seed + 100 * pp_rank + 7919 * manifest["step"])
        say(f"resharded {path} from {lay} to {here}; dropout streams reseeded from the step")
    return manifest["step"]
