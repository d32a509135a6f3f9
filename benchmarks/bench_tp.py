"""Tensor-parallel step time: our GPT-2 (01_tensor_parallel.py) against PyTorch's DTensor TP.

One training step without the optimizer of the same GPT-2 at tp=2 on gloo CPU ranks: 01's
GPT against a plain model parallelized with DTensor as torchtitan does (loss_parallel).
benchmarks/README.md has what each side runs, the checks and the method.

Run it (from the repository root; CPU only, it starts its own ranks):
    python benchmarks/bench_tp.py
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

# Against the serial model, relative: the loss; the gradients, max |a - b| / max |b| of the worst
# tensor. float32, and the sharded sums run in another order than the serial ones; a real mistake
# (an untied or misplaced weight) shows up at 1e-2 or more.
TOLERANCES = {"loss": 1e-5, "grad": 1e-4}


# ----------------------------------------------------------------------------------------------
# The peer's serial model (bench_3d's stages too): plain nn.Linear / nn.Embedding / nn.LayerNorm,
# which parallelize_module knows how to shard; 01's parameter names without "transformer.".


class PeerBlock(nn.Module):
    """A GPT-2 block. c_attn is one GEMM like ours, its rows head-major (nh, 3, hs) as Megatron's,
    so that a contiguous Shard(0) gives each rank whole heads with their q, k and v."""

    def __init__(self, cfg):
        super().__init__()
        C, self.hs = cfg.n_embd, cfg.n_embd // cfg.n_head
        self.ln_1 = nn.LayerNorm(C, eps=1e-5)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(C, 3 * C), "c_proj": nn.Linear(C, C)})
        self.ln_2 = nn.LayerNorm(C, eps=1e-5)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(C, 4 * C), "c_proj": nn.Linear(4 * C, C)})

    def forward(self, x):
        # Under TP c_attn's output is a local tensor holding nh/tp heads; the head count is read
        # off the shape, so the same code runs serial and sharded.
        qkv = self.attn.c_attn(self.ln_1(x))
        q, k, v = rearrange(qkv, "B T (nh three hs) -> three B nh T hs", three=3, hs=self.hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.c_proj(rearrange(y, "B nh T hs -> B T (nh hs)"))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class PeerStage(nn.Module):
    """The blocks `layers` of a serial GPT-2 (no dropout), with the embeddings on the first stage
    and ln_f and the output layer on the last. The output layer is a copy of wte (as Megatron's
    last stage holds one) until tie() makes it wte itself. Returns the hidden state, or on the last
    stage the logits: the loss is the caller's (torch's schedule applies its loss_fn to them)."""

    def __init__(self, cfg, layers, first=True, last=True):
        super().__init__()
        self.first, self.last, self.hs = first, last, cfg.n_embd // cfg.n_head
        if first:
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleDict({str(i): PeerBlock(cfg) for i in layers})
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

    def _layout(self, t, name, to_peer):
        """c_attn's rows: 01 stores q, k and v one after the other, (3, nh, hs); this model head-major."""
        if ".c_attn." not in name:
            return t
        ours, peer = "(three nh hs) ...", "(nh three hs) ..."
        return rearrange(t, f"{ours} -> {peer}" if to_peer else f"{peer} -> {ours}", three=3, hs=self.hs)

    @torch.no_grad()
    def load_full(self, full):
        """Copy this stage's part of 01's full (serial) state dict in."""
        for name, p in self.named_parameters():
            source = full["transformer.wte.weight" if name == "lm_head.weight" else "transformer." + name]
            p.copy_(self._layout(source, name, to_peer=True))

    def full_grads(self):
        """The gradients under 01's names and layouts, for the check."""
        return {"transformer." + name: self._layout(_full(p.grad), name, to_peer=False)
                for name, p in self.named_parameters()}


def tp_plan(stage):
    """torchtitan's recipe without sequence parallelism: shard every Linear, keep norms replicated."""
    plan = {}
    if stage.first:
        # Same split as ours (01's VocabParallelEmbedding): every rank sees all token ids and owns
        # a slice of the vocab rows, so the lookups are partial sums that one all-reduce completes.
        plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if stage.last:
        # The logits stay a vocab-sharded DTensor: loss_parallel() must see that they are sharded
        # (or the cross-entropy would all-gather them).
        plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                          use_local_output=False)
    for i in stage.h:
        plan.update({f"h.{i}.attn.c_attn": ColwiseParallel(), f"h.{i}.attn.c_proj": RowwiseParallel(),
                     f"h.{i}.mlp.c_fc": ColwiseParallel(), f"h.{i}.mlp.c_proj": RowwiseParallel()})
    return plan


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


# ----------------------------------------------------------------------------------------------
# One step of each (zero_grad, forward, loss, backward: it returns the loss), and the worker: build
# both, check that they compute the same function, then time them alternately.


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


def worker(env, cfg, args):
    group = tensor_parallel.new_tp_group(env, args.tp)
    mesh = init_device_mesh("cpu", (args.tp,))
    full, gen = harness.start(cfg, args.seed)
    idx, targets = (torch.randint(cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen) for _ in "ab")

    serial, ours = harness.gpt(cfg, full), harness.gpt(cfg, full, group)
    peer = PeerStage(cfg, range(cfg.n_layer))
    peer.load_full(full)
    parallelize_module(peer, mesh, tp_plan(peer))
    # Each style wraps its own module's weight in a new Parameter; both are Shard(0) over the
    # vocabulary on the same mesh, so sharing one DTensor ties them correctly.
    peer.tie()

    # Same function: the loss and every full gradient against the serial model.
    ref_loss = step_ours(serial, idx, targets).item()
    ref_grads = {name: p.grad for name, p in serial.named_parameters()}
    losses = {"ours": step_ours(ours, idx, targets).item(), "peer": _full(step_peer(peer, idx, targets)).item()}
    diffs = {name: {"loss": rel(losses[name], ref_loss), "grad": harness.worst_rel(model.full_grads(), ref_grads)}
             for name, model in (("ours", ours), ("peer", peer))}
    same = harness.agree(all(harness.within(d, TOLERANCES) for d in diffs.values()))
    result = {"same": same, "diffs": diffs, "loss": ref_loss}
    if same:
        steps = {"ours": lambda: step_ours(ours, idx, targets), "peer": lambda: step_peer(peer, idx, targets)}
        result["tables"] = harness.profiles(steps, args.profile_rows) if args.profile else {}
        result["rounds"] = harness.alternate(steps, args.repeats, args.steps, args.warmup)
    return result


# ----------------------------------------------------------------------------------------------
# Command line and report.


def report(cfg, args, result):
    print(f"config: {cfg}\ntp={args.tp} B={args.batch_size} T={args.seq_len} float32, tied embeddings; "
          f"torch {torch.__version__}, {args.tp} gloo ranks x 1 thread")
    if not harness.guard(f"same function (rank 0), relative to the serial model (loss {result['loss']:.8f}):",
                         result["diffs"], TOLERANCES, result["same"]):
        return False
    rounds = result["rounds"]
    print(f"\n{harness.time_table(rounds, args.tp, f' (after {args.warmup} warm-up steps of each per round)')}")
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
    args = parser.parse_args()
    cfg = harness.model_config(args)
    results = harness.launch(worker, args.tp, cfg, args, timeout_s=120.0, deadline_s=args.deadline)
    return report(cfg, args, results[0])


if __name__ == "__main__":
    harness.run_main(main)
