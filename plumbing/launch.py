"""Launching: one code path from 1 CPU process to a GPU cluster.

    launch(worker, n, *args)   under torchrun: join its group (NCCL on GPU LOCAL_RANK, else gloo)
                               and run worker(env, *args) as this one rank; otherwise fork n CPU
                               ranks here (gloo, one thread each) and return every rank's result
    run_main(main)             a script's exit code: 0 if main() returned True, 1 (and the message)
                               on a RankFailure or a ValueError, so bad input never ends in a trace
    new_tp_group(env, tp)      this rank's block of tp consecutive ranks, as a process group
    printer(env)               print on rank 0 only
    gather_numbers(values)     every rank's list of numbers, by tensor collectives (no pickling)
    gather_json(obj)           every rank's JSON-able object, as UTF-8 bytes in a tensor

Nothing hangs: every collective has a timeout, and when a local rank raises or dies the others are
stopped at once and RankFailure carries that rank's traceback. Under torchrun the elastic agent
does the stopping.
"""
import ctypes
import json
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection, get_context

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


class RankFailure(RuntimeError):
    """Raised in the launching process when a rank raised, died or missed the deadline."""


def launch(worker, nprocs, *args, timeout_s=60.0, deadline_s=None):
    """Run worker(env, *args) on every rank and return the ranks' results, in rank order.

    Under torchrun (RANK and WORLD_SIZE set) this process is one rank: it joins the launcher's group
    (NCCL on its LOCAL_RANK GPU if CUDA is available, else gloo) and returns [its own result].
    Otherwise nprocs CPU ranks are fork-started here with gloo and one thread each. timeout_s bounds
    every collective; deadline_s, if given, bounds the whole run. If a rank raises or dies, the
    others are stopped and RankFailure carries the rank's traceback.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        env = _join_launcher_group(timeout_s)
        try:
            return [worker(env, *args)]
        finally:
            dist.destroy_process_group()
    return _launch_local(worker, nprocs, args, timeout_s, deadline_s)


def _join_launcher_group(timeout_s):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    # env:// reads MASTER_ADDR and MASTER_PORT from the launcher.
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return RankEnv(rank, world, local_rank, device)


def _launch_local(worker, nprocs, args, timeout_s, deadline_s):
    ctx = get_context("fork")  # fork: no re-import, closures work, start-up in milliseconds
    procs, pipes = [], []
    for rank in range(nprocs):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=_local_rank_main, name=f"rank{rank}", daemon=True,
                        args=(rank, nprocs, theirs, worker, args, timeout_s))
        p.start()
        theirs.close()  # only the child holds its end, so ours reads EOF if the child dies
        procs.append(p)
        pipes.append(ours)
    # The rendezvous store is made after the forks (its server thread must not be forked) on a
    # port the OS picks, so there is no free-port race; the children learn the port by pipe.
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    for pipe in pipes:
        pipe.send(store.port)
    results, failures = {}, {}
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        while len(results) + len(failures) < nprocs:
            if failures:  # give the other ranks a moment to report their own error, then stop them
                wait_s = 1.0
            else:
                wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            waiting = [pipes[r] for r in range(nprocs) if r not in results and r not in failures]
            ready = connection.wait(waiting, timeout=wait_s)
            if not ready:
                if not failures:
                    failures["the run"] = f"passed its deadline of {deadline_s} s\n"
                break
            for pipe in ready:
                rank = pipes.index(pipe)
                try:
                    status, payload = pickle.loads(pipe.recv_bytes())
                except EOFError:
                    procs[rank].join(5)
                    status, payload = "error", f"rank {rank} died with exit code {procs[rank].exitcode}\n"
                (results if status == "ok" else failures)[rank] = payload
    finally:
        stopped = [r for r, p in enumerate(procs) if p.is_alive() and r not in {**results, **failures}]
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if failures:
        first = next(iter(failures))  # the earliest report: the others may be its consequences
        who = lambda r: r if isinstance(r, str) else f"rank {r}"
        lines = [f"{who(first)} failed:\n{failures[first]}"]
        lines += [f"{who(r)} also failed: {failures[r].strip().splitlines()[-1]}"
                  for r in failures if r != first]
        if stopped:
            lines.append(f"stopped ranks {stopped} after the failure")
        raise RankFailure("\n".join(lines))
    return [results[r] for r in range(nprocs)]


def _local_rank_main(rank, world, pipe, worker, args, timeout_s):
    torch.set_num_threads(1)  # one thread per rank: ranks share the cores, as GPUs would not
    try:  # Linux: die with the launching process rather than linger until a timeout
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    code = 0
    try:
        store = dist.TCPStore("127.0.0.1", pipe.recv(), world, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        result = worker(RankEnv(rank, world, rank, torch.device("cpu")), *args)
        pipe.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:  # report everything, including SystemExit and KeyboardInterrupt
        code = 1
        pipe.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown in a forked child


def run_main(main):
    """Call main() and turn its result into the exit code: 0 if it returned True, else 1."""
    try:
        ok = main()
    except (RankFailure, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    sys.exit(0 if ok else 1)


def new_tp_group(env, tp, timeout_s=60.0):
    """Split the world into blocks of tp consecutive ranks (on a GPU node: inside its NVLink
    domain); return this rank's block as a group. env comes from launch()."""
    if tp < 1 or tp > env.world_size or env.world_size % tp:
        raise ValueError(f"tp={tp} must be between 1 and the world size {env.world_size} and divide it")
    groups = [dist.new_group(list(range(s, s + tp)), timeout=timedelta(seconds=timeout_s))
              for s in range(0, env.world_size, tp)]
    return groups[env.rank // tp]


def printer(env, quiet=False):
    """print on rank 0 (unless quiet), nothing elsewhere: a demo's report is written once."""
    return print if env.rank == 0 and not quiet else (lambda *a, **k: None)


def gather_rows(mine, group=None):
    """Every rank's 1-D tensor (lengths may differ), in rank order, on every rank: the lengths
    first, then the tensors padded to the longest. Plain tensor collectives, not
    all_gather_object: that pickles through numpy (which the CPU wheel of torch does not install)
    and under NCCL needs a device of its own."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=mine.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([mine.numel()], device=mine.device), group=group)
    padded = torch.cat([mine, mine.new_zeros(max(int(n) for n in sizes) - mine.numel())])
    rows = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(rows, padded, group=group)
    return [row[: int(n)] for row, n in zip(rows, sizes)]


def gather_numbers(values, group=None, device="cpu"):
    """Every rank's list of numbers, as float64: exact for any count below 2**53, and for
    perf_counter() times to the nanosecond for days."""
    mine = torch.tensor([float(x) for x in values], dtype=torch.float64, device=device)
    return [row.tolist() for row in gather_rows(mine, group)]


def gather_json(obj, group=None, device="cpu"):
    """Every rank's JSON-able object, as UTF-8 bytes in a uint8 tensor (05's --trace gathers its
    timelines so)."""
    mine = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    return [json.loads(bytes(row.tolist())) for row in gather_rows(mine, group)]
