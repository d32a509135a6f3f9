#!/usr/bin/env python3
"""The GPU check: everything in this repository that only a GPU can confirm, in one command.

    python3 scripts/gpu_check.py --out DIR               # on one H100 or H200: about 7 minutes, cold build included
    python3 scripts/gpu_check.py --dry-run --out DIR     # anywhere: each command and what it must print; runs nothing
    python3 scripts/gpu_check.py --out DIR --only resume capture   # some items (the build always comes first)

It prints the environment (torch, CUDA, NCCL, the GPU, its compute capability, TORCH_CUDA_ARCH_LIST),
then a table with one row per thing checked, each printed as soon as its item ends: what must hold,
what was measured, PASS or FAIL (SKIP: not started, for lack of time). Every command's whole output
goes to a log under DIR, named in its row; DIR/table.md is the table, DIR/env.txt the environment.
The exit status is 0 only if every row passed.

The items run most important first, so that a run cut short still reports those: the cold build
(8 processes at once, as a node's ranks); then, at once, the correctness checks that need little
of the GPU (a checkpoint saved and resumed bit for bit, and on the CPU; graph capture at 4,096
token ids per microbatch; stage graphs at v = 4; a non-finite step skipped; a model beyond the
GPU's memory refused; a build without this GPU's architecture falling back); the kernel tests;
then the timings, each alone on the GPU (the fused kernels against the unfused ops and the copy
bandwidth, graphs against eager, tokens/s and MFU of a 350M GPT-2). Each item states its estimate;
the check starts no item once --budget-s is spent (an item not started is a SKIP row).
Checkpoints and the kernel builds go to a fresh temporary directory ($SCRATCH), named at the start.

docs/GPU_CHECKLIST.md is the dry run's plan, and the checks only a node of several GPUs can make.
On the device machine of this workplace, where only a few files of $OUT come back, add
`--archive $OUT/gpu_check.tar.gz`: every log in one file, rewritten after each item.
"""
import argparse
import dataclasses
import importlib
import importlib.util
import io
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUDGET_S = 470  # under 8 minutes, with room for the environment dump and the archive
BF16_RTOL = 2e-2  # bf16 losses of two runs of the same step: rounding apart (2^-8 each op), not O(1)
GOAL_SPEEDUP, GOAL_COPY, GOAL_GRAPHS, GOAL_MFU = 1.5, 0.70, 1.3, 0.45  # as benchmarks/bench_kernels.py
LARGE_IDS = 3072  # torch sorts the ids in the embedding's backward above this many (pytorch issue 82886)


# ----------------------------------------------------------------------------------------------
# The plan: items of commands, each with what it must print


@dataclasses.dataclass
class Command:
    name: str  # the log's name: DIR/<name>.log
    argv: list
    env: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Item:
    key: str  # for --only
    title: str
    estimate_s: int  # on one H100 or H200 with 16 cores, beside the rest of its group
    group: int  # the items of one group run at once; groups one after the other
    stages: list  # [[Command, ...], ...]: each stage's commands at once, the stages in turn
    expected: str
    judge: object  # judge(logs, plan) -> [Row]; logs: {name: Log}


@dataclasses.dataclass
class Row:
    name: str
    expected: str
    measured: str
    status: str  # PASS, FAIL or SKIP


@dataclasses.dataclass
class Log:
    returncode: int | None  # None: killed at its time limit, or never started
    text: str
    seconds: float


class Plan:
    """The items for an output directory, a scratch directory (checkpoints, the kernel builds) and
    this machine's Python and GPU (none: the dry run's stand-ins)."""

    def __init__(self, out, scratch, extensions, capability=None, xdist=True, cold=True):
        self.out, self.scratch, self.extensions = Path(out), Path(scratch), Path(extensions)
        self.capability = capability  # (major, minor), or None (the dry run: a Hopper's assumed)
        self.xdist = xdist  # pytest-xdist there (the GPU machine's image has it): the kernel tests on 8 workers
        self.cold = cold  # the extensions directory was empty: the build item's time is a cold build's
        self.items = items(self)

    def python(self):
        return [sys.executable]

    def trainer(self, *flags):
        """05 under torchrun on one GPU, at tp = pp = dp = 1."""
        return [*self.python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "05_3d_gpt.py", "--tp", "1", "--pp", "1", "--dp", "1", *flags]

    def metrics(self, name):
        return str(self.out / f"{name}.jsonl")

    def foreign_arch(self):
        """An arch list without this GPU's architecture: an A100's on a Hopper, else a Hopper's."""
        return "9.0" if self.capability and self.capability[0] < 9 else "8.0"


# The checklist's small model: 4 layers of C = 256, T = 256, m = 4 microbatches of b = 4.
SMALL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "256", "--block-size", "256", "--seq-len", "256",
         "--batch-size", "16", "--microbatches", "4", "--eval-every", "0"]
# b T = 4 x 1024 = 4,096 token ids per microbatch: above LARGE_IDS.
LARGE = ["--n-layer", "2", "--n-head", "4", "--n-embd", "256", "--block-size", "1024", "--seq-len", "1024",
         "--batch-size", "8", "--microbatches", "2", "--steps", "6", "--eval-every", "0"]
