"""The multi-rank test harness: every test gets its own fork-started gloo ranks and a deadline.

    def test_something(run_ranks):
        def body(env, x):          # runs on every rank, after init_process_group
            ...
            return value           # picklable; collected in rank order
        results = run_ranks(body, 2, x)

A rank that raises or dies fails the test with that rank's traceback (RankFailure); every
collective times out after COLLECTIVE_TIMEOUT_S and every test, single- or multi-rank, after
TEST_TIMEOUT_S, so no test can hang.
"""
import fnmatch
import importlib
import io
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COLLECTIVE_TIMEOUT_S = 20
TEST_TIMEOUT_S = 90
# The serial references computed here are small: one thread is as fast, and a second one's spinning
# would only take a core from the forked ranks that run next.
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--full-grid", action="store_true",
                     help="run every case of the grids marked @pytest.mark.grid (by default, only the cases each "
                          "names in keep=: a representative part, so the suite fits CI's 10 minutes on 2 cores)")


def pytest_configure(config):
    config.addinivalue_line("markers", "grid(keep): a slow grid of cases; without --full-grid only the cases "
                                       "whose ids are in keep run")
    config.addinivalue_line("markers", "deadline(seconds): this test's own limit instead of TEST_TIMEOUT_S")
    config.addinivalue_line("markers", "full_grid(covered_by=[tests], why): a slow test that runs only under --full-grid "
                                       "(or named by its id); the faster tests in covered_by hold its property in CI")


COLLECTED = pytest.StashKey()  # every node id this session collected, when it collected the whole suite


@pytest.hookimpl(tryfirst=True)  # before -k or -m deselect anything
def pytest_collection_modifyitems(config, items):
    """Without --full-grid, each grid runs the cases it names in keep=; the others are deselected.
    A session that collected every test file whole keeps the node ids it collected (config.stash[COLLECTED]):
    test_grid checks the keep ids against them rather than collecting the suite again in a subprocess."""
    files = {Path(str(item.path)).name for item in items}
    if not any("::" in a for a in config.args) and files >= {p.name for p in (ROOT / "tests").glob("test_*.py")}:
        config.stash[COLLECTED] = [item.nodeid for item in items]
    if not config.getoption("--full-grid"):
        named = [a.replace(os.sep, "/") for a in config.args if "::" in a]
        items[:], dropped = grid_selection(items, named)
        if dropped:
            config.hook.pytest_deselected(items=dropped)


def kept(case, keep):
    """Whether a grid's keep list names this case id: an id, or a pattern of fnmatch's ("cuda-*": every case
    on the GPU, which runs them all where there is one)."""
    return any(fnmatch.fnmatchcase(case, k) for k in keep)


def grid_selection(items, named=()):
    """(kept, dropped): a case of a grid (@pytest.mark.grid(keep=[ids])) is kept when keep names its id, a
    test marked @pytest.mark.full_grid(covered_by=[...]) when it is named on the command line (named: the
    node ids given), every other test always. A grid collected only in part (cases named by id, or -k) runs
    what was collected: the cases asked for. test_grid checks that every keep id names a case of its grid,
    and that every covered_by names a test CI runs."""
    grids = {}
    for item in items:
        mark = item.get_closest_marker("grid")
        if mark is not None and hasattr(item, "callspec"):
            grids.setdefault(item.originalname, (set(mark.kwargs["keep"]), set()))[1].add(item.callspec.id)
    kept_items, dropped = [], []
    for item in items:
        if item.get_closest_marker("full_grid") is not None and not any(
                getattr(item, "nodeid", "").startswith(n) for n in named):
            dropped.append(item)
            continue
        keep, ids = grids.get(getattr(item, "originalname", None), (None, None))
        whole = keep is not None and hasattr(item, "callspec") and all(any(kept(i, [k]) for i in ids) for k in keep)
        (dropped if whole and not kept(item.callspec.id, keep) else kept_items).append(item)
    return kept_items, dropped


def pytest_report_header(config):
    if not config.getoption("--full-grid"):
        return ("grids marked @pytest.mark.grid run their representative cases only; "
                "python3 -m pytest --full-grid runs every case")


def load(name):
    """Import a numbered file such as '01_tensor_parallel' (its name starts with a digit)."""
    return importlib.import_module(name)


