"""The loss contract (docs/LOSS.md): whatever the layout and whatever is masked, a step's loss is the sum
of every counted target's loss over the whole global batch divided by the global count of counted
targets, and every gradient is that loss's; --loss-normalization microbatch is Megatron's default
instead, the mean of each microbatch's own mean, and equals its own serial definition.

The mask (contract_mask) is chosen to break every shortcut: with B = 8 and dp = 2, replica 0 counts
one target in all (its second microbatch none), replica 1 about 60% of its targets, and the first half
of two rows is masked, so 08's cp blocks count unequally too; with dp = 4 one replica counts nothing.

Tolerance: float64, max|a - b| / max|b| <= 1e-10 (conftest's TOL) on the losses and gradient norms of
3 AdamW steps with clipping active: layouts only reorder additions (a few ulps). Averaging the replicas
with 1/dp instead is off by O(1) here (the first row of docs/LOSS.md's table, tested below), and a
gradient scaled by a constant (cp halving it, Megatron #7513) moves the norms by that factor.
"""
import contextlib
import dataclasses
import os
from dataclasses import replace

import pytest
import torch

from conftest import TOL, TRAINER_BASE, TRAINER_CFG, load, trainer_grad_diffs
from plumbing import data

tensor_parallel = load("01_tensor_parallel")
data_parallel = load("04_data_parallel")
gpt3d = load("05_3d_gpt")
zb = load("06_zero_bubble")
vp = load("07_vocab_parallel")
cpar = load("08_context_parallel")
moe = load("09_expert_parallel")

BASE = replace(TRAINER_BASE, steps=3)


def contract_mask(targets, step, salt=0):
    """targets (B, T) with some set to -100: rows [0, B/4) count one target, rows [B/4, B/2) none, the
    first half of rows [B/2, 3B/4) none, and about 40% of the rest are dropped at random."""
    B, T = targets.shape
    g = torch.Generator().manual_seed(1000 + 2 * step + salt)
    out = targets.clone()
    out[torch.rand(B, T, generator=g) < 0.4] = -100
    q = B // 4
    out[:2 * q] = -100
    out[0, T // 2] = targets[0, T // 2]
    out[2 * q:3 * q, :T // 2] = -100
    return out


def masked_replica_batch(tokens, step, tc, dp_rank, salt=0):
    idx, targets = data.global_batch(tokens, step, tc, salt)
    return idx.chunk(tc.dp)[dp_rank], contract_mask(targets, step, salt).chunk(tc.dp)[dp_rank]


def serial(tc, mode="token", parts=1, empty_steps=()):
    """tc.steps AdamW steps of the serial model on the masked global batches. token: its loss is the
    batch's per-token mean (01's head); microbatch: the mean of the means of the batch's `parts` row
    chunks (dp m of them), a chunk with no counted target counting 0. A step in empty_steps has every
    target masked: no update."""
    train_tokens, _ = data.split_tokens(data.load_tokens(tc.data, TRAINER_CFG.vocab_size, tc.seq_len), tc.seq_len)
    model = tensor_parallel.GPT(TRAINER_CFG, None, seed=tc.seed, dtype=torch.float64)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": gpt3d.no_decay(params), "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95), weight_decay=tc.weight_decay)
    losses, norms = [], []
    for step in range(tc.steps):
        if step in empty_steps:
            losses.append(0.0)
            norms.append(0.0)
            continue
        idx, targets = data.global_batch(train_tokens, step, tc)
        targets = contract_mask(targets, step)
        if mode == "token":
            loss = model(idx, targets)[1]
        else:
            loss = sum(model(i, t)[1] for i, t in zip(idx.chunk(parts), targets.chunk(parts))) / parts
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)))
        for group in opt.param_groups:
            group["lr"] = gpt3d.lr_at(step, tc)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


TRAINERS = {"05": (gpt3d.train, gpt3d.TrainConfig), "06": (zb.train, zb.TrainConfig), "07": (vp.train, vp.TrainConfig),
            "08": (cpar.train, cpar.TrainConfig), "09": (moe.train, moe.TrainConfig)}


