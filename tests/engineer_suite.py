"""An engineer's suite, outside the repository (issue 42's acceptance): tests/test_testing_kit.py copies
this file into a directory of its own as test_engineer.py and runs it with pytest against the installed
wheel, whose plugin gives run_ranks (no conftest). Their own GPT-2 in plain torch (our full state
dict's names: it loads reference.init_weights as it is), run by torch's FSDP2 (3 AdamW steps against
reference_training, and a planted mistake: each replica's own mean averaged, which the unequal counts
make wrong) and by DTensor tensor parallelism of its MLPs (the loss and every gradient against
serial_loss_and_grads), all in float64 with the kit's default tolerances. Not named test_*.py here,
so the repository's own run does not collect it."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron_scratch import reference
from megatron_scratch.testing import assert_close, compare_state

CFG = reference.gpt_config(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=16)
FULL = reference.init_weights(CFG, seed=1)
_gen = torch.Generator().manual_seed(3)
BATCHES = [tuple(torch.randint(61, (2, 4, 8), generator=_gen)) for _ in range(3)]
for _, _t in BATCHES:
    _t[0, :5] = -100  # replica 0 counts fewer targets than replica 1
ADAMW = dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05)


class Block(nn.Module):
    def __init__(self, C, nh):
        super().__init__()
        self.nh = nh
        self.ln_1, self.ln_2 = nn.LayerNorm(C, dtype=torch.float64), nn.LayerNorm(C, dtype=torch.float64)
        self.attn = nn.Module()
        self.attn.c_attn, self.attn.c_proj = nn.Linear(C, 3 * C, dtype=torch.float64), nn.Linear(C, C, dtype=torch.float64)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = nn.Linear(C, 4 * C, dtype=torch.float64), nn.Linear(4 * C, C, dtype=torch.float64)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn.c_attn(self.ln_1(x)).split(C, -1)
        heads = lambda t: t.view(B, T, self.nh, -1).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class MyGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg.n_embd
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(cfg.vocab_size, C, dtype=torch.float64)
        self.transformer.wpe = nn.Embedding(cfg.block_size, C, dtype=torch.float64)
        self.transformer.h = nn.ModuleList([Block(C, cfg.n_head) for _ in range(cfg.n_layer)])
        self.transformer.ln_f = nn.LayerNorm(C, dtype=torch.float64)

    def forward(self, idx, targets):  # the summed loss over the counted targets
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        logits = self.transformer.ln_f(x) @ self.transformer.wte.weight.T  # tied
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")


def mine(weights):
    model = MyGPT(CFG)
    model.load_state_dict(weights)
    return model


def fsdp2_training(env, per_token):
    from torch.distributed.fsdp import fully_shard
    model = mine(FULL)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for idx, targets in BATCHES:
        x, y = idx.chunk(2)[env.rank], targets.chunk(2)[env.rank]
        # FSDP averages the gradients over the 2 ranks: per token, each rank's sum over the batch's count, x 2
        n = (targets != -100).sum() if per_token else (y != -100).sum() * 2
        loss = model(x, y) / n * 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach() / 2
        dist.all_reduce(total)
        losses.append(total.item())
    return losses, {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def test_fsdp2_trains_as_04s_reference(run_ranks):
    losses, weights = run_ranks(fsdp2_training, 2, True)[0]
    want = reference.reference_training(CFG, FULL, BATCHES, mode="naive", dp=2, **ADAMW)
    assert_close(torch.tensor(losses), torch.tensor(want.losses))
    compare_state(weights, want.weights)


def test_fsdp2_averaging_each_replicas_mean_is_caught(run_ranks):
    losses, weights = run_ranks(fsdp2_training, 2, False)[0]  # wrong when the replicas count unequally
    want = reference.reference_training(CFG, FULL, BATCHES, mode="naive", dp=2, **ADAMW)
    with pytest.raises(AssertionError, match="entries differ"):
        compare_state(weights, want.weights)


def dtensor_grads(env):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = mine(FULL)
    mesh = init_device_mesh("cpu", (2,))
    for block in model.transformer.h:  # Megatron's MLP: c_fc by columns, c_proj by rows
        parallelize_module(block.mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    idx, targets = BATCHES[0]
    loss = model(idx, targets) / (targets != -100).sum()
    loss.backward()
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731
    return loss.detach(), {n: full(p.grad) for n, p in model.named_parameters()}


def test_dtensor_tp_of_the_mlps_equals_serial(run_ranks):
    loss, grads = run_ranks(dtensor_grads, 2)[0]
    want = reference.serial_loss_and_grads(CFG, FULL, *BATCHES[0])
    assert_close(loss, want.loss)
    compare_state(grads, want.grads)
