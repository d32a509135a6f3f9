"""What a checkpoint's checksums cost a blocking save (issue 48): the same 05 run with the sha256 of
each shard computed as it is written (what the trainer does) and without (the hash replaced by a
pass-through; everything else the same, the digests' all-gather included), runs alternated, each
save's pause as the trainer prints it ("saved step N to DIR: M MB in T s": the finiteness agreement,
every shard written and fsynced, the manifest, the rename).

Run it (from the repository root; CPU, it starts its own ranks):
    python benchmarks/bench_checksum.py                   # 3 runs of each, alternated
    python benchmarks/bench_checksum.py --runs 5 -- --steps 30 --n-embd 384   # other flags for 05
"""
import argparse
import hashlib
import os
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVED = re.compile(r"saved step (\d+) to \S+: ([\d,.]+) MB in ([\d.]+) s")
PAUSE = re.compile(r"bench-pause (\d+) ([\d.]+)")
RUN = ["--steps", "8", "--eval-every", "0", "--n-layer", "8", "--n-embd", "256", "--save-every", "2", "--keep", "5"]


class _Unhashed:
    """The file as the trainer's _Hashed wraps it, without the hash: the digest is of nothing."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data):
        return self.f.write(data)

    def digest_during(self, wait):
        wait()
        return self.sha.hexdigest()

    def flush(self):
        self.f.flush()

    def __getattr__(self, name):
        return getattr(self.f, name)


def child(variant, args):
    """One 05 run in this process, its checksums on or off."""
    sys.path.insert(0, ROOT)
    os.chdir(ROOT)
    import time
    from plumbing import checkpoint
    if variant == "off":
        checkpoint._Hashed = _Unhashed
    blocking = checkpoint.Saver.save  # timed here: the trainer prints its pause to 10 ms only

    def timed(self, run, step, say=print):
        t0 = time.perf_counter()
        blocking(self, run, step, say)
        if run.env.rank == 0:
            print(f"bench-pause {step} {time.perf_counter() - t0:.6f}", flush=True)
    checkpoint.Saver.save = timed
    sys.argv = [os.path.join(ROOT, "05_3d_gpt.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs of each variant, alternated")
    p.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    p.add_argument("rest", nargs="*", help="flags for 05_3d_gpt.py (after --)")
    a = p.parse_args()
    if a.child:
        return child(a.child, a.rest)
    pauses, size = {"on": [], "off": []}, None
    for i in range(a.runs):
        for variant in (("on", "off") if i % 2 == 0 else ("off", "on")):
            folder = tempfile.mkdtemp(prefix="bench-checksum-")
            try:
                out = subprocess.run([sys.executable, __file__, "--child", variant, "--", *RUN, *a.rest, "--save",
                                      folder], capture_output=True, text=True, check=True).stdout
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            found, said = [float(t) for _, t in PAUSE.findall(out)], SAVED.findall(out)
            pauses[variant] += found
            size = said[-1][1] if said else size
            print(f"run {i + 1} {variant}: pauses {[round(t, 4) for t in found]}", flush=True)
    on, off = statistics.median(pauses["on"]), statistics.median(pauses["off"])
    print(f"checkpoint {size} MB; a blocking save's pause, median of {len(pauses['on'])}: with checksums {on:.3f} s "
          f"(min {min(pauses['on']):.3f}, max {max(pauses['on']):.3f}), without {off:.3f} s (min "
          f"{min(pauses['off']):.3f}, max {max(pauses['off']):.3f}); the checksums' share {(on - off) / off:+.1%}")


if __name__ == "__main__":
    main()