def config(chapter, **kw):
    return TRAINERS[chapter][1](**{**dataclasses.asdict(BASE), **({"cp": 1} if chapter in ("08", "09") else {}), **kw})


def _train_masked(env, cases):
    """Each (chapter, flags) trained on the masked batches: its (losses, norms)."""
    gpt3d.replica_batch = masked_replica_batch  # this forked rank's 05 reads its batches so
    out = []
    for chapter, kw in cases:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            run = TRAINERS[chapter][0](env, TRAINER_CFG, config(chapter, **kw), quiet=True)
        out.append((run["losses"], run["norms"]))
    return out


def world(kw):
    return kw.get("tp", 1) * kw.get("pp", 1) * kw.get("dp", 1) * kw.get("cp", 1)


# Every layout and chapter the contract covers, each on its own world size (grouped in one launch).
LAYOUTS = [
    ("05", dict(dp=2)), ("05", dict(dp=2, zero1=True)), ("05", dict(tp=2, sequence_parallel=True)),
    ("05", dict(pp=2, microbatches=4)), ("05", dict(tp=2, recompute="full")), ("05", dict(dp=4)),
    ("05", dict(pp=2, dp=2, virtual_stages=2)), ("05", dict(tp=2, dp=2, recompute="selective")),
    ("06", dict(pp=2, dp=2, schedule="zb-h1")), ("06", dict(pp=2, schedule="zb-v")),
    ("06", dict(pp=2, microbatches=4, schedule="v-half")), ("06", dict(pp=2, dp=2, microbatches=4, schedule="v-min")),
    ("06", dict(pp=2, microbatches=4, schedule="dualpipev")),
    ("07", dict(pp=2, dp=2)), ("07", dict(tp=2, pp=2, vocab_barriers=1, schedule="zb-h1")),
    ("08", dict(cp=2, dp=2)), ("08", dict(cp=2, dp=2, cp_schedule="contiguous")),
    ("08", dict(cp=2, dp=2, cp_schedule="lightseq")),
    ("08", dict(cp=2, dp=2, cp_attention="ulysses")), ("08", dict(cp=4, microbatches=1)),
    ("08", dict(cp=2, pp=2, recompute="lightseq")),
]
WORLDS = sorted({world(kw) for _, kw in LAYOUTS})
IDS = [f"world {w}" for w in WORLDS]


@pytest.fixture(scope="module")
def serial_token():
    return serial(BASE)


@pytest.mark.grid(keep=["world 4"])
@pytest.mark.parametrize("size", WORLDS, ids=IDS)
def test_every_layout_trains_on_the_global_per_token_mean_with_unequal_counts(run_ranks, serial_token, size):
    cases = [(c, kw) for c, kw in LAYOUTS if world(kw) == size]
    want = torch.tensor(serial_token[0] + serial_token[1])
    assert serial_token[1][0] > BASE.grad_clip  # clipping acts: the norm's size matters
    for (chapter, kw), (losses, norms) in zip(cases, run_ranks(_train_masked, size, cases)[0]):
        assert tensor_parallel.max_rel_diff(torch.tensor(losses + norms), want) <= TOL, (chapter, kw, losses, want)


MICRO = [("05", dict(dp=2)), ("05", dict(pp=2, dp=2, zero1=True)), ("08", dict(cp=2, dp=2)),
         ("07", dict(pp=2, dp=2))]


def test_microbatch_normalization_equals_its_serial_definition_the_mean_of_the_microbatch_means(run_ranks):
    cases = [(c, {**kw, "loss_normalization": "microbatch"}) for c, kw in MICRO]
    got = run_ranks(_train_masked, 4, [x for x in cases if world(x[1]) == 4])[0]
    got = run_ranks(_train_masked, 2, [x for x in cases if world(x[1]) == 2])[0] + got
    ordered = [x for x in cases if world(x[1]) == 2] + [x for x in cases if world(x[1]) == 4]
    token = serial(BASE)
    for (chapter, kw), (losses, norms) in zip(ordered, got):
        parts = kw.get("dp", 1) * BASE.microbatches
        want = serial(BASE, "microbatch", parts)
        assert tensor_parallel.max_rel_diff(torch.tensor(losses + norms), torch.tensor(want[0] + want[1])) <= TOL, \
            (chapter, kw)
        assert abs(losses[0] - token[0][0]) > 0.01  # the two modes differ on this mask: the test tells them apart