@pytest.fixture(autouse=True)
def _test_deadline(request):
    """Every test's limit: TEST_TIMEOUT_S, or its own (@pytest.mark.deadline(seconds), for a test whose work
    is a compiler's and so scales with the machine's load; its reason is written beside it)."""
    mark = request.node.get_closest_marker("deadline")
    limit = mark.args[0] if mark else TEST_TIMEOUT_S

    def expire(signum, frame):
        raise TimeoutError(f"{request.node.nodeid} ran past its {limit} s limit")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="session", autouse=True)
def _kernels_built():
    """On a GPU, every kernel family is compiled once per test run, before any test: a cold build
    takes minutes, which no test's deadline (or a torchrun test's subprocess timeout) should pay.
    torch caches the builds on disk, so subprocesses find them. Nothing to do without CUDA."""
    if torch.cuda.is_available():
        import kernels
        kernels.prebuild("auto")


CHAPTERS = sorted(p.stem for p in ROOT.glob("0[1-9]_*.py"))


@pytest.fixture(scope="session", autouse=True)
def _warm_before_forking():
    """What each forked rank (run_ranks) and forked script (run_script) would otherwise compute for itself,
    computed once in this process before the first fork, which they inherit: the built-in corpus and its
    identity (plumbing.data's caches, 0.3-0.9 s a process: the 8 ranks of a world spent ~3 s of its 6.5 s
    on 2 cores making it, each its own copy) and the flags of every chapter the test files imported (parser(),
    read from its source: up to 0.35 s a script run). Nothing a test sees changes: the same values, made once."""
    from plumbing import data

    data.builtin_corpus()
    data.identity("")
    for name in CHAPTERS:
        if name in sys.modules:
            sys.modules[name].parser()


@pytest.fixture
def run_ranks():
    """The packaged harness (megatron_scratch.testing.run_ranks, which its pytest plugin gives an installed
    package's users), within this suite's limits."""
    from megatron_scratch.testing import run_ranks as packaged  # after ROOT is on sys.path

    def run(body, nprocs, *args):
        return packaged(body, nprocs, *args, timeout_s=COLLECTIVE_TIMEOUT_S, deadline_s=TEST_TIMEOUT_S - 10)

    return run


