"""Tensor-parallel step time: our GPT-2 (01_tensor_parallel.py) against PyTorch's DTensor TP.

One training step without the optimizer of the same GPT-2 at tp=2 on gloo CPU ranks: 01's
GPT against a plain model parallelized with DTensor as torchtitan does (loss_parallel).
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; CPU only, it starts its own ranks):
    python benchmarks/bench_tp.py
    python benchmarks/bench_tp.py --repeats 9 --steps 8 --n-layer 6 --n-embd 384 --n-head 6
    python benchmarks/bench_tp.py --serial       # also time tp=1: the no-communication floor
    python benchmarks/bench_tp.py --profile      # also print where each spends its time (rank 0)
"""
import math

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
# The peer's serial model: plain nn.Linear / nn.Embedding / nn.LayerNorm, which is what
# parallelize_module knows how to shard. Parameter names match 01's GPT so one state dict fits both.


class PeerAttention(nn.Module):
    """Causal self-attention. `qkv="fused"` keeps one c_attn GEMM like ours, with its rows stored
    head-major (nh, 3, hs), Megatron's layout, so that a contiguous Shard(0) gives each rank whole
    heads with their q, k and v. `qkv="split"` uses three Linears q, k, v, as torchtitan's Llama."""

    def __init__(self, cfg, qkv):
        super().__init__()
        C = cfg.n_embd
        self.qkv, self.hs = qkv, C // cfg.n_head
        if qkv == "fused":
            self.c_attn = nn.Linear(C, 3 * C)
        else:
            self.q, self.k, self.v = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        # Under TP the column-parallel outputs are local tensors holding nh/tp heads; the head
        # count is read off the shape, so the same code runs serial and sharded.
        if self.qkv == "fused":
            q, k, v = rearrange(self.c_attn(x), "B T (nh three hs) -> three B nh T hs", three=3, hs=self.hs)
        else:
            q, k, v = (rearrange(m(x), "B T (nh hs) -> B nh T hs", hs=self.hs)
                       for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(rearrange(y, "B nh T hs -> B T (nh hs)"))


class PeerMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class PeerBlock(nn.Module):
    def __init__(self, cfg, qkv):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.attn = PeerAttention(cfg, qkv)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.mlp = PeerMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PeerGPT(nn.Module):
    """Serial GPT-2 (no dropout); forward returns logits only, the loss is the caller's."""

    def __init__(self, cfg, qkv="fused"):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList(PeerBlock(cfg, qkv) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=1e-5),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tie()

    def tie(self):
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx):
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in tr.h:
            x = block(x)
        return self.lm_head(tr.ln_f(x))

    @torch.no_grad()
    def load_full(self, full, cfg):
        """Copy 01's full (serial) state dict in, rearranging c_attn into this model's layout."""
        hs = cfg.n_embd // cfg.n_head
        for name, p in self.named_parameters():
            block, _, rest = name.partition(".attn.")
            module, _, kind = rest.partition(".")
            if module in ("q", "k", "v"):
                t = full[f"{block}.attn.c_attn.{kind}"].chunk(3)["qkv".index(module)]
            elif module == "c_attn":
                t = rearrange(full[name], "(three nh hs) ... -> (nh three hs) ...", three=3, hs=hs)
            else:
                t = full[name]
            p.copy_(t)

    def full_grads(self, cfg):
        """The gradients under 01's names and layouts (load_full undone), for the check."""
        hs = cfg.n_embd // cfg.n_head
        grads = {name: _local(p.grad) for name, p in self.named_parameters()}
        out = {}
        for name, g in grads.items():
            block, _, rest = name.partition(".attn.")
            module, _, kind = rest.partition(".")
            if module == "q":
                out[f"{block}.attn.c_attn.{kind}"] = torch.cat(
                    [grads[f"{block}.attn.{m}.{kind}"] for m in "qkv"])
            elif module == "c_attn":
                out[name] = rearrange(g, "(nh three hs) ... -> (three nh hs) ...", three=3, hs=hs)
            elif module not in ("k", "v"):
                out[name] = g
        return out