def _masked_experts(env, layouts, counts_all=False):
    gpt3d.replica_batch = masked_replica_batch
    out = []
    base = replace(EXPERTS, aux_loss_counts_all=counts_all)
    for kw in layouts:
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            run = moe.train(env, TRAINER_CFG_MOE, replace(base, **kw), quiet=True)
        out.append(run["losses"] + run["norms"])
    return out


TRAINER_CFG_MOE = tensor_parallel.GPTConfig(vocab_size=256, block_size=16, n_layer=4, n_head=2, n_embd=16)
EXPERTS = moe.TrainConfig(**{**dataclasses.asdict(BASE), "cp": 1, "num_experts": 4, "top_k": 2, "moe_every": 2,
                             "aux_loss_coeff": 0.1, "warmup_steps": 1})


def test_experts_train_on_the_per_token_mean_and_an_aux_loss_over_the_counted_tokens(run_ranks):
    """09 at ep 2 (over dp, and over cp with 08) equals 09 at ep 1 on one rank with the same dp m
    microbatches: the LM loss is the global per-token mean, and each microbatch's auxiliary loss is
    over its counted tokens, 1/(dp m) of the step's (the serial model's, by the same rule)."""
    layouts = [dict(pp=2, dp=2, ep=2), dict(cp=2, dp=2, ep=4, zero1=True), dict(tp=2, dp=2, ep=2, sequence_parallel=True)]
    got = run_ranks(_masked_experts, 4, layouts)[0]
    want, everyone = run_ranks(_masked_experts, 1, [dict(microbatches=4)])[0][0], \
        run_ranks(_masked_experts, 1, [dict(microbatches=4)], True)[0][0]
    for kw, g in zip(layouts, got):
        assert tensor_parallel.max_rel_diff(torch.tensor(g), torch.tensor(want)) <= TOL, (kw, g, want)
    assert tensor_parallel.max_rel_diff(torch.tensor(everyone), torch.tensor(want)) > 1e-6  # the mask matters


def _empty_step(env, tc):
    def batch(tokens, step, tc, dp_rank, salt=0):
        idx, targets = masked_replica_batch(tokens, step, tc, dp_rank, salt)
        return idx, targets.fill_(-100) if step == 1 else targets
    gpt3d.replica_batch = batch
    notes = []
    real = gpt3d.report.Progress.note
    gpt3d.report.Progress.note = lambda self, text: notes.append(text) or real(self, text)
    run = gpt3d.train(env, TRAINER_CFG, tc, quiet=True)
    return run["losses"], run["norms"], run["skipped"], notes


def test_a_step_with_no_counted_target_anywhere_updates_nothing_and_says_so(run_ranks):
    tc = replace(BASE, dp=2, steps=3)
    losses, norms, skipped, notes = run_ranks(_empty_step, 2, tc)[0]
    want = serial(tc, empty_steps=(1,))
    assert tensor_parallel.max_rel_diff(torch.tensor(losses + norms), torch.tensor(want[0] + want[1])) <= TOL
    said = [n for n in notes if "no target of the global batch is counted" in n]
    assert len(said) == 1 and said[0].startswith("step 1:") and skipped == []


# ----------------------------------------------------------------------------------------------
# docs/LOSS.md's counterexamples: each row's two numbers (the contract's, the shortcut's) computed here


SMALL = tensor_parallel.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)


def _batch(B, seed):
    model = tensor_parallel.GPT(SMALL, None, seed=0, dtype=torch.float64)
    idx, targets = torch.randint(64, (2, B, 8), generator=torch.Generator().manual_seed(seed))
    return model, idx, targets


