"""The serial references, each on one serial GPT-2 (01's GPT with no tp group): pipeline_reference, what
02's, 03's, 06's and 07's demos compare against (one batch's loss and gradients, float64); serial_train,
what the tests hold 05's trainer to at every layout (the same data, learning-rate schedule and optimizer,
in the config's dtype: the tests give float64). It is the correct answer, not part of the concept, so it
lives here."""
import importlib

import torch

from plumbing.data import global_batch, load_tokens, split_tokens


def pipeline_reference(cfg, args, m, device, unequal=False):
    """What 02's, 03's, 06's and 07's demos compare against: the batch (args.batch_size x args.seq_len
    random tokens from args.seed) cut into m microbatches, the full float64 weights, and the serial
    model's loss and gradients on that batch: (microbatches, full, loss, {name: grad}). unequal
    (each of those demos passes it): the microbatches count unequal numbers of targets (unequal_counts)."""
    tensor_parallel = importlib.import_module("01_tensor_parallel")
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx, targets = torch.randint(cfg.vocab_size, (2, args.batch_size, args.seq_len), generator=gen).to(device)
    if unequal:
        unequal_counts(targets, m)
    full = tensor_parallel.init_state_dict(cfg, args.seed, dtype=torch.float64, random_all=True)
    serial = tensor_parallel.GPT(cfg, None, init=False, dtype=torch.float64, device=device)
    serial.load_full_state_dict(full)
    loss = serial(idx, targets)[1]
    loss.backward()
    micro = list(zip(idx.chunk(m), targets.chunk(m)))
    return micro, full, loss.detach(), {n: p.grad for n, p in serial.named_parameters()}


def unequal_counts(targets, m, ignore_index=-100):
    """Mask targets (B, T), in place, so that its m microbatches of B/m rows count unequal numbers:
    microbatch 0 none (when m > 1), the last one half its first row fewer than the others."""
    rows = targets.shape[0] // m
    if m > 1:
        targets[:rows] = ignore_index
    targets[(m - 1) * rows, : targets.shape[1] // 2] = ignore_index
    return targets


def serial_train(cfg, tc):
    """tc.steps AdamW steps of the serial model in tc.dtype: {"losses": [...], "norms": [...]}."""
    tensor_parallel = importlib.import_module("01_tensor_parallel")
    gpt3d = importlib.import_module("05_3d_gpt")  # at call time: 05 imports plumbing
    dtype = getattr(torch, tc.dtype)
    tokens = load_tokens(tc.data, cfg.vocab_size, tc.seq_len, getattr(tc, "loss_mask", ""))  # its mask too, if any
    train_tokens, _ = split_tokens(tokens, tc.seq_len, tc.data)
    model = tensor_parallel.GPT(cfg, None, seed=tc.seed, dtype=dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": gpt3d.no_decay(params), "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    losses, norms = [], []
    for step in range(tc.steps):
        idx, targets = global_batch(train_tokens, step, tc)
        loss = model(idx, targets)[1]
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)))
        for g in opt.param_groups:
            g["lr"] = gpt3d.lr_at(step, tc)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, norms=norms)
