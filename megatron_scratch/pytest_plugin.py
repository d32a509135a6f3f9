"""The pytest plugin of megatron_scratch, registered as the `pytest11` entry point "megatron_scratch"
(pyproject.toml): pytest loads it in every environment where the package is installed, so a test suite
gets the `run_ranks` fixture with no conftest of its own.

    def test_mine(run_ranks):
        results = run_ranks(body, 2, x)    # body(env, x) on 2 gloo CPU ranks; every rank's result

The fixture is megatron_scratch.testing.run_ranks (its docstring: timeouts, failures). Nothing heavier
than pytest is imported until a test asks for it: torch loads at the fixture's first use.
"""
import pytest


@pytest.fixture
def run_ranks():
    """run_ranks(fn, n, *args): fn(env, *args) on n fork-started gloo CPU ranks for this test; every rank's
    result in rank order; a rank that raises or dies fails the test with its traceback (RankFailure), and
    collectives time out (20 s) and the whole call (80 s), so no test hangs."""
    from megatron_scratch.testing import run_ranks as run
    return run