BUILD_RANKS = 8  # a node's ranks, each building at start (05's prebuild) into one cold directory
KERNEL_TESTS = ["tests/test_kernels.py",
                *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_kernel_*.py")),
                "tests/test_simt.py", "tests/test_graphs.py"]
BUILD = ('import time, kernels; t = time.perf_counter(); built = kernels.prebuild("cuda"); '
         'print("built and probed:", *built, "in", f"{time.perf_counter() - t:.1f}", "s")')
FOREIGN = ('import torch; from kernels import bias_gelu, build; '
           'bias_gelu.bias_gelu(torch.randn(4, 8, device="cuda"), torch.randn(8, device="cuda")); '
           'torch.cuda.synchronize(); print("paths:", build.report())')


def items(plan):
    p, scratch = plan, plan.scratch
    ckpt = scratch / "resume"
    bench = [*p.python(), "benchmarks/bench_kernels.py"]
    return [
        Item("build", "cold build of the four kernel families by 8 processes at once, as a node's ranks", 100, 0,
             [[Command(f"build_{r}", [*p.python(), "-c", BUILD]) for r in range(BUILD_RANKS)]],
             f"each of the {BUILD_RANKS} prints `built and probed: bias_gelu bias_dropout_add softmax layernorm in N s`: "
             "the four families build at once (kernels.prebuild), each once, under its lock beside the build "
             "directory while the other processes wait (item 8), then load it and pass its probe launch; the "
             "slowest N is the node's cold build time", judge_build),
        Item("resume", "05 saves on the GPU and resumes bit for bit (issue 35, item 1)", 45, 1,
             [[Command("resume_a", p.trainer(*SMALL, "--steps", "8", "--no-flash-attention", "--save", str(ckpt),
                                             "--save-every", "4", "--metrics", p.metrics("resume_a")),
                       {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})],
              [Command("resume_b", p.trainer(*SMALL, "--steps", "8", "--no-flash-attention", "--resume",
                                             str(ckpt / "step_00000004"), "--metrics", p.metrics("resume_b")),
                       {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
               Command("resume_cpu", [*p.python(), "05_3d_gpt.py", "--tp", "1", "--pp", "1", "--dp", "1", *SMALL,
                                      "--steps", "6", "--dtype", "float32", "--resume", str(ckpt / "step_00000004"),
                                      "--metrics", p.metrics("resume_cpu")])]],
             "the first run says `saved step 4` and `saved step 8` (before the fix: 'Expected all tensors to be on "
             "the same device' at the first save); the second says `resumed from .../step_00000004: 4 steps done`, and "
             "its loss and gradient norm at steps 4 to 7 equal the first run's bit for bit (flash attention off: "
             "its backward adds with atomics); beside it, the same checkpoint resumes on the CPU in float32 "
             "(`... from cuda to cpu; dropout streams, default and tracked, reseeded from the step`); the first run's "
             "end report has `memory    rank 0, measured peak (torch.cuda.max_memory_allocated): X MiB, estimated "
             "Y MiB`", judge_resume),
        Item("capture", f"graph capture above {LARGE_IDS:,} token ids per microbatch (item 4)", 40, 1,
             [[Command("capture_step", p.trainer(*LARGE, "--metrics", p.metrics("capture_step"))),
               Command("capture_stage", p.trainer(*LARGE, "--graph-scope", "stage",
                                                  "--metrics", p.metrics("capture_stage"))),
               Command("capture_eager", p.trainer(*LARGE, "--no-cuda-graphs", "--metrics", p.metrics("capture_eager")))]],
             "b T = 4,096 ids: the whole-step and the per-stage graph runs each train, either captured or after the "
             "one sentence `CUDA graphs: capturing ... failed on rank 0 (...)`; every step's loss within "
             f"{BF16_RTOL:g} of the eager run's", judge_capture),
        Item("stage-v4", "stage graphs at --virtual-stages 4 against eager (issue 24)", 35, 1,
             [[Command("stage_v4_graphs", p.trainer(*SMALL, "--steps", "10", "--virtual-stages", "4",
                                                    "--metrics", p.metrics("stage_v4_graphs"))),
               Command("stage_v4_eager", p.trainer(*SMALL, "--steps", "10", "--virtual-stages", "4",
                                                   "--no-cuda-graphs", "--metrics", p.metrics("stage_v4_eager")))]],
             "`CUDA graphs: per stage and microbatch` (4 chunks, several slots each); every step's loss within "
             f"{BF16_RTOL:g} of the eager run's; the measured peak memory of each (what the graphs' static "
             "buffers cost)", judge_stage_v4),
        Item("nonfinite", "a non-finite gradient skips its step on the GPU", 35, 1,
             [[Command("nonfinite", [*p.python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                     "1", "scripts/gpu_check.py", "--poison-steps", "3,4", "--", "--tp", "1", "--pp",
                                     "1", "--dp", "1", *SMALL, "--steps", "8", "--save", str(scratch / "nonfinite"),
                                     "--metrics", p.metrics("nonfinite")])]],
             "inf written into a gradient at steps 3 and 4 (after the graph's replay): `step 3 skipped: ... "
             "gradient norm inf (1 in a row)`, `step 4 skipped ... (2 in a row)`, every other step finite, "
             "`saved step 8`, and every tensor of that checkpoint finite", judge_nonfinite),
        Item("memory", "a model beyond the GPU's memory is refused before training", 20, 1,
             [[Command("memory", p.trainer("--n-layer", "96", "--n-embd", "12288", "--n-head", "96"))]],
             "exit 1 before any collective, naming the GPU's memory: `... more than the GPU's N GiB; use more tp x "
             "pp or a smaller model`", judge_memory),
        Item("foreign-arch", "a build without this GPU's architecture falls back (item 5)", 75, 1,
             [[Command("foreign_arch", [*p.python(), "-W", "always", "-c", FOREIGN],
                       {"TORCH_CUDA_ARCH_LIST": p.foreign_arch()})]],
             f"TORCH_CUDA_ARCH_LIST={p.foreign_arch()} (an arch this GPU is not): bias_gelu builds, its probe launch "
             "fails, and the warning `kernels: bias_gelu.cu was built, but its kernels cannot run on this GPU "
             "(...): ... no kernel image is available for execution on the device. ...; using the PyTorch "
             "reference`; then `paths: {'bias_gelu': 'reference'}`", judge_foreign_arch),
        Item("kernel-tests", "the kernel and graph tests on the GPU", 100, 2,
             [[Command("kernel_tests", [*p.python(), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                        *KERNEL_TESTS, *(["-n", "8"] if p.xdist else [])])]],
             "every test passes, none skipped for want of a GPU (the layernorm rows up to this GPU's longest, "
             "20480 and 25600 among them; the kernels' graph replays; 05 with graphs and kernels against "
             "eager and the references; each kernel's GPU output against its CPU execution, tests/test_simt.py)", judge_kernel_tests),
        Item("bench-kernels", "fused kernels against the unfused ops, B=8 T=1024 C=1024", 40, 3,
             [[Command("bench_kernels", [*bench, "--only", "kernels", "--shape", "8", "1024", "1024", "16"])]],
             f"each family, forward and backward: >= {GOAL_SPEEDUP}x the unfused PyTorch and >= {GOAL_COPY:.0%} of "
             "the device-to-device copy bandwidth measured in the same run", judge_bench_kernels),
        Item("graphs-speed", "CUDA graphs against eager on a launch-bound step", 25, 4,
             [[Command("bench_graphs", [*bench, "--only", "graphs"])]],
             f"one step of a 4-layer C=256 GPT (B=4, T=128, bf16), eager against its graph: >= {GOAL_GRAPHS}x, with "
             "the PyTorch ops and with the fused kernels", judge_graphs_speed),
        Item("mfu", "tokens/s and MFU of a 350M GPT-2 at T=1024, bf16, tp = pp = dp = 1", 90, 5,
             [[Command("bench_mfu", [*bench, "--only", "e2e", "--e2e-models", "350M", "--e2e-seq", "1024",
                                     "--e2e-batch", "8", "--e2e-steps", "15", "--e2e-skip", "3",
                                     "--e2e-timeout", "150"])]],
             "05 with kernels and graphs on (its one microbatch holds 8,192 ids: the row says if the capture fell "
             "back), then off: tokens/s of each, and MFU = Narayanan eq. 3 FLOPs per "
             f"iteration (planner.flops_per_iteration) / (step time x 989 TFLOP/s); goal >= {GOAL_MFU:.0%} with "
             "kernels and graphs", judge_mfu),
    ]


# ----------------------------------------------------------------------------------------------
# Judges: what each item's logs say, against what must hold. Each reads only its logs (and the
# files its commands wrote), so tests can feed them canned ones.


def tail(log, lines=1):
    """The last non-empty lines of a log that failed, for the measured column."""
    if log is None:
        return "never ran"
    if log.returncode is None:
        return f"stopped at its time limit after {log.seconds:.0f} s"
    kept = [re.sub(r"^\[rank\d+\]:\s*", "", x).strip() for x in log.text.splitlines()]
    kept = [x for x in kept if x and not x.startswith(("File ", "^", "~", "=", "-"))]
    # The error itself, not torchrun's report of its child's exit that follows it
    errors = [x for x in kept if re.search(r"(Error|Exception|error:)", x) and "ChildFailedError" not in x]
    return f"exit {log.returncode}: " + " / ".join((errors or kept)[-lines:])[:300]


def ok(log):
    return log is not None and log.returncode == 0


def losses(path):
    """{step: record} of a --metrics file ({} if absent)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return {}
    return {r["step"]: r for r in map(json.loads, lines)}


def rel_diff(a, b):
    """max |a - b| / max |b| over two runs' losses, step by step (inf if either is missing a step)."""
    if not b or set(a) != set(b):
        return math.inf
    return max(abs(a[s]["loss"] - b[s]["loss"]) for s in b) / max(abs(b[s]["loss"]) for s in b)


def judge_build(logs, plan):
    times = []
    for r in range(BUILD_RANKS):
        log = logs.get(f"build_{r}")
        found = re.search(r"built and probed: (.*) in ([\d.]+) s", log.text) if ok(log) else None
        if not found or len(found[1].split()) != 4:
            return [Row("cold build", "", f"process {r}: " + (tail(log, 2) if not ok(log) else
                                                               f"built {found[1] if found else 'nothing'}"), "FAIL")]
        times.append(float(found[2]))
    waited = sum(len(re.findall(r"kernels: waiting for another process's build", logs[f"build_{r}"].text))
                 for r in range(BUILD_RANKS))
    warm = "" if plan.cold else " (warm: the extensions directory held builds already)"
    return [Row("cold build", "", f"{max(times):.1f} s, the slowest of {BUILD_RANKS} processes (the fastest "
                                  f"{min(times):.1f} s); {waited} waits for another's build{warm}", "PASS")]


def judge_resume(logs, plan):
    a, b = logs.get("resume_a"), logs.get("resume_b")
    if not ok(a) or "saved step 4" not in a.text or "saved step 8" not in a.text:
        return [Row("save on the GPU", "", tail(a, 2), "FAIL")]
    if not ok(b) or not re.search(r"resumed from \S+: 4 steps done", b.text):
        return [Row("save on the GPU", "", "saved steps 4 and 8", "PASS"),
                Row("resume bit for bit", "", tail(b, 2), "FAIL")]
    first, second = losses(plan.metrics("resume_a")), losses(plan.metrics("resume_b"))
    steps = sorted(second)
    differ = [s for s in steps if s not in first or (first[s]["loss"], first[s]["grad_norm"]) !=
              (second[s]["loss"], second[s]["grad_norm"])]
    if steps != [4, 5, 6, 7] or differ:
        s = (differ or steps or [None])[0]
        what = (f"steps {steps} resumed" if steps != [4, 5, 6, 7] else
                f"step {s}: loss {second[s]['loss']!r} against {first[s]['loss']!r}, gradient norm "
                f"{second[s]['grad_norm']!r} against {first[s]['grad_norm']!r}")
        return [Row("save on the GPU", "", "saved steps 4 and 8", "PASS"), Row("resume bit for bit", "", what, "FAIL")]
    return [Row("save on the GPU", "", "saved steps 4 and 8", "PASS"),
            Row("resume bit for bit", "", "steps 4-7: loss and gradient norm equal bit for bit", "PASS"),
            judge_resume_on_cpu(logs.get("resume_cpu")), judge_memory_report(a)]


def judge_resume_on_cpu(log):
    said = ok(log) and re.search(r"resharded \S+ from cuda to cpu; dropout streams, default and tracked, reseeded "
                                 r"from the step", log.text) and re.search(r"resumed from \S+: 4 steps done", log.text)
    measured = "resharded from cuda to cpu, streams reseeded, trained on" if said else \
        tail(log, 2) if not ok(log) else "no 'from cuda to cpu ... reseeded' line"
    return Row("the GPU's checkpoint resumes on the CPU", "", measured, "PASS" if said else "FAIL")


PEAK = re.compile(r"memory    rank 0, measured peak \(torch.cuda.max_memory_allocated\): ([\d,.]+) MiB, estimated "
                  r"([\d,.]+) MiB")


def judge_memory_report(log):
    found = PEAK.search(log.text) if log else None
    return Row("the end report's measured peak memory", "", f"measured {found[1]} MiB, estimated {found[2]} MiB"
               if found else "no 'measured peak' line", "PASS" if found else "FAIL")


def judge_memory(logs, plan):
    log = logs.get("memory")
    found = re.search(r"more than the GPU's ([\d.]+) GiB; use more tp x pp or a smaller model", log.text) if log else None
    trained = log is not None and re.search(r"^model ", log.text, re.M)
    good = log is not None and log.returncode not in (0, None) and found and not trained
    return [Row("memory refusal", "", f"refused: more than the GPU's {found[1]} GiB" if found else tail(log, 2),
                "PASS" if good else "FAIL")]


FELL_BACK = re.compile(r"CUDA graphs: capturing (the whole step|the stage's chunks) failed on rank 0 \((.*)\); this rank")


def judge_capture(logs, plan):
    eager = losses(plan.metrics("capture_eager"))
    if not ok(logs.get("capture_eager")) or not eager:
        return [Row("capture, eager reference", "", tail(logs.get("capture_eager")), "FAIL")]
    rows = []
    for name, scope in (("capture_step", "whole step"), ("capture_stage", "per stage and microbatch")):
        log, label = logs.get(name), f"capture, {scope}"
        if not ok(log):
            rows.append(Row(label, "", tail(log, 2), "FAIL"))
            continue
        fell = FELL_BACK.search(log.text)
        said = f"CUDA graphs: {scope}" in log.text
        diff = rel_diff(losses(plan.metrics(name)), eager)
        how = f"fell back: {fell[2]}" if fell else "captured and replayed" if said else \
            f"no graphs: the summary did not say 'CUDA graphs: {scope}'"
        good = said and diff <= BF16_RTOL
        rows.append(Row(label, "", f"{how}; losses within {diff:.1e} of eager", "PASS" if good else "FAIL"))
    return rows


def judge_stage_v4(logs, plan):
    graphed, eager = logs.get("stage_v4_graphs"), logs.get("stage_v4_eager")
    if not ok(graphed) or not ok(eager):
        return [Row("stage graphs, v = 4", "", tail(graphed if not ok(graphed) else eager, 2), "FAIL")]
    said = "CUDA graphs: per stage and microbatch" in graphed.text
    diff = rel_diff(losses(plan.metrics("stage_v4_graphs")), losses(plan.metrics("stage_v4_eager")))
    fell = FELL_BACK.search(graphed.text)
    peaks = [PEAK.search(log.text) for log in (graphed, eager)]
    memory = f"; peak {peaks[0][1]} MiB with graphs, {peaks[1][1]} MiB without" if all(peaks) else ""
    measured = f"losses within {diff:.1e} of eager" + (f"; fell back: {fell[2]}" if fell else "") + \
        ("" if said else "; the summary did not say 'CUDA graphs: per stage and microbatch'") + memory
    return [Row("stage graphs, v = 4", "", measured, "PASS" if said and diff <= BF16_RTOL and not fell else "FAIL")]


def judge_nonfinite(logs, plan):
    log = logs.get("nonfinite")
    if not ok(log):
        return [Row("non-finite step skipped", "", tail(log, 2), "FAIL")]
    said = [re.search(rf"step {s} skipped: loss \S+, gradient norm (inf|nan) \({n} in a row\)", log.text)
            for s, n in ((3, 1), (4, 2))]
    records = losses(plan.metrics("nonfinite"))
    skipped = sorted(s for s, r in records.items() if r.get("skipped"))
    finite = all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
                 for s, r in records.items() if s not in (3, 4))
    bad = checkpoint_not_finite(plan.scratch / "nonfinite")
    good = all(said) and skipped == [3, 4] and finite and "saved step 8" in log.text and bad == []
    measured = (f"skipped {skipped}; other steps {'finite' if finite else 'NOT finite'}; saved step 8: "
                f"{'yes' if 'saved step 8' in log.text else 'no'}; checkpoint "
                f"{'finite' if bad == [] else f'not finite or unreadable: {bad}'}")
    return [Row("non-finite step skipped", "", measured, "PASS" if good else "FAIL")]


def checkpoint_not_finite(root):
    """The names of the newest checkpoint's non-finite tensors ([] if all are finite), or a sentence."""
    sys.path.insert(0, str(ROOT))
    try:
        import torch
        from plumbing import checkpoint

        _, full, state = checkpoint.read_checkpoint(checkpoint.latest_checkpoint(str(root)))
        tensors = {**full, **{f"{n}.{k}": v for n, s in state.items() for k, v in s.items()}}
        return [n for n, t in tensors.items()
                if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()]
    except Exception as e:  # noqa: BLE001 (said in the row)
        return [f"{type(e).__name__}: {e}"]


def judge_foreign_arch(logs, plan):
    log = logs.get("foreign_arch")
    said = re.search(r"kernels: bias_gelu\.cu was built, but its kernels cannot run on this GPU \(.*\): (.*?)\. The "
                     r"build targeted .*; using the PyTorch reference", log.text) if log else None
    reference = ok(log) and "paths: {'bias_gelu': 'reference'}" in log.text
    if said and reference:
        return [Row("foreign arch falls back", "", f"said: {said[1]}; ran the reference", "PASS")]
    return [Row("foreign arch falls back", "", tail(log, 2) if not ok(log) else
                "no fallback sentence" if not said else "the kernel path was taken", "FAIL")]


def judge_kernel_tests(logs, plan):
    log = logs.get("kernel_tests")
    summary = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s", log.text, re.M) if log else []
    no_gpu = len(re.findall(r"needs a CUDA GPU", log.text)) if log else 0
    if not ok(log) or not summary or no_gpu:
        why = f"{no_gpu} skipped for want of a GPU; " if no_gpu else ""
        return [Row("kernel and graph tests", "", why + (summary[-1][0] if summary else tail(log, 2)), "FAIL")]
    return [Row("kernel and graph tests", "", f"{summary[-1][0]} in {float(summary[-1][1]):.0f} s", "PASS")]


BENCH_ROW = re.compile(r"^(\w+)\s+\(.*?\)\s+(f32|bf16)\s+(fwd|bwd)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+(\d+)\s+(\d+)%")
BENCH_FAIL = re.compile(r"^(\w+)\s+\(.*?\)\s+(f32|bf16)\s+FAIL: (.*)$")


def judge_bench_kernels(logs, plan):
    log = logs.get("bench_kernels")
    text = log.text if log else ""
    copy = re.search(r"copy bandwidth: .*: ([\d,]+) GB/s", text)
    rows = []
    for dtype, label in (("bf16", "bf16"), ("f32", "fp32")):
        name = f"kernels vs unfused, {label}"
        got = [m for m in (BENCH_ROW.match(x) for x in text.splitlines()) if m and m[2] == dtype]
        broken = [m for m in (BENCH_FAIL.match(x) for x in text.splitlines()) if m and m[2] == dtype]
        if not ok(log) or not copy or broken or len(got) != 8:
            why = f"{broken[0][1]}: {broken[0][3]}" if broken else tail(log, 2) if not ok(log) else \
                f"{len(got)} of 8 rows in the log"
            rows.append(Row(name, "", why, "FAIL"))
            continue
        speed = min(got, key=lambda m: float(m[6]))
        share = min(got, key=lambda m: int(m[8]))
        meet = sum(float(m[6]) >= GOAL_SPEEDUP and int(m[8]) >= GOAL_COPY * 100 for m in got)
        rows.append(Row(name, "", f"copy {copy[1]} GB/s; {meet} of 8 meet both; slowest {float(speed[6]):.2f}x "
                                  f"({speed[1]} {speed[3]}), least {share[8]}% of copy ({share[1]} {share[3]})",
                        "PASS" if meet == 8 else "FAIL"))
    return rows


GRAPH_ROW = re.compile(r"^(pytorch|fused)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+\S+\s*$")


def judge_graphs_speed(logs, plan):
    log = logs.get("bench_graphs")
    rows = []
    for ops in ("pytorch", "fused"):
        lines = (log.text if log else "").splitlines()
        found = [m for m in map(GRAPH_ROW.match, lines) if m and m[1] == ops]
        if not ok(log) or not found:
            broken = [x.split("FAIL: ", 1)[1] for x in lines if x.startswith(ops) and "FAIL: " in x]
            rows.append(Row(f"graphs vs eager, {ops} ops", "", broken[0] if broken else tail(log, 2) if not ok(log)
                            else "no row", "FAIL"))
            continue
        m = found[0]
        rows.append(Row(f"graphs vs eager, {ops} ops", "", f"{m[2]} ms eager, {m[3]} ms graph: {m[4]}x",
                        "PASS" if float(m[4]) >= GOAL_GRAPHS else "FAIL"))
    return rows


MFU_ROW = re.compile(r"^\s*350M (fused\+graphs|unfused), ([\d,]+) parameters, B=(\d+) T=(\d+): .*median ([\d.]+) ms.*; "
                     r"([\d,]+) tokens/s; MFU ([\d.]+%|n/a)")


def judge_mfu(logs, plan):
    log = logs.get("bench_mfu")
    found = {m[1]: m for m in (MFU_ROW.match(x) for x in (log.text if log else "").splitlines()) if m}
    rows = []
    for variant, label, goal in (("fused+graphs", "350M, kernels and graphs on", True),
                                 ("unfused", "350M, kernels and graphs off", False)):
        m = found.get(variant)
        if not m:
            rows.append(Row(label, "", tail(log, 2) if not ok(log) else "no row", "FAIL"))
            continue
        mfu = float(m[7][:-1]) / 100 if m[7] != "n/a" else None
        fell = FELL_BACK.search(log.text) if goal else None  # B T = 8,192 ids in its one microbatch
        measured = f"{m[6]} tokens/s, {m[5]} ms a step, MFU {m[7]} ({m[2]} parameters)" + \
            (f"; the graph's capture fell back to eager: {fell[2]}" if fell else "")
        passed = mfu is not None and (mfu >= GOAL_MFU or not goal)
        rows.append(Row(label, "", measured, "PASS" if passed else "FAIL"))
    return rows


# ----------------------------------------------------------------------------------------------
# Running


def shown(argv, env=None, python=sys.executable):
    """A command as a reader would type it: python3 for this interpreter, its variables in front."""
    words = ["python3" if a == python else a for a in argv]
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()), shlex.join(words)])


