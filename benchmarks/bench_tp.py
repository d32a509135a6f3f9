"""Tensor-parallel step time: our GPT-2 (01_tensor_parallel.py) against PyTorch's DTensor TP.

One training step without the optimizer of the same GPT-2 at tp=2 on gloo CPU ranks: 01's
GPT against a plain model parallelized with DTensor as torchtitan does (loss_parallel).
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; CPU only, it starts its own ranks):
    python benchmarks/bench_tp.py
    python benchmarks/bench_tp.py --serial       # also time tp=1: the no-communication floor
    python benchmarks/bench_tp.py --profile      # also print where each spends its time (rank 0)
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)

import harness
from harness import rel, tensor_parallel

# float32, and the sharded sums run in a different order than the serial ones; a real mistake
# (an untied or misplaced weight) shows up at 1e-2 or more. Gradients: max |a - b| / max |b|.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


# ----------------------------------------------------------------------------------------------
# The peer's serial model (bench_3d's stages too): plain nn.Linear / nn.Embedding / nn.LayerNorm,
# which is what parallelize_module knows how to shard. Parameter names are 01's without the
# "transformer." prefix, so one full state dict fits both.


class PeerBlock(nn.Module):
    """A GPT-2 block. `qkv="fused"` keeps one c_attn GEMM like ours, with its rows stored
    head-major (nh, 3, hs), Megatron's layout, so that a contiguous Shard(0) gives each rank whole
    heads with their q, k and v. `qkv="split"` uses three Linears q, k, v, as torchtitan's Llama."""

    def __init__(self, cfg, qkv):
        super().__init__()
        C, self.hs = cfg.n_embd, cfg.n_embd // cfg.n_head
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(C, 3 * C)} if qkv == "fused" else
                                  {m: nn.Linear(C, C) for m in "qkv"})
        self.attn["c_proj"] = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(C, 4 * C), "c_proj": nn.Linear(4 * C, C)})

    def forward(self, x):
        h, attn = self.ln_1(x), self.attn
        # Under TP the column-parallel outputs are local tensors holding nh/tp heads; the head
        # count is read off the shape, so the same code runs serial and sharded.
        if "c_attn" in attn:
            q, k, v = rearrange(attn.c_attn(h), "B T (nh three hs) -> three B nh T hs", three=3, hs=self.hs)
        else:
            q, k, v = (rearrange(attn[m](h), "B T (nh hs) -> B nh T hs", hs=self.hs) for m in "qkv")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.c_proj(rearrange(y, "B nh T hs -> B T (nh hs)"))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class PeerStage(nn.Module):
    """The blocks `layers` of a serial GPT-2 (no dropout), with the embeddings on the first stage
    and ln_f and the output layer on the last. The output layer is a copy of wte (as Megatron's
    last stage holds one) until tie() makes it wte itself. Returns the hidden state, or on the last
    stage the logits: the loss is the caller's (torch's schedule applies its loss_fn to them)."""

    def __init__(self, cfg, layers, first=True, last=True, qkv="fused"):
        super().__init__()
        self.first, self.last, self.hs = first, last, cfg.n_embd // cfg.n_head
        if first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleDict({str(i): PeerBlock(cfg, qkv) for i in layers})
        if last:
            self.ln_f = nn.LayerNorm(cfg.n_embd, eps=1e-5)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def tie(self):
        self.lm_head.weight = self.wte.weight

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.h.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x

    @torch.no_grad()
    def load_full(self, full):
        """Copy this stage's part of 01's full (serial) state dict in, c_attn in this layout."""
        for name, p in self.named_parameters():
            block, _, rest = name.partition(".attn.")
            module, _, kind = rest.partition(".")
            if module in ("q", "k", "v"):
                t = full[f"transformer.{block}.attn.c_attn.{kind}"].chunk(3)["qkv".index(module)]
            elif module == "c_attn":
                t = rearrange(full["transformer." + name], "(three nh hs) ... -> (nh three hs) ...",
                              three=3, hs=self.hs)
            else:
                t = full["transformer.wte.weight" if name == "lm_head.weight" else "transformer." + name]
            p.copy_(t)

    def full_grads(self):
        """The gradients under 01's names and layouts (load_full undone), for the check: q, k and v
        as one c_attn, as ours (the key bias's gradient alone is zero up to rounding)."""
        grads = {name: _full(p.grad) for name, p in self.named_parameters()}
        out = {}
        for name, g in grads.items():
            block, _, rest = name.partition(".attn.")
            module, _, kind = rest.partition(".")
            if module == "q":
                out[f"transformer.{block}.attn.c_attn.{kind}"] = torch.cat(
                    [grads[f"{block}.attn.{m}.{kind}"] for m in "qkv"])
            elif module == "c_attn":
                out["transformer." + name] = rearrange(g, "(nh three hs) ... -> (three nh hs) ...",
                                                       three=3, hs=self.hs)
            elif module not in ("k", "v"):
                out["transformer." + name] = g
        return out


def tp_plan(stage, loss="parallel"):
    """torchtitan's recipe without sequence parallelism: shard every Linear, keep norms replicated."""
    plan = {}
    if stage.first:
        # Same split as ours (01's VocabParallelEmbedding): every rank sees all token ids and owns
        # a slice of the vocab rows, so the lookups are partial sums that one all-reduce completes.
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if stage.last:
        # parallel: kept a vocab-sharded DTensor, for loss_parallel() needs to see that the logits
        # are sharded (or the cross-entropy would all-gather them); gathered: all-gathered into
        # plain replicated logits for a plain cross-entropy.
        parallel = loss == "parallel"
        plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Shard(-1) if parallel else Replicate(),
                                          use_local_output=not parallel)
    for i, block in stage.h.items():
        plan.update({f"h.{i}.attn.{m}": ColwiseParallel() for m in block.attn if m != "c_proj"})
        plan.update({f"h.{i}.attn.c_proj": RowwiseParallel(), f"h.{i}.mlp.c_fc": ColwiseParallel(),
                     f"h.{i}.mlp.c_proj": RowwiseParallel()})
    return plan


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------------------------
# One step of each: zero_grad, forward, loss, backward. Returns the loss.