def run_script(script, *args, timeout=60, env=None, fresh=False):
    """`python3 script args` from the repository root, as a user runs it: its exit code, stdout and
    stderr, as a subprocess.CompletedProcess with .seconds (wall time) and .leftover (processes of
    the run still alive after it exited: must be none).

    It runs in a process forked from this one rather than a new interpreter: a fresh one spends
    ~2.5 s of a 2-core machine importing torch, and the suite runs scripts a hundred times. The
    script still runs as __main__ from its own file, with its own argv, working directory, process
    group and exit code; env= adds environment variables. With fresh=True (for what must be seen
    at interpreter start, such as PYTHONPATH, or a command like `-m torch.distributed.run`) it runs
    in a new interpreter instead."""
    t0 = time.monotonic()
    args = [str(a) for a in args]
    if fresh:
        child = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                                 start_new_session=True)
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        finally:
            _stop_group(child.pid, grace_s=0)
        proc = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
        proc.seconds = time.monotonic() - t0
        proc.leftover = _alive(child.pid)
        return proc
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: become `python3 script args`
        code = 1
        try:
            os.setpgid(0, 0)  # its own group, so that everything it starts can be found and stopped
            for sig in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
            os.chdir(ROOT)
            os.environ.update(env or {})
            path = str(ROOT / script)
            sys.argv = [path, *args]
            sys.path.insert(0, os.path.dirname(path))
            torch.set_num_threads(1)
            try:
                runpy.run_path(path, run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            _stop_group(pid, grace_s=0)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired([script, *args], timeout)
        time.sleep(0.02)
    seconds = time.monotonic() - t0
    leftover = _stop_group(pid)
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    proc = subprocess.CompletedProcess([script, *args], os.waitstatus_to_exitcode(status), *texts)
    proc.seconds, proc.leftover = seconds, leftover
    return proc


_script_outputs = {}


def script_output(script, *args, timeout=80):
    """run_script(script, *args) once per test session, its finished run cached: the docs' tests
    (test_docs.py, test_answers.py) read the same demo runs, and a demo is run once for both."""
    key = (str(script), *map(str, args))
    if key not in _script_outputs:
        _script_outputs[key] = run_script(script, *args, timeout=timeout)
    return _script_outputs[key]


def _alive(proc_group):
    """The pids still alive in a process group."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == proc_group and fields[0] != "Z":  # pgrp; zombies are gone already
                pids.append(int(entry))
    return pids


def _stop_group(pgid, grace_s=3.0):
    """Kill what is left of a run's process group; returns the pids that outlived the run's exit by
    more than grace_s (ranks it started are stopped by the launcher or die with it, which can take
    a moment: they must not linger beyond that)."""
    deadline = time.monotonic() + grace_s
    while _alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = _alive(pgid)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return leftover


# ----------------------------------------------------------------------------------------------
# Shared by several test files (no test module imports another): tolerances, configs, helpers.

TOL = 1e-10  # float64 parity with the serial model; each test file says why this is enough
tensor_parallel, pipeline, gpt3d = load("01_tensor_parallel"), load("02_pipeline_1f1b"), load("05_3d_gpt")

# The pipeline tests' model (test_pipeline.py, test_interleaved.py): small, 4 layers to cut.
PIPELINE_CFG = tensor_parallel.GPTConfig(vocab_size=97, block_size=16, n_layer=4, n_head=2, n_embd=16)


def pipeline_batch(m, rows_per_mb=2, T=16, seed=3):
    gen = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(PIPELINE_CFG.vocab_size, (2, m * rows_per_mb, T), generator=gen)
    targets[0, :5] = -100  # some ignored positions, all in the first microbatch: uneven counts
    return idx, targets


def exchange(background_sends):
    """02's boundary exchange: BackgroundSends (the optimization 05 turns on), or the plain one."""
    return pipeline.BackgroundSends() if background_sends else pipeline.Exchange()


def pipeline_train(env, make_schedule, m, steps, v=1, cfg=PIPELINE_CFG):
    """Train `steps` AdamW steps through the pipeline and the serial model side by side."""
    pp = env.world_size
    embed_group = torch.distributed.new_group([0, pp - 1]) if pp > 1 else None
    full = tensor_parallel.init_state_dict(cfg, 5, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float64)
    serial.load_full_state_dict(full)
    chunks = pipeline.build_chunks(cfg, pp, env.rank, v, init=False, dtype=torch.float64)
    for c in chunks:
        c.load_full_state_dict(full)
    params = [p for c in chunks for p in c.parameters()]
    opt, ref_opt = (torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1) for ps in (params, serial.parameters()))
    diffs, orders = {}, []
    for step in range(steps):
        idx, targets = pipeline_batch(m, seed=step)
        ref_loss = serial(idx, targets)[1]
        ref_loss.backward()
        schedule = [make_schedule(pp, m, s) for s in range(pp)]
        res = pipeline.execute(load("03_interleaved").InterleavedSchedule(schedule), chunks, torch.distributed.group.WORLD,
                               pipeline.split_batch(idx, targets, m), pipeline.Wire((2, 16, cfg.n_embd)))
        pipeline.sync_tied_embeddings(chunks, embed_group)
        orders.append([a for _, _, a in res.events] == schedule[env.rank])
        if res.loss is not None:
            diffs[f"step {step} loss"] = tensor_parallel.max_rel_diff(res.loss, ref_loss.detach())
        diffs[f"step {step} messages"] = res.messages
        ref = {n: p.grad for n, p in serial.named_parameters()}
        for c in chunks:
            for n, p in c.named_parameters():
                diffs[f"step {step} grad {n}"] = tensor_parallel.max_rel_diff(p.grad, ref[n])
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        ref = dict(serial.named_parameters())
        for c in chunks:
            for n, p in c.named_parameters():
                diffs[f"step {step} param {n}"] = tensor_parallel.max_rel_diff(p.detach(), ref[n].detach())
    return diffs, orders


# The trainer tests' model and base config (test_3d.py, test_checkpoint.py).
TRAINER_CFG = tensor_parallel.GPTConfig(vocab_size=256, block_size=16, n_layer=8, n_head=2, n_embd=16)
TRAINER_BASE = gpt3d.TrainConfig(tp=1, pp=1, dp=1, batch_size=8, microbatches=2, seq_len=16, steps=10,
                                 lr=1e-2, min_lr=1e-3, warmup_steps=3, grad_clip=0.5, dtype="float64",
                                 eval_every=0, bucket_numel=500, timeout_s=30)


# The kernel tests' helpers (tests/test_kernel*.py).
F64 = torch.float64
CPU_TOL = 1e-12
GPU_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_nvcc = pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc is not on the PATH")

