"""The numbered chapters under names Python can import (theirs start with a digit):

    from megatron_scratch import tensor_parallel, pipeline, interleaved, data_parallel, gpt3d
    from megatron_scratch import zero_bubble, vocab_parallel, context_parallel, expert_parallel

Each name is the chapter's module itself (01_tensor_parallel.py ... 09_expert_parallel.py), loaded on
first use. The chapters sit beside this package: at the checkout's top, or, from `pip install .` (a
wheel) or `pip install -e .`, as top-level modules beside it in site-packages (setup.py); either way
they stay runnable as scripts. megatron_scratch.testing is the kit for another project's tests
(run_ranks, assert_close, compare_state), and megatron_scratch.pytest_plugin its pytest fixture;
megatron_scratch.reference the stable reference API, megatron_scratch.convert the converters (Hugging
Face GPT-2, the fused QKV layout, torch's pipeline_order), megatron_scratch.golden the golden values.
The converters are re-exported here too: from megatron_scratch import from_hf, split_qkv, ...
"""
import importlib
import os
import sys

CHAPTERS = {"tensor_parallel": "01_tensor_parallel", "pipeline": "02_pipeline_1f1b", "interleaved": "03_interleaved",
            "data_parallel": "04_data_parallel", "gpt3d": "05_3d_gpt", "zero_bubble": "06_zero_bubble",
            "vocab_parallel": "07_vocab_parallel", "context_parallel": "08_context_parallel",
            "expert_parallel": "09_expert_parallel"}
CONVERTERS = ("from_hf", "to_hf", "split_qkv", "merge_qkv", "qkv_shard", "qkv_unshard", "to_torch_order",
              "from_torch_order")  # megatron_scratch.convert's, loaded on first use
__all__ = list(CHAPTERS) + list(CONVERTERS)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the chapters sit beside this package
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def __getattr__(name):
    if name in CONVERTERS:
        value = getattr(importlib.import_module("megatron_scratch.convert"), name)
        globals()[name] = value
        return value
    if name not in CHAPTERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; the chapters are {', '.join(CHAPTERS)}")
    module = importlib.import_module(CHAPTERS[name])
    globals()[name] = module
    return module