def step_ours(model, idx, targets):
    model.zero_grad(set_to_none=True)
    _, loss = model(idx, targets)
    loss.backward()
    return loss


def step_peer(model, idx, targets):
    model.zero_grad(set_to_none=True)
    with loss_parallel():  # backward must run inside it too
        logits = model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    return loss


# ----------------------------------------------------------------------------------------------
# The worker: build both, check they compute the same function, then time them alternately.


def worker(env, cfg, args):
    group = tensor_parallel.new_tp_group(env, args.tp)
    mesh = init_device_mesh("cpu", (args.tp,))
    full, gen = harness.start(cfg, args.seed)
    idx = torch.randint(cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)
    targets = torch.randint(cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)

    serial, ours = harness.gpt(cfg, full), harness.gpt(cfg, full, group)
    peer = PeerStage(cfg, range(cfg.n_layer), qkv=args.peer_qkv)
    peer.load_full(full)
    parallelize_module(peer, mesh, tp_plan(peer))
    # Each style wraps its own module's weight in a new Parameter; both are Shard(0) over the
    # vocabulary on the same mesh, so sharing one DTensor ties them correctly.
    peer.tie()

    # Same function: the loss and every full gradient against the serial model.
    ref_loss = step_ours(serial, idx, targets).item()
    ref_grads = {name: p.grad for name, p in serial.named_parameters()}
    our_loss = step_ours(ours, idx, targets).item()
    our_grad = harness.worst_rel(ours.full_grads(), ref_grads)
    peer_loss = _full(step_peer(peer, idx, targets)).item()
    peer_grad = harness.worst_rel(peer.full_grads(), ref_grads)
    check = {"loss": (ref_loss, our_loss, peer_loss), "worst grad": (our_grad, peer_grad)}
    same = harness.agree(max(rel(x, ref_loss) for x in check["loss"]) <= LOSS_RTOL
                         and max(check["worst grad"]) <= GRAD_RTOL)
    if not same:
        return {"same": False, "check": check}

    steps = {"ours": lambda: step_ours(ours, idx, targets),
             "peer": lambda: step_peer(peer, idx, targets)}
    if args.serial:
        # Every rank runs the whole serial model on its one thread at the same time, so this is
        # the tp=1 step on an equally loaded machine; half of it is the no-communication floor.
        steps["serial"] = lambda: step_ours(serial, idx, targets)
    return {"same": True, "check": check,
            "tables": harness.profiles(steps, args.profile_rows) if args.profile else {},
            "rounds": harness.alternate(steps, args.repeats, args.steps, args.warmup)}


# ----------------------------------------------------------------------------------------------
# Command line and report.


def report(cfg, args, result):
    print(f"config: {cfg}")
    print(f"tp={args.tp} B={args.batch_size} T={args.seq_len} float32, tied embeddings, "
          f"peer qkv={args.peer_qkv}; torch {torch.__version__}, {args.tp} gloo ranks x 1 thread")
    (ref, o, p), (go, gp) = result["check"]["loss"], result["check"]["worst grad"]
    print("same function (rank 0), against the serial model:")
    print(f"  loss         serial {ref:.8f}  ours {o:.8f} ({rel(o, ref):.1e})  "
          f"peer {p:.8f} ({rel(p, ref):.1e})")
    print(f"  worst grad   ours {go:.1e}  peer {gp:.1e}  (max |g - g_serial| / max |g_serial|, "
          f"worst tensor)")
    if not harness.verdict(result["same"], f"loss {LOSS_RTOL:g} relative, gradients {GRAD_RTOL:g}"):
        return False
    rounds = result["rounds"]
    print(f"\n{harness.time_table(rounds, args.tp, f' (after {args.warmup} warm-up steps of each per round)')}")
    if "serial" in rounds[0]:
        print(f"  serial/2 (perfect tp=2 scaling, no communication): "
              f"{harness.median_of(rounds, 'serial') / 2 * 1e3:.2f}")
    print(harness.pair_line(rounds, "ours", "peer", goal=0.7))
    for table in result["tables"].values():
        print(table)
    return True


def main():
    parser = harness.parser(__doc__, repeats=7, steps=8, warmup=2, vocab_size=512, block_size=128,
                            n_layer=4, n_head=4, n_embd=256)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size = local CPU ranks")
    parser.add_argument("--batch-size", type=int, default=8, help="B")
    parser.add_argument("--seq-len", type=int, default=128, help="T")
    parser.add_argument("--peer-qkv", choices=["fused", "split"], default="fused",
                        help="peer attention input projection: one head-major GEMM or q, k, v Linears")
    parser.add_argument("--serial", action="store_true",
                        help="also time the tp=1 model on every rank (the no-communication floor)")
    args = parser.parse_args()
    cfg = harness.model_config(args)
    results = harness.launch(worker, args.tp, cfg, args, timeout_s=120.0, deadline_s=args.deadline)
    return report(cfg, args, results[0])


if __name__ == "__main__":
    harness.run_main(main)