def environment(cuda):
    """The environment dump: [(what, value)]."""
    import torch

    rows = [("python", platform.python_version()), ("torch", torch.__version__), ("CUDA (torch)", str(torch.version.cuda)),
            ("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST", "(unset: the GPUs in view)")),
            ("CPU cores", str(os.cpu_count()))]
    nvcc = shutil.which("nvcc")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout if nvcc else ""
    rows.append(("nvcc", (re.findall(r"release [\d.]+, V[\d.]+", version) or ["not found"])[0]))
    if cuda:
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        rows += [("NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)),
                 ("GPU", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"),
                 ("compute capability", f"{props.major}.{props.minor}"),
                 ("shared memory per block (opt-in)", str(getattr(props, "shared_memory_per_block_optin", "unknown")))]
        smi = shutil.which("nvidia-smi")
        driver = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip() if smi else ""
        rows.append(("driver", driver or "unknown"))
    else:
        rows.append(("GPU", "none (a dry run: nothing below runs)"))
    rows.append(("commit", commit()))
    return rows


def commit():
    """The tree's commit, if it is a git checkout with git at hand (the device machine's copy may not be)."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    except OSError:
        return "unknown (no git)"
    if head.returncode:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


class Runner:
    """Runs the plan's items group by group, prints each row as its item ends, keeps the logs."""

    def __init__(self, plan, budget_s, archive=None):
        self.plan, self.budget_s, self.archive = plan, budget_s, archive
        self.t0, self.rows, self.lock = time.monotonic(), {}, threading.Lock()
        self.procs, self.stopping = set(), False

    def left(self):
        return self.budget_s - (time.monotonic() - self.t0)

    def run_command(self, command, timeout):
        log_path = self.plan.out / f"{command.name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_EXTENSIONS_DIR": str(self.plan.extensions), **command.env}
        t0 = time.monotonic()
        with open(log_path, "w") as f:
            f.write(f"$ {shown(command.argv, command.env)}\n")
            f.flush()
            proc = subprocess.Popen(command.argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            with self.lock:
                self.procs.add(proc)
            try:
                code = proc.wait(timeout=max(1.0, timeout))
            except subprocess.TimeoutExpired:
                code = None
                _kill(proc)
            finally:
                with self.lock:
                    self.procs.discard(proc)
        text = log_path.read_text(errors="replace")
        if code is None:
            with open(log_path, "a") as f:
                f.write(f"\n[gpu_check: stopped at its time limit, {timeout:.0f} s]\n")
        return Log(code, text, time.monotonic() - t0)

    def run_item(self, item):
        t0, logs = time.monotonic(), {}
        for stage in item.stages:
            results = {}
            threads = [threading.Thread(target=lambda c=c: results.__setitem__(c.name, self.run_command(c, self.left())))
                       for c in stage]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            logs.update(results)
            if any(r.returncode is None for r in results.values()) or self.stopping:
                break  # out of time: the next stage would be too
        try:
            rows = item.judge(logs, self.plan)
        except Exception as e:  # noqa: BLE001 (a judge's own failure is a row, not a lost table)
            rows = [Row(item.title, "", f"the judge failed: {type(e).__name__}: {e}", "FAIL")]
        self.finish(item, rows, time.monotonic() - t0)

    def finish(self, item, rows, seconds):
        with self.lock:
            self.rows[item.key] = (item, rows, seconds)
            for row in rows:
                print(table_line(item, row, seconds), flush=True)
            self.write_outputs()

    def write_outputs(self):
        (self.plan.out / "table.md").write_text(table(self.plan.items, self.rows))
        if self.archive:
            tmp = Path(str(self.archive) + ".tmp")
            with tarfile.open(tmp, "w:gz") as tar:
                tar.add(self.plan.out, arcname=self.plan.out.name)
            os.replace(tmp, self.archive)

    def run(self, selected):
        groups = sorted({i.group for i in selected})
        for g in groups:
            threads = []
            for item in [i for i in selected if i.group == g]:
                if self.stopping or self.left() < item.estimate_s / 2:
                    self.finish(item, [Row(item.title, "", f"not started: {max(0, self.left()):.0f} s of the "
                                                          f"budget left, estimate {item.estimate_s} s", "SKIP")], 0)
                    continue
                threads.append(threading.Thread(target=self.run_item, args=(item,)))
                threads[-1].start()
            for t in threads:
                t.join()

    def stop(self, *_):
        self.stopping = True
        with self.lock:
            for proc in list(self.procs):
                _kill(proc)


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


HEADER = "| # | item | expected | measured | result | time (estimate) |\n|---|---|---|---|---|---|"


def table_line(item, row, seconds):
    expected = row.expected or item.expected
    return (f"| {item.key} | {row.name} | {expected} | {row.measured} | **{row.status}** | "
            f"{seconds:.0f} s ({item.estimate_s} s) |")


def table(plan_items, done):
    lines = [HEADER]
    for item in plan_items:
        if item.key in done:
            _, rows, seconds = done[item.key]
            lines += [table_line(item, row, seconds) for row in rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# The dry run: the plan as text (docs/GPU_CHECKLIST.md holds it)


def dry_run_text(plan, selected):
    out = io.StringIO()
    total = 0
    groups = sorted({i.group for i in selected})
    print(f"The plan: {len(selected)} items in {len(groups)} groups, run one group after the other; the items of a "
          f"group at once. Logs: {plan.out}/<name>.log, the table: {plan.out}/table.md. Every command runs from the "
          f"repository root with PYTHONUNBUFFERED=1 and TORCH_EXTENSIONS_DIR={plan.extensions}; $SCRATCH is a fresh "
          f"temporary directory. The commands of an item run at once, except that those after `then` start when "
          f"the ones before have ended.", file=out)
    for g in groups:
        members = [i for i in selected if i.group == g]
        longest = max(i.estimate_s for i in members)
        total += longest
        print(f"\nGroup {g + 1} (about {longest} s{', its items at once' if len(members) > 1 else ''})", file=out)
        for item in members:
            print(f"\n  [{item.key}] {item.title}: estimate {item.estimate_s} s", file=out)
            for n, stage in enumerate(item.stages):
                same = {}  # identical commands (the build's processes) are printed once
                for command in stage:
                    same.setdefault(shown(command.argv, command.env), []).append(f"{command.name}.log")
                for k, (line, logs) in enumerate(same.items()):
                    then = "then " if n and not k else "     " if n else ""
                    where = logs[0] if len(logs) == 1 else f"{logs[0]} ... {logs[-1]}, {len(logs)} processes at once"
                    print(f"    {then}$ {line}  > {where}", file=out)
            print(f"    must hold: {item.expected}", file=out)
    print(f"\nEstimate in all: {total} s on one H100 or H200 with 16 cores (budget {BUDGET_S} s).", file=out)
    text = out.getvalue()
    return text.replace(str(plan.scratch), "$SCRATCH").replace(sys.executable, "python3")


# ----------------------------------------------------------------------------------------------
# --poison-steps: 05 under torchrun with inf written into one gradient at the given steps (the
# nonfinite item's trainer; tests/test_robustness.py does the same on CPU ranks)


def poisoned_trainer(steps, flags):
    sys.path.insert(0, str(ROOT))
    gpt3d = importlib.import_module("05_3d_gpt")
    real, proving, calls, checking = gpt3d.clip_gradients, gpt3d.prove_machine, [0], [False]

    def clip(opt, chunks, groups, max_norm, zero1):
        calls[0] += not checking[0]  # clip_gradients runs once a step: its n-th call is step n - 1
        if not checking[0] and calls[0] - 1 in steps and chunks[0].pre_process:
            opt.pieces[-1].grad.view(-1)[0] = math.inf  # the last piece: the token embedding's
        return real(opt, chunks, groups, max_norm, zero1)

    def prove(*args, **kwargs):  # 05's check before training runs a train_step of its own: not a step
        checking[0] = True
        try:
            return proving(*args, **kwargs)
        finally:
            checking[0] = False

    gpt3d.clip_gradients, gpt3d.prove_machine = clip, prove
    sys.argv = [str(ROOT / "05_3d_gpt.py"), *flags]
    gpt3d.run_main(gpt3d.main)


# ----------------------------------------------------------------------------------------------


def parser():
    p = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="DIR", required=True,
                   help="where every log, table.md and env.txt go (made if absent; refused if it holds files)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the environment and each item's commands and what they must print; run nothing")
    keys = [i.key for i in Plan("DIR", "SCRATCH", "SCRATCH").items]
    p.add_argument("--only", nargs="+", metavar="ITEM",
                   help=f"run these items only, of {', '.join(keys)}; the build runs first in any case")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, metavar="S",
                   help=f"start no item once this many seconds are spent (default {BUDGET_S}: under 8 minutes in all); "
                        "an item not started is a SKIP row, and a command still running then is stopped")
    p.add_argument("--extensions-dir", metavar="DIR",
                   help="TORCH_EXTENSIONS_DIR for every command (default: $SCRATCH/torch_extensions, new, so the "
                        "build is cold; give a used one, such as an earlier run's, to reuse its builds)")
    p.add_argument("--archive", metavar="FILE", help="also write every log as one .tar.gz, rewritten after each item")
    p.add_argument("--poison-steps", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--poison-steps"]:  # the nonfinite item's trainer, under torchrun
        return poisoned_trainer({int(s) for s in argv[1].split(",")}, argv[3:] if argv[2:3] == ["--"] else argv[2:])
    args = parser().parse_args(argv)
    out = Path(args.out).resolve()
    dry = args.dry_run
    if not dry and out.exists() and any(out.iterdir()):
        sys.exit(f"error: --out {out} holds files already; give an empty or new directory")
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_")) if not dry else Path("/SCRATCH")
    extensions = Path(args.extensions_dir).resolve() if args.extensions_dir else scratch / "torch_extensions"
    capability = None
    if not dry:
        import torch

        if not torch.cuda.is_available():
            sys.exit("error: no CUDA device: this check needs one GPU (--dry-run prints the plan without one)")
        capability = torch.cuda.get_device_capability(0)
    plan = Plan(out, scratch, extensions, capability, xdist=dry or importlib.util.find_spec("xdist") is not None,
                cold=not (extensions.exists() and any(extensions.iterdir())))
    keys = [i.key for i in plan.items]
    unknown = sorted(set(args.only or []) - set(keys))
    if unknown:
        sys.exit(f"error: --only {' '.join(unknown)}: no such item; the items are {', '.join(keys)}")
    selected = [i for i in plan.items if not args.only or i.key in args.only or i.key == "build"]
    env = environment(cuda=not dry)
    width = max(len(k) for k, _ in env)
    env_text = "\n".join(f"{k:{width}s}  {v}" for k, v in env)
    print(f"environment{' (this machine: a dry run)' if dry else ''}\n{env_text}\n", flush=True)
    if dry:
        print(dry_run_text(plan, selected), end="")
        return True
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.txt").write_text(env_text + "\n")
    runner = Runner(plan, args.budget_s, Path(args.archive).resolve() if args.archive else None)
    signal.signal(signal.SIGTERM, runner.stop)
    estimate = sum(max(i.estimate_s for i in selected if i.group == g) for g in {i.group for i in selected})
    print(f"{len(selected)} items, estimate {estimate} s, budget {args.budget_s:.0f} s; logs in {out}, scratch in "
          f"{scratch}\n\n{HEADER}", flush=True)
    try:
        runner.run(selected)
    except KeyboardInterrupt:
        runner.stop()
        print("\ninterrupted: the rows so far", file=sys.stderr)
    statuses = [row.status for _, rows, _ in runner.rows.values() for row in rows]
    print(f"\n{table(plan.items, runner.rows)}\n{statuses.count('PASS')} PASS, {statuses.count('FAIL')} FAIL, "
          f"{statuses.count('SKIP')} SKIP in {time.monotonic() - runner.t0:.0f} s; logs in {out}", flush=True)
    return bool(statuses) and all(s == "PASS" for s in statuses) and len(runner.rows) == len(selected)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
