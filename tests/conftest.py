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
import importlib
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COLLECTIVE_TIMEOUT_S = 20
TEST_TIMEOUT_S = 90


def load(name):
    """Import a numbered file such as '01_tensor_parallel' (its name starts with a digit)."""
    return importlib.import_module(name)


@pytest.fixture(autouse=True)
def _test_deadline(request):
    def expire(signum, frame):
        raise TimeoutError(f"{request.node.nodeid} ran past its {TEST_TIMEOUT_S} s limit")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_TIMEOUT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def run_ranks():
    from plumbing.launch import launch  # after ROOT is on sys.path

    def run(body, nprocs, *args):
        return launch(body, nprocs, *args, timeout_s=COLLECTIVE_TIMEOUT_S,
                      deadline_s=TEST_TIMEOUT_S - 10)

    return run


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
        res = pipeline.execute(schedule[env.rank], chunks, torch.distributed.group.WORLD,
                               pipeline.split_batch(idx, targets, m), (2, 16, cfg.n_embd))
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