def parallelize_peer(model, mesh):
    """torchtitan's recipe without sequence parallelism: shard every Linear, keep norms replicated."""
    plan = {
        # Same split as ours: every rank sees all token ids and owns half the vocab rows, so the
        # lookups are partial sums that one all-reduce completes.
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # Kept as a DTensor: loss_parallel() needs to see that the logits are vocab-sharded, or
        # the cross-entropy would all-gather them.
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    for i, block in enumerate(model.transformer.h):
        prefix = f"transformer.h.{i}."
        qkv = ["c_attn"] if hasattr(block.attn, "c_attn") else ["q", "k", "v"]
        plan.update({prefix + "attn." + m: ColwiseParallel() for m in qkv})
        plan[prefix + "attn.c_proj"] = RowwiseParallel()
        plan[prefix + "mlp.c_fc"] = ColwiseParallel()
        plan[prefix + "mlp.c_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    # Each style wraps its own module's weight in a new Parameter, which unties them; both are
    # Shard(0) over the vocabulary on the same mesh, so sharing one DTensor is correct.
    model.tie()
    return model


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


def _local(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------------------------
# The worker: build both, check they compute the same function, then time them alternately.


def worst_grad_diff(grads, ref):
    if set(grads) != set(ref):
        return math.inf
    return max(tensor_parallel.max_rel_diff(grads[name], ref[name]) for name in ref)


def worker(env, cfg, args):
    group = tensor_parallel.new_tp_group(env, args.tp)
    mesh = init_device_mesh("cpu", (args.tp,))
    # random_all: non-zero biases and LayerNorm weights, so the check below exercises them too.
    full = tensor_parallel.init_state_dict(cfg, args.seed, dtype=torch.float32, random_all=True)
    gen = torch.Generator().manual_seed(args.seed + 1)
    idx = torch.randint(cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)
    targets = torch.randint(cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)

    serial = tensor_parallel.GPT(cfg, None, init=False)
    serial.load_full_state_dict(full)
    ours = tensor_parallel.GPT(cfg, group, init=False)
    ours.load_full_state_dict(full)
    peer = PeerGPT(cfg, args.peer_qkv)
    peer.load_full(full, cfg)
    parallelize_peer(peer, mesh)

    # Same function: the loss and every full gradient against the serial model.
    ref_loss = step_ours(serial, idx, targets).item()
    ref_grads = {name: p.grad for name, p in serial.named_parameters()}
    our_loss = step_ours(ours, idx, targets).item()
    our_grads = ours.full_grads()
    peer_loss = _local(step_peer(peer, idx, targets)).item()
    peer_grads = peer.full_grads(cfg)
    check = {"loss": (ref_loss, our_loss, peer_loss),
             "worst grad": (0.0, worst_grad_diff(our_grads, ref_grads),
                            worst_grad_diff(peer_grads, ref_grads))}
    same = (max(rel(x, ref_loss) for x in check["loss"]) <= LOSS_RTOL
            and max(check["worst grad"]) <= GRAD_RTOL)
    if not same:
        return {"same": False, "check": check}

    steps = {"ours": lambda: step_ours(ours, idx, targets),
             "peer": lambda: step_peer(peer, idx, targets)}
    if args.serial:
        # Every rank runs the whole serial model on its one thread at the same time, so this is
        # the tp=1 step on an equally loaded machine; half of it is the no-communication floor.
        steps["serial"] = lambda: step_ours(serial, idx, targets)
    tables = {name: harness.profile_table(step, args.profile_rows) for name, step in steps.items()} \
        if args.profile else {}
    return {"same": True, "check": check, "tables": tables,
            "rounds": harness.alternate(steps, args.repeats, args.steps, args.warmup)}


# ----------------------------------------------------------------------------------------------
# Command line and report.


def report(cfg, args, result):
    print(f"config: {cfg}")
    print(f"tp={args.tp} B={args.batch_size} T={args.seq_len} float32, tied embeddings, "
          f"peer qkv={args.peer_qkv}; torch {torch.__version__}, {args.tp} gloo ranks x 1 thread")
    (ref, o, p), (_, go, gp) = result["check"]["loss"], result["check"]["worst grad"]
    print("same function (rank 0), against the serial model:")
    print(f"  loss         serial {ref:.8f}  ours {o:.8f} ({rel(o, ref):.1e})  "
          f"peer {p:.8f} ({rel(p, ref):.1e})")
    print(f"  worst grad   ours {go:.1e}  peer {gp:.1e}  (max |g - g_serial| / max |g_serial|, "
          f"worst tensor)")
    if not result["same"]:
        print(f"FAIL: loss or gradients differ by more than {LOSS_RTOL:g} / {GRAD_RTOL:g}; "
              f"refusing to time different functions")
        return False
    print(f"  equal within {LOSS_RTOL:g} (loss, relative) and {GRAD_RTOL:g} (gradients)")
    rounds = result["rounds"]
    print(f"\n{args.repeats} rounds x {args.steps} timed steps of each (after {args.warmup} warm-up steps "
          f"of each per round), ms per step:\n{harness.time_table(rounds, args.tp)}")
    if "serial" in rounds[0]:
        print(f"  serial/2 (perfect tp=2 scaling, no communication): "
              f"{harness.median_of(rounds, 'serial') / 2 * 1e3:.2f}")
    print(harness.pair_line(rounds, "ours", "peer", goal=0.7))
    for name, table in result["tables"].items():
        print(f"\n--- profile of one {name} step, rank 0\n{table}")
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