# The kernel tests run each kernel twice: on the GPU (mode "cuda", where there is one) and, always, from
# the same source on the CPU (mode "simt", kernels/simt), on CPU tensors. The emulated H100 has 4 SMs
# here rather than 132, so that every grid-stride loop (grid_for's, the layernorm backward's) loops.
KERNEL_MODES = [pytest.param("cuda", marks=needs_cuda), "simt"]
SIMT_SMS = 4


def kernel_device(mode):
    return "cuda" if mode == "cuda" else "cpu"


def kernel_extension(mode, family):
    """family's compiled kernels for mode: the torch extension on the GPU, or the emulator's build."""
    from kernels import build, simt

    name = family.__name__.split(".")[-1]
    return (build.extension if mode == "cuda" else simt.extension)(name, family.BINDING, family.FUNCTIONS)


@pytest.fixture(autouse=True)
def _simt_grid_stride(request):
    """A test parametrised with mode "simt" runs on an emulated H100 of SIMT_SMS SMs (above)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("mode") != "simt":
        yield
        return
    from kernels import simt

    with simt.emulating(sms=SIMT_SMS):
        yield


def rel(a, b):
    return tensor_parallel.max_rel_diff(a.double(), b.double())


def randn(*shape, seed, dtype=F64, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype=dtype, device=device)


def check_against_unfused(fn, unfused, inputs, tol=CPU_TOL):
    """Forward and every input gradient of fn against the unfused composition, float64."""
    a = [t.clone().requires_grad_() for t in inputs]
    b = [t.clone().requires_grad_() for t in inputs]
    out_a, out_b = fn(*a), unfused(*b)
    grad = randn(*out_a.shape, seed=99)
    out_a.backward(grad)
    out_b.backward(grad)
    assert rel(out_a, out_b) < tol
    for x, y in zip(a, b):
        assert rel(x.grad, y.grad) < tol


def trainer_grad_diffs(run, ref, zero1):
    """{name: relative difference} of a trainer rank's gradients after a step against the serial model's
    (ref: name -> gradient): under ZeRO-1 this rank's shard of the flat buffer against the same elements,
    else each chunk's gradients gathered back to serial shapes."""
    if not zero1:
        return {n: tensor_parallel.max_rel_diff(g, ref[n]) for c in run.chunks for n, g in c.full_grads().items()}
    owner, diffs = {id(p): n for c in run.chunks for n, p in c.named_parameters()}, {}
    for piece in run.opt.pieces:
        start = piece.weights.storage_offset() - run.ddp.offsets[piece.param]
        want = ref[owner[id(piece.param)]].reshape(-1)[start:start + piece.grad.numel()]
        diffs[owner[id(piece.param)]] = tensor_parallel.max_rel_diff(piece.grad, want)
    return diffs



def unequal_batch(cfg, m, rows=2, T=16, seed=5):
    """A batch (idx, targets) of m microbatches of `rows` rows whose counted targets differ
    (plumbing.reference.unequal_counts: microbatch 0 counts none when m > 1): the pipeline lessons' batch."""
    from plumbing.reference import unequal_counts
    gen = torch.Generator().manual_seed(seed)
    idx, targets = torch.randint(cfg.vocab_size, (2, m * rows, T), generator=gen)
    return idx, unequal_counts(targets, m)


def lesson_reference(cfg, m):
    """What the pipeline lessons' tests compare with: unequal_batch(cfg, m)'s (idx, targets), full float64
    weights from seed 0 (every tensor random), the serial model's (loss, {name: grad}) on the whole batch,
    and the m microbatches: (idx, targets, full, ref, microbatches)."""
    tensor_parallel = load("01_tensor_parallel")
    idx, targets = unequal_batch(cfg, m)
    full = tensor_parallel.init_state_dict(cfg, 0, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float64).load_full_state_dict(full)
    loss = serial(idx, targets)[1]
    loss.backward()
    ref = loss.detach(), {n: p.grad for n, p in serial.named_parameters()}
    return idx, targets, full, ref, list(zip(idx.chunk(m), targets.chunk(m)))


def worst_of(got, want):
    """The largest relative difference of (loss or None, {name: grad}) from want's, on this rank."""
    from plumbing.shards import max_rel_diff
    (loss, grads), (ref_loss, ref_grads) = got, want
    diffs = [max_rel_diff(g, ref_grads[n]) for n, g in grads.items()]
    return max(diffs + ([max_rel_diff(loss, ref_loss)] if loss is not None else []))