def _norm(model, loss):
    model.zero_grad()
    loss.backward()
    return float(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm())


def _both(model, idx, targets, parts):
    """(per-token loss, the parts' mean of means, their gradient norms): the contract's and the shortcut's."""
    token = model(idx, targets)[1]
    means = sum(model(i, t)[1] for i, t in zip(idx.chunk(parts), targets.chunk(parts))) / parts
    return token.item(), means.item(), _norm(model, token), _norm(model, means)


def _cp_one_token(env, full, idx, targets):
    import torch.distributed as dist
    model = cpar.context_parallel(tensor_parallel.GPT(SMALL, None, init=False, dtype=torch.float64),
                                  cpar.megatron(2), dist.group.WORLD)
    model.load_full_state_dict(full)
    _, loss = cpar.step(model, idx, targets, dist.group.WORLD, dist.group.WORLD)
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def counterexamples(run_ranks):
    """{row: (the contract's loss, the shortcut's[, their gradient norms])}, as docs/LOSS.md's table quotes them
    (cp one token: the loss, half of it, and cp 2's largest gradient difference from serial's)."""
    rows = {}
    model, idx, targets = _batch(4, 0)  # global batch 4 x 8, dp 2: replica 0 counts 2 targets, replica 1 16
    targets[:2] = -100
    targets[0, :2] = idx[0, 1:3]
    rows["2 vs 16"] = _both(model, idx, targets, 2)
    model, idx, targets = _batch(2, 1)  # cp 2 (Megatron's split), one counted target, in rank 0's block
    targets.fill_(-100)[0, 1] = 5
    full = tensor_parallel.init_state_dict(SMALL, 0, dtype=torch.float64, random_all=True)
    model = tensor_parallel.GPT(SMALL, None, init=False, dtype=torch.float64)
    model.load_full_state_dict(full)
    ref = model(idx, targets)[1]
    ref.backward()
    (loss, grads), _ = run_ranks(_cp_one_token, 2, full, idx, targets)
    worst = max(tensor_parallel.max_rel_diff(grads[n], p.grad) for n, p in model.named_parameters())
    rows["cp one token"] = (loss, ref.item() / 2, worst)  # each rank over its own count, averaged: half
    model, idx, targets = _batch(4, 2)  # m 2: microbatch 0 counts 1 target, microbatch 1 all 16
    targets[:2] = -100
    targets[0, 3] = idx[0, 4]
    rows["microbatches 1 vs 16"] = _both(model, idx, targets, 2)
    model, idx, targets = _batch(8, 3)  # dp 4: replica 1 counts nothing
    targets[2:4] = -100
    rows["all-masked replica"] = _both(model, idx, targets, 4)
    g = torch.Generator().manual_seed(0)  # the aux loss: 12 tokens, 5 of them padding (target -100)
    probs = torch.rand(12, 4, generator=g, dtype=torch.float64).softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    keep = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1], dtype=torch.bool)
    rows["aux with padding"] = (moe.load_balancing_loss(probs, chosen, None, keep).item(),
                                moe.load_balancing_loss(probs, chosen, None).item())
    return rows


@pytest.fixture(scope="module")
def rows():
    from plumbing.launch import launch
    return counterexamples(lambda body, n, *args: launch(body, n, *args, timeout_s=60))


def test_loss_md_each_counterexample_differs_and_cp_with_one_token_is_exact(rows):
    for name, (ours, shortcut, *norms) in rows.items():
        assert abs(ours - shortcut) > 1e-4 * abs(ours), name
        if len(norms) == 2:  # the gradients differ more than the losses of a model near uniform
            assert abs(norms[0] - norms[1]) > 0.05 * norms[0], name
    assert rows["cp one token"][2] <= TOL  # every gradient of cp 2 equals serial's, not half of it


