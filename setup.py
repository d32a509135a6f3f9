"""The modules pyproject.toml cannot list: its py-modules takes names that start with a letter, and the
chapters' start with their number (01_tensor_parallel ...). They install as top-level modules, as they
sit at the checkout's top, beside megatron_scratch, plumbing and kernels (pyproject.toml)."""
import glob
import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
CHAPTERS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(HERE, "[0-9][0-9]_*.py")))

setup(py_modules=[*CHAPTERS, "planner"])
