"""A checkpoint's finiteness check on a GPU's mix of devices, on a CPU.

On a GPU, AdamW (neither fused nor capturable, as 04's FlatAdamW makes it) keeps each parameter's
`step` counter on the CPU, beside moments and parameters on the GPU; torch refuses to stack
tensors of two devices ("Expected all tensors to be on the same device"), so a check that stacks
them all fails every save after the first optimizer step. No GPU here: `Elsewhere` is a CPU tensor
that says it lives on cuda:0 and, like torch's CUDA kernels, refuses any operation that mixes it
with a tensor of another device (stricter than torch, which lets a 0-dim CPU tensor into some
elementwise CUDA ops: a check that passes here mixes nothing at all). Every operation on it
computes on its CPU data, so values, read-backs and the names found are real.
"""
from types import SimpleNamespace

import pytest
import torch
from torch.utils._pytree import tree_leaves, tree_map

from plumbing import checkpoint


class Elsewhere(torch.Tensor):
    """CPU data presented as a tensor on cuda:0 (see the module docstring)."""

    @staticmethod
    def __new__(cls, data):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=torch.device("cuda", 0))
        t.cpu_data = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = sorted({str(t.device) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)})
        if len(devices) > 1:  # torch's own words for the same refusal
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{devices[0]} and {devices[1]}!")
        unwrap = lambda t: t.cpu_data if isinstance(t, cls) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        return tree_map(lambda t: cls(t) if isinstance(t, torch.Tensor) else t, out)

    __repr__ = object.__repr__  # torch's would format the wrapper's (absent) storage


def test_the_stand_in_refuses_to_stack_two_devices_as_torch_does():
    flag = torch.isfinite(Elsewhere(torch.ones(3))).all()
    assert flag.device == torch.device("cuda", 0) and bool(flag)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.stack([flag, torch.tensor(True)])


def gpu_run(poison=None):
    """A run after one AdamW step laid out as on a GPU: parameters and moments on 'cuda:0', each
    step counter on the CPU. poison: the name of a parameter to fill with inf."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    named = dict(model.named_parameters())
    steps = [st["step"] for st in opt.state.values()]
    assert all(s.device.type == "cpu" and s.is_floating_point() for s in steps)  # what torch does today
    on_gpu = {n: Elsewhere(p.detach().clone()) for n, p in named.items()}
    if poison:
        on_gpu[poison].cpu_data[0] = float("inf")
    state = {i: {k: v if k == "step" else Elsewhere(v.clone()) for k, v in st.items()}
             for i, st in enumerate(opt.state.values())}
    chunk = SimpleNamespace(named_parameters=lambda: list(on_gpu.items()))
    return SimpleNamespace(chunks=[chunk], opt=SimpleNamespace(optimizer=SimpleNamespace(state=state)))


def test_the_finiteness_check_before_a_save_takes_gpu_parameters_beside_cpu_step_counters():
    assert checkpoint._finite(gpu_run()) == []


def test_the_finiteness_check_names_a_non_finite_gpu_parameter_beside_cpu_step_counters():
    assert checkpoint._finite(gpu_run(poison="1.weight")) == ["1.weight"]