def test_the_aux_loss_over_a_mask_is_the_aux_loss_of_the_counted_tokens_alone():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(12, 4, generator=g, dtype=torch.float64).softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    keep = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1], dtype=torch.bool)
    masked = moe.load_balancing_loss(probs, chosen, None, keep)
    alone = moe.load_balancing_loss(probs[keep], chosen[keep], None)
    assert torch.allclose(masked, alone, rtol=1e-14, atol=0)
    assert float(moe.load_balancing_loss(probs, chosen, None, torch.zeros(12, dtype=torch.bool))) == 0.0


def test_loss_md_quotes_each_row_and_names_the_functions(rows):
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "LOSS.md"), encoding="utf-8").read()
    for name, (ours, shortcut, *norms) in rows.items():
        assert f"{ours:.5f}" in text and f"{shortcut:.5f}" in text, (name, ours, shortcut)
        if len(norms) == 2:
            assert f"{norms[0]:.4f}" in text and f"{norms[1]:.4f}" in text, (name, norms)
    for name in ("normalization", "shared_loss", "load_balancing_loss", "Executor.output", "--loss-normalization",
                 "evaluate", "train_step"):
        assert name in text, name


def test_04s_demo_masks_its_replicas_unevenly_and_passes():
    args = data_parallel.DemoConfig(steps=1)
    cfg = tensor_parallel.GPTConfig(vocab_size=101, block_size=32, n_layer=1, n_head=2, n_embd=16)
    batches = data_parallel.training_reference(cfg, args)[0]
    counts = [int((t != -100).sum()) for t in batches[0][1].chunk(args.dp)]
    assert counts[0] == 1 and len(set(counts)) == args.dp
    assert int((batches[0][1].chunk(args.dp)[1].chunk(args.microbatches)[0] != -100).sum()) == 0


# ----------------------------------------------------------------------------------------------
# The trainer as a user runs it: --loss-mask on a data file, the losses read back from --metrics


