"""megatron_scratch.reference's functions for 04, 05, 08 and 09 (issue 42, point 2), each against the
serial model in float64: pipeline_loss_and_grads (02's and 03's schedules), reference_training (04's
three modes, through 04's own serial_training and train_replica), gpt3d_training (05's machine; step 0's
gradients before clipping, ZeRO-1's gathered from its shards), cp_loss_and_grads (08's ring), moe_layer
(09's layer; its serial form against a formula written here).

Tolerances: megatron_scratch.testing's float64 defaults (rtol 1e-10, atol 1e-12; its docstring): a
layout only reorders the sums, ~1e-15 relative, even after a few AdamW steps (Adam's update divides by
sqrt(v), which keeps a relative error of the gradients the same size in the weights). A planted
mistake in each (another weight decay, a wrong betas, a target moved, an expert's weight perturbed)
is off by 1e-6 or more, and fails. Cost: about 8 s on 2 cores (eleven gloo runs of 2 to 4 ranks).
"""
import pytest
import torch
import torch.nn.functional as F

from megatron_scratch import reference
from megatron_scratch.testing import assert_close, compare_state

CFG = reference.gpt_config(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=16)


def _batches(steps, B=4, T=8, seed=3):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens, targets = torch.randint(CFG.vocab_size, (2, B, T), generator=gen)
        targets[0, :5] = -100  # replica 0 counts fewer targets than replica 1
        out.append((tokens, targets))
    return out


def test_reference_training_runs_04s_three_modes_to_serial_trainings_losses_and_weights():
    full, batches = reference.init_weights(CFG, seed=1), _batches(2)
    adamw = dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05)
    serial = reference.reference_training(CFG, full, batches, mode="serial", **adamw)
    assert len(serial.losses) == 2 and serial.losses[0] != serial.losses[1]
    assert abs(serial.losses[0] - reference.serial_loss_and_grads(CFG, full, *batches[0]).loss.item()) < 1e-15
    for mode in ("naive", "bucketed", "zero1"):
        got = reference.reference_training(CFG, full, batches, mode=mode, dp=2, microbatches=2, bucket_numel=700, **adamw)
        assert_close(torch.tensor(got.losses), torch.tensor(serial.losses), name=f"{mode} losses")
        compare_state(got.weights, serial.weights)
    # planted: another weight decay, or betas, moves the weights beyond the tolerance
    for planted in (dict(adamw, weight_decay=0.06), dict(adamw, betas=(0.9, 0.99))):
        other = reference.reference_training(CFG, full, batches, mode="serial", **planted)
        with pytest.raises(AssertionError, match="entries differ"):
            compare_state(got.weights, other.weights)


