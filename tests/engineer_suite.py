"""An engineer's suite, outside the repository (issue 42's acceptance): tests/test_testing_kit.py copies
this file into a directory of its own as test_engineer.py and runs it with pytest against the installed
wheel, whose plugin gives run_ranks (no conftest). Their own GPT-2 in plain torch (our full state
dict's names: it loads reference.init_weights as it is), run by torch's FSDP2 (3 AdamW steps against
reference_training, and a planted mistake: each replica's own mean averaged, which the unequal counts
make wrong), by DTensor tensor parallelism of its MLPs (the loss and every gradient against
serial_loss_and_grads) and by torch.distributed.pipelining's runtime running 02's 1F1B lists through
megatron_scratch.to_torch_order (2 stages, the tied wte's two halves summed); and Hugging Face's own
GPT2LMHeadModel, loaded through megatron_scratch.to_hf, against our tp=2 model (tp_loss_and_grads,
with and without sequence parallelism: the loss, the logits and every gradient, read back by from_hf;
a converter that forgets Conv1D's transpose is caught). That one needs transformers, which the
repository does not install (requirements.txt): without it, it is skipped, saying so. All in float64
with the kit's default tolerances. Not named test_*.py here, so the repository's own run does not
collect it."""
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


class Part(nn.Module):
    """Pipeline stage r of the engineer's GPT-2 (2 stages): the embeddings and block 0, or block 1, ln_f and
    the head, which uses this process's own copy of wte (its gradient is the other half of wte's)."""

    def __init__(self, model, first):
        super().__init__()
        self.model, self.first = model, first

    def forward(self, x):
        tr = self.model.transformer
        if self.first:
            return tr.h[0](tr.wte(x) + tr.wpe(torch.arange(x.shape[1])))
        return tr.ln_f(tr.h[1](x)) @ tr.wte.weight.T


def torch_pipelining_grads(env, m):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from megatron_scratch import pipeline, to_torch_order
    model, (idx, targets) = mine(FULL), UNMASKED
    b, T, C, V = idx.shape[0] // m, idx.shape[1], CFG.n_embd, CFG.vocab_size
    act = torch.empty(b, T, C, dtype=torch.float64)
    ins, outs = (idx[:b], act) if env.rank == 0 else (act.clone().requires_grad_(), torch.empty(b, T, V, dtype=torch.float64))
    stage = PipelineStage(Part(model, env.rank == 0), env.rank, 2, torch.device("cpu"), input_args=ins,
                          output_args=outs, output_grads=outs, input_grads=None if env.rank == 0 else ins)
    loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())  # noqa: E731: a microbatch's mean
    runtime = _PipelineScheduleRuntime([stage], m, loss_fn=loss_fn)  # scale_grads: the mean over microbatches
    runtime._prepare_schedule_with_comms(to_torch_order(pipeline.Schedule([pipeline.one_f_one_b(2, m, r) for r in range(2)])))
    losses = []
    runtime.step(*([idx] if env.rank == 0 else []), target=targets, losses=losses)
    used = ("transformer.wte", "transformer.wpe", "transformer.h.0") if env.rank == 0 else \
        ("transformer.wte", "transformer.h.1", "transformer.ln_f")
    return sum(losses) / m if losses else None, {n: p.grad for n, p in model.named_parameters() if n.startswith(used)}


_gen2 = torch.Generator().manual_seed(4)
UNMASKED = tuple(torch.randint(61, (2, 4, 8), generator=_gen2))  # every microbatch counts alike: torch's mean of means


def test_torch_pipelining_runs_our_1f1b_via_the_converter_to_the_serial_gradients(run_ranks):
    (_, first), (loss, last) = run_ranks(torch_pipelining_grads, 2, 4)
    grads = dict(first, **last)
    grads["transformer.wte.weight"] = first["transformer.wte.weight"] + last["transformer.wte.weight"]  # tied
    want = reference.serial_loss_and_grads(CFG, FULL, *UNMASKED)
    assert_close(loss, want.loss)
    compare_state(grads, want.grads)


def hf_gpt2(hf_state_dict):
    """Hugging Face's own GPT2LMHeadModel of CFG, in float64, with these weights (no dropout)."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (the repository's requirements.txt does not "
        "name it): pip install transformers to compare Hugging Face's GPT2LMHeadModel with the reference")
    config = transformers.GPT2Config(vocab_size=CFG.vocab_size, n_positions=CFG.block_size, n_embd=CFG.n_embd,
                                     n_layer=CFG.n_layer, n_head=CFG.n_head, activation_function="gelu_new",
                                     layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config).to(torch.float64).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict, strict=False)
    assert not unexpected and all(k.endswith(("attn.bias", "attn.masked_bias")) for k in missing), (missing, unexpected)
    return model


def hf_loss_and_grads(model, idx, targets):  # our targets are the next tokens already: no shift; their mean
    logits = model(input_ids=idx).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()}  # lm_head: wte's


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_hf_gpt2lmheadmodel_equals_our_tp_2_model(sequence_parallel):
    from megatron_scratch import from_hf, to_hf
    idx, targets = BATCHES[0]
    loss, logits, hf_grads = hf_loss_and_grads(hf_gpt2(to_hf(FULL, CFG)), idx, targets)
    want = reference.tp_loss_and_grads(CFG, FULL, idx, targets, tp=2, sequence_parallel=sequence_parallel)
    assert_close(loss, want.loss)
    assert_close(logits, want.logits)
    compare_state(from_hf(hf_grads, CFG), want.grads)  # Conv1D's (in, out) gradients transposed back
    # planted: a converter that forgets Conv1D's transpose (c_proj is square: it loads without complaint)
    c_proj = [f"transformer.h.{i}.attn.c_proj.weight" for i in range(CFG.n_layer)]
    untransposed = dict(to_hf(FULL, CFG), **{n: FULL[n] for n in c_proj})
    with pytest.raises(AssertionError):
        assert_close(hf_loss_and_grads(hf_gpt2(untransposed), idx, targets)[0], want.loss)