def _masked_data(folder):
    """A text file of 6,000 random bytes and its mask: about half of the targets not counted, in runs
    (a prompt's worth at a time) and one long run, so that replicas and cp blocks count unequally."""
    g = torch.Generator().manual_seed(7)
    text, mask = os.path.join(folder, "d.txt"), os.path.join(folder, "d.mask")
    with open(text, "wb") as f:
        f.write(bytes(torch.randint(32, 127, (6000,), generator=g).tolist()))
    keep = (torch.rand(6000 // 8, generator=g) < 0.5).repeat_interleave(8)
    keep[1000:1400] = False
    with open(mask, "wb") as f:
        f.write(bytes(keep.to(torch.uint8).tolist()))
    return text, mask


SMALL_RUN = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--vocab-size", "256", "--block-size", "16",
             "--seq-len", "16", "--batch-size", "8", "--steps", "4", "--lr", "1e-2", "--warmup-steps", "1",
             "--dtype", "float64", "--eval-every", "2", "--eval-batches", "2", "--tp", "1", "--pp", "1", "--no-check"]


def _losses(tmp_path, script, name, *flags):
    from conftest import run_script
    text, mask = _masked_data(tmp_path)
    metrics = tmp_path / f"{name}.jsonl"
    proc = run_script(script, *SMALL_RUN, "--data", text, "--loss-mask", mask, "--metrics", metrics, *flags,
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [__import__("json").loads(x) for x in metrics.read_text().splitlines()]
    return [x["loss"] for x in lines] + [x["grad_norm"] for x in lines] + [x["eval_loss"] for x in lines
                                                                          if "eval_loss" in x]


def test_the_trainer_with_a_loss_mask_at_dp_2_gives_dp_1s_losses_norms_and_eval_losses(tmp_path):
    one = _losses(tmp_path, "05_3d_gpt.py", "dp1", "--dp", "1", "--microbatches", "2")
    two = _losses(tmp_path, "05_3d_gpt.py", "dp2", "--dp", "2", "--microbatches", "1")
    assert len(one) == 4 + 4 + 2
    assert tensor_parallel.max_rel_diff(torch.tensor(two), torch.tensor(one)) <= 1e-9, (one, two)


def test_microbatch_normalization_from_the_command_line_at_dp_2_gives_dp_1_with_the_same_microbatches(tmp_path):
    flags = ("--loss-normalization", "microbatch")
    one = _losses(tmp_path, "05_3d_gpt.py", "dp1", "--dp", "1", "--microbatches", "4", *flags)
    two = _losses(tmp_path, "05_3d_gpt.py", "dp2", "--dp", "2", "--microbatches", "2", *flags)
    token = _losses(tmp_path, "05_3d_gpt.py", "token", "--dp", "1", "--microbatches", "4")
    assert tensor_parallel.max_rel_diff(torch.tensor(two), torch.tensor(one)) <= 1e-9, (one, two)
    assert abs(one[0] - token[0]) > 1e-3  # a different loss: the flag reached the trainer


def test_08s_trainer_with_a_loss_mask_at_cp_2_gives_cp_1s_losses(tmp_path):
    one = _losses(tmp_path, "08_context_parallel.py", "cp1", "--train", "--cp", "1", "--dp", "1")
    two = _losses(tmp_path, "08_context_parallel.py", "cp2", "--train", "--cp", "2", "--dp", "1")
    assert tensor_parallel.max_rel_diff(torch.tensor(two), torch.tensor(one)) <= 1e-9, (one, two)


# ----------------------------------------------------------------------------------------------
# Every gradient, not only their norm: one step of the trainer's own pieces against serial's


def _step_grads(env, cases):
    """For each (chapter, flags): this rank's gradients after one masked step (train_step's pieces, before
    clipping) against the serial model's, {name: relative difference}."""
    g = torch.Generator().manual_seed(11)
    idx, targets = torch.randint(TRAINER_CFG.vocab_size, (2, BASE.batch_size, BASE.seq_len), generator=g)
    targets = contract_mask(targets, 0)
    full = tensor_parallel.init_state_dict(TRAINER_CFG, BASE.seed, dtype=torch.float64)
    serial_model = tensor_parallel.GPT(TRAINER_CFG, init=False, dtype=torch.float64)
    serial_model.load_full_state_dict(full)
    serial_model(idx, targets)[1].backward()
    ref = {n: p.grad for n, p in serial_model.named_parameters()}
    out = []
    for chapter, kw in cases:
        tc = config(chapter, **kw)
        pipe = cpar.context_schedule(tc) if chapter == "08" else gpt3d.interleaved_schedule(tc)
        groups = gpt3d.new_groups(env, pipe.grid(env.world_size, tc.tp, tc.dp))
        run = gpt3d.build(env, TRAINER_CFG, tc, groups, pipe)
        r = pipe.replica(groups)
        rows = idx.chunk(tc.dp)[r], targets.chunk(tc.dp)[r]
        valid = [int((t != -100).sum()) for t in rows[1].chunk(tc.microbatches)]
        norm, _ = gpt3d.normalization(run, valid)
        gpt3d.forward_backward(run, gpt3d.pipeline.split_batch(*rows, tc.microbatches), valid, norm)
        gpt3d.pipeline.sync_tied_embeddings(run.chunks, groups.embed, grad_of=run.ddp.main_grad)
        run.ddp.finish()
        out.append(trainer_grad_diffs(run, ref, tc.zero1))
    return out


GRADS = [("05", dict(dp=4)), ("05", dict(tp=2, dp=2, sequence_parallel=True)), ("05", dict(pp=2, dp=2, zero1=True)),
         ("08", dict(cp=2, dp=2)), ("08", dict(cp=2, dp=2, cp_attention="ulysses", zero1=True))]


def test_every_gradient_of_one_masked_step_is_the_serial_per_token_means(run_ranks):
    for rank in run_ranks(_step_grads, 4, GRADS):
        for case, diffs in zip(GRADS, rank):
            bad = {k: d for k, d in diffs.items() if not d <= TOL}
            assert not bad and len(diffs) > 1, (case, bad)