def _serial_05(full, batches, lr, weight_decay):
    """05's recipe written here: torch's AdamW, betas (0.9, 0.95), decay on the 2-D weights only."""
    model = reference._serial(CFG, full)
    ps = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2]},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    losses = []
    for tokens, targets in batches:
        loss = model(tokens, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def test_gpt3d_training_at_pp_2_dp_2_with_zero1_equals_serial():
    # its gradients at tp 2 x pp 2 x dp 2 are tests/test_golden_layouts.py's (a golden directory's run)
    full, batches = reference.init_weights(CFG, seed=2), _batches(2)
    got = reference.gpt3d_training(CFG, full, batches, pp=2, dp=2, microbatches=2, zero1=True, lr=1e-2)
    losses, weights = _serial_05(full, batches, 1e-2, 0.1)
    assert_close(torch.tensor(got.losses), torch.tensor(losses))
    compare_state(got.weights, weights)
    grads = reference.serial_loss_and_grads(CFG, full, *batches[0]).grads
    norm = torch.cat([g.reshape(-1) for g in grads.values()]).norm().item()
    assert abs(got.grad_norms[0] - norm) <= 1e-12 * norm  # every element counted once
    compare_state(got.grads, grads)  # ZeRO-1's shards, gathered over dp: every gradient, full shapes
    with pytest.raises(AssertionError, match="entries differ"):  # planted: 05's decay is not 0.2
        compare_state(got.weights, _serial_05(full, batches, 1e-2, 0.2)[1])
    # planted: each replica's mean averaged (replica 0 counts fewer targets), or one replica's own mean alone
    halves = [reference.serial_loss_and_grads(CFG, full, a, b).grads for a, b in zip(*(t.chunk(2) for t in batches[0]))]
    for wrong in ({n: (halves[0][n] + halves[1][n]) / 2 for n in grads}, halves[0]):
        with pytest.raises(AssertionError, match="entries differ"):
            compare_state(got.grads, wrong)


@pytest.mark.parametrize("zero1", [False, True])
def test_gpt3d_trainings_gradients_are_the_losss_before_clipping(zero1):
    full, batches = reference.init_weights(CFG, seed=2), _batches(1)
    got = reference.gpt3d_training(CFG, full, batches, dp=2, microbatches=2, zero1=zero1, grad_clip=1e-3)
    want = reference.serial_loss_and_grads(CFG, full, *batches[0]).grads
    compare_state(got.grads, want)  # the norm is ~0.76: clipped to 1e-3, every gradient would be ~760 x smaller
    assert got.grad_norms[0] > 100 * 1e-3


@pytest.mark.parametrize("schedule, pp, m, v", [("1f1b", 2, 4, 1), ("interleaved", 2, 4, 2)])
def test_pipeline_loss_and_grads_equals_serial_with_microbatches_counting_unequally(schedule, pp, m, v):
    cfg = reference.gpt_config(vocab_size=61, block_size=16, n_layer=4, n_head=4, n_embd=16)
    full, ((tokens, targets),) = reference.init_weights(cfg, seed=7), _batches(1)
    targets[1, 2:] = -100  # the 4 microbatches count 3, 2, 8 and 8 targets
    serial = reference.serial_loss_and_grads(cfg, full, tokens, targets)
    got = reference.pipeline_loss_and_grads(cfg, full, tokens, targets, pp=pp, microbatches=m, schedule=schedule,
                                            virtual_stages=v)
    assert_close(got.loss, serial.loss)
    compare_state(got.grads, serial.grads)
    from megatron_scratch import to_torch_order
    assert [str(a) for a in to_torch_order(got.lists)[0][:2]] == ["0F0", "0F1"]  # torch's IR of what ran
    # planted: the mean of the microbatches' means (torch's and Megatron's default), not the batch's mean
    means = [reference.serial_loss_and_grads(cfg, full, a, b) for a, b in zip(tokens.chunk(m), targets.chunk(m))]
    with pytest.raises(AssertionError, match="entries differ"):
        compare_state(got.grads, {n: sum(r.grads[n] for r in means) / m for n in full})


@pytest.mark.parametrize("split", ["megatron", "lightseq"])
def test_cp_loss_and_grads_equals_serial(split):
    full, ((tokens, targets),) = reference.init_weights(CFG, seed=4), _batches(1, B=2, T=8)
    serial = reference.serial_loss_and_grads(CFG, full, tokens, targets)
    got = reference.cp_loss_and_grads(CFG, full, tokens, targets, cp=2, split=split)
    assert_close(got.loss, serial.loss)
    assert_close(got.logits, serial.logits)
    compare_state(got.grads, serial.grads)
    moved = targets.clone()
    moved[1, 7] = (moved[1, 7] + 1) % CFG.vocab_size  # planted: one target, on the last block
    with pytest.raises(AssertionError):
        compare_state(reference.serial_loss_and_grads(CFG, full, tokens, moved).grads, got.grads)


def _moe_by_formula(w, x, E, k, dy):
    """The MoE layer written out: every expert on every token, weighted by its renormalised top-k
    probability (0 for an expert not chosen); autograd for the gradients."""
    w = {n: t.clone().requires_grad_(True) for n, t in w.items()}
    x = x.clone().requires_grad_(True)
    probs = F.softmax(x @ w["router.weight"].T, -1)
    top, chosen = probs.topk(k, -1)
    gate = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
    y = sum(gate[..., e:e + 1] * F.linear(F.gelu(F.linear(x, w[f"experts.{e}.c_fc.weight"], w[f"experts.{e}.c_fc.bias"]),
                                                 approximate="tanh"), w[f"experts.{e}.c_proj.weight"],
                                          w[f"experts.{e}.c_proj.bias"]) for e in range(E))
    (y * dy).sum().backward()
    return y.detach(), x.grad, {n: t.grad for n, t in w.items()}


def test_moe_layer_serially_is_the_formula_and_at_ep_2_equals_serial():
    E, k = 4, 2
    weights = reference.moe_weights(CFG, num_experts=E, seed=5)
    x = torch.randn(4, 6, CFG.n_embd, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    serial = reference.moe_layer(CFG, weights, x, num_experts=E, top_k=k)
    dy = torch.cos(0.7 * torch.arange(x.numel(), dtype=x.dtype)).reshape(x.shape)
    y, xg, grads = _moe_by_formula(weights, x, E, k, dy)
    assert_close(serial.y, y)
    assert_close(serial.x_grad, xg)
    compare_state(serial.grads, grads)
    assert 1.0 <= serial.aux.item() < E / k  # Switch's loss: 1 when the load is even, below E / k
    par = reference.moe_layer(CFG, weights, x, num_experts=E, top_k=k, ep=2)
    assert_close(par.y, serial.y)
    assert_close(par.x_grad, serial.x_grad)
    compare_state(par.grads, serial.grads)
    planted = dict(weights, **{"experts.3.c_fc.weight": weights["experts.3.c_fc.weight"] * (1 + 1e-6)})
    with pytest.raises(AssertionError, match="experts.3"):
        compare_state(reference.moe_layer(CFG, planted, x, num_experts=E, top_k=k).grads, serial.grads)


def test_the_chapters_references_refuse_bad_arguments_naming_them():
    full, batches = reference.init_weights(CFG), _batches(1)
    with pytest.raises(ValueError, match=r"reference_training: mode='fsdp' must be one of serial, naive, bucketed, zero1"):
        reference.reference_training(CFG, full, batches, mode="fsdp")
    with pytest.raises(ValueError, match=r"batches\[0\]: .* B divisible by dp x microbatches = 3 x 1"):
        reference.reference_training(CFG, full, batches, dp=3)
    with pytest.raises(ValueError, match=r"gpt3d_training: n_layer=2 must be divisible by pp x virtual_stages = 4 x 1"):
        reference.gpt3d_training(CFG, full, _batches(1, B=8), pp=4)
    with pytest.raises(ValueError, match=r"pipeline_loss_and_grads: schedule='zb' must be one of gpipe, 1f1b, interleaved"):
        reference.pipeline_loss_and_grads(CFG, full, *batches[0], schedule="zb")
    with pytest.raises(ValueError, match=r"n_layer=2 must divide by pp x virtual_stages = 2 x 2"):
        reference.pipeline_loss_and_grads(CFG, full, *batches[0], schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match=r"cp_loss_and_grads: split='ring' must be one of"):
        reference.cp_loss_and_grads(CFG, full, *batches[0], split="ring")
    with pytest.raises(ValueError, match=r"T divisible by 8 \(the megatron split's blocks at cp=4\)"):
        reference.cp_loss_and_grads(CFG, full, *_batches(1, T=12)[0], cp=4)
    w = reference.moe_weights(CFG, num_experts=4)
    with pytest.raises(ValueError, match=r"moe_layer: top_k=5 must be at most num_experts=4"):
        reference.moe_layer(CFG, w, torch.zeros(2, 3, CFG.n_embd, dtype=torch.float64), num_experts=4, top_k=5)
