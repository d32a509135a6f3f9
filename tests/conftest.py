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
import signal
import sys
from pathlib import Path

import pytest

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
    launch = load("01_tensor_parallel").launch

    def run(body, nprocs, *args):
        return launch(body, nprocs, *args, timeout_s=COLLECTIVE_TIMEOUT_S,
                      deadline_s=TEST_TIMEOUT_S - 10)

    return run
