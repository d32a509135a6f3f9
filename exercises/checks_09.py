"""The checks of 09's exercises (exercises/ex09_expert_parallel.py), and the planted wrong answers.

Both are on 09's lesson: every rank a replica of the dense GPT-2 on its rows of the batch, each MoE
layer's E experts spread over the ep ranks of its group. The expected answers are this file's own:
a dense mixture of experts (every expert run on every token, its output weighted by the token's
renormalised router probability where the token chose it, 0 elsewhere) and the load-balancing
formula written with one-hot counts; nothing expected comes from the pieces an exercise stubs.

09.1 (MoE's forward: the router, the dispatch, the experts, the combine) runs alone first on 4 CPU
ranks (E = 8 over ep 4, top-2, another number of tokens on every rank): which rows each local
expert receives, then the layer's output, its auxiliary loss and every gradient (the router's and
each expert's, summed over every rank's tokens) against the dense layer; then in 09's moe_gpt and
lesson_step at ep 4 (top-2) and ep 2 (top-1) against 09's serial_step on the dense model: the loss,
the auxiliary loss and every gradient, float64, to 1e-10. While 09.1 is graded, 09's aux_loss is
this file's formula, so 09.1 needs nothing of 09.2.

09.2 (aux_loss) is compared with the formula on known routings (an even load, every token on one
expert, a random top-2, no token at all) with its gradient, then in lesson_step on 4 ranks with the
dense MoE layers (so it needs nothing of 09.1) against serial_step: some targets ignored, one rank's
row counting none (its auxiliary loss 0, not 0/0).
"""
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from exercises.autograder import Exercise, Planted, differences, first, grid_groups, installed, merged, numbered, ranks, warm

tensor_parallel = numbered("01_tensor_parallel")
experts = numbered("09_expert_parallel")
F64 = torch.float64
CFG = tensor_parallel.GPTConfig(vocab_size=53, block_size=16, n_layer=2, n_head=2, n_embd=16)
WORLD = 4
REFERENCE = {"MoE": experts.MoE, "aux_loss": experts.aux_loss}
MOE_CLASS = experts.MoE  # the numbered class, taken before anything is installed: its __init__ builds the weights


# ----------------------------------------------------------------------------------------------
# The expected answers, this file's own


def _formula(probs, chosen, E):
    """E sum_i f_i P_i with one-hot counts; 0 over no token."""
    if chosen.shape[0] == 0:
        return probs.sum() * 0
    f = F.one_hot(chosen, E).sum((0, 1)).to(probs.dtype) / chosen.numel()
    return E * (f * probs.mean(0)).sum()


def _dense(aux, weighted=True, renormalised=True):
    """A forward for a MoE layer: every expert it holds on every token, weighted by the token's
    router probability where it chose that expert (0 elsewhere); its auxiliary loss by `aux`."""
    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).softmax(-1)
        top, chosen = probs.topk(self.k, dim=-1)
        w = top / top.sum(-1, keepdim=True) if renormalised else top
        w = w if weighted else torch.ones_like(w)
        y = tokens * 0
        for e, expert in self.experts.items():
            y = y + (w * (chosen == int(e))).sum(-1, keepdim=True) * expert(tokens)
        keep = self.keep.reshape(-1)
        self.aux = aux(probs[keep], chosen[keep], self.E)
        return y.view_as(x)
    return forward


def _densely(model, aux, **kw):
    for block in model.transformer.h.values():
        if isinstance(block.mlp, MOE_CLASS):
            block.mlp.forward = types.MethodType(_dense(aux, **kw), block.mlp)
    return model


def _batch(T=8):
    """(idx, targets) (WORLD, T), one row a rank: row 1 counts no target, row 3 loses its first third."""
    idx, targets = torch.randint(CFG.vocab_size, (2, WORLD, T), generator=torch.Generator().manual_seed(11))
    targets[1] = -100
    targets[3, :T // 3] = -100
    return idx, targets


def serial_reference(moe, aux=_formula):
    """09's serial_step on the dense model (every expert here) with the weights and batch: the loss
    and auxiliary loss, every gradient."""
    warm(meta=True)  # 09's weights are drawn on the meta device's shapes: import that once, here
    full = experts.moe_state_dict(CFG, moe, 7, dtype=F64, random_all=True)
    idx, targets = _batch()
    serial = _densely(experts.moe_gpt(CFG, moe, None, full), aux)
    got = experts.serial_step(serial, idx, targets, WORLD, moe.aux_loss_coeff)
    return dict(full=full, idx=idx, targets=targets, got=got, grads={n: p.grad for n, p in serial.named_parameters()})


def _whole_model(env, ref, moe, ep, dense):
    groups = grid_groups(env, experts.expert_grid(env.world_size, ep))
    model = experts.moe_gpt(CFG, moe, None if dense else groups.ep, ref["full"])
    if dense:  # every expert on every rank (ep = 1), each rank a replica: the experts' edp group is the world
        _densely(model, experts.aux_loss)
    x, y = (t[env.rank:env.rank + 1] for t in (ref["idx"], ref["targets"]))
    got = experts.lesson_step(model, x, y, dist.group.WORLD if dense else groups.edp, moe.aux_loss_coeff)
    pairs = [("the loss", got[0], ref["got"][0]), ("the auxiliary loss", got[1], ref["got"][1])]
    pairs += [(f"the gradient of {n}", p.grad, ref["grads"][n]) for n, p in model.named_parameters()]
    return differences(pairs, {"nonfinite": "a replica whose row counts no target has no token to average over: "
                                            "its auxiliary loss is 0, not 0/0"}, factors={"k": moe.top_k})


def in_lesson_step(ref, moe, ep, dense=False):
    where = f"in 09's lesson_step, {'dense MoE layers' if dense else f'ep {ep}'}, top-{moe.top_k}, 4 ranks"
    return first([f"{where}, {x}" for x in merged(ranks(_whole_model, WORLD, ref, moe, ep, dense))], 4)


# ----------------------------------------------------------------------------------------------
# 09.1 MoE's forward


E1, K1 = 8, 2


def _layer_weights():
    layer = MOE_CLASS(CFG, E1, K1, None, dtype=F64)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * 0.3)
    return layer.state_dict()


def _tokens(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    x, g = (torch.randn(1, 5 + rank, CFG.n_embd, generator=gen, dtype=F64) for _ in range(2))  # another N a rank
    keep = torch.ones(1, 5 + rank, dtype=torch.bool)
    keep[0, :rank] = False  # some tokens' targets not counted: the auxiliary loss is over the others
    return x, g, keep


def _layer_alone(env, weights):
    r, world = env.rank, env.world_size
    serial = MOE_CLASS(CFG, E1, K1, None, dtype=F64)
    serial.load_state_dict(weights)
    serial.forward = types.MethodType(_dense(_formula), serial)
    want = {}
    for s in [r] + [s for s in range(world) if s != r]:  # this rank's tokens first: its router gradient
        x, g, keep = _tokens(s)
        serial.keep = keep
        y = serial(x)
        (y * g).sum().backward()
        if s == r:
            want.update(y=y.detach(), aux=serial.aux.detach(), router=serial.router.weight.grad.clone())
    layer = experts.MoE(CFG, E1, K1, dist.group.WORLD, dtype=F64)
    layer.load_state_dict({n: weights[n] for n in layer.state_dict()})
    received = {}
    for e, expert in layer.experts.items():  # what each local expert is run on
        expert.register_forward_hook(lambda mod, args, out, e=e: received.setdefault(e, []).append(args[0].detach()))
    x, g, keep = _tokens(r)
    layer.keep = keep
    y = layer(x)
    reasons = []
    for e in layer.experts:  # the rows of every rank's tokens that chose e, in any order
        chose = []
        for s in range(world):
            xs = _tokens(s)[0].reshape(-1, CFG.n_embd)
            chosen = serial.router(xs).softmax(-1).topk(K1, dim=-1)[1]
            chose.append(xs[(chosen == int(e)).any(-1)])
        rows = torch.cat(received.get(e, [torch.zeros(0, CFG.n_embd, dtype=F64)]))
        key = torch.linspace(1, 2, CFG.n_embd, dtype=F64)
        wanted = torch.cat(chose)
        if rows.shape != wanted.shape or not torch.allclose(rows[(rows @ key).argsort()],
                                                            wanted[(wanted @ key).argsort()], rtol=0, atol=1e-12):
            reasons.append(f"expert {e} did not run on the tokens that chose it ({rows.shape[0]} rows; "
                           f"{wanted.shape[0]} tokens of the ranks chose it): some rows went to the wrong expert "
                           f"(step 1: the pairs sorted by expert, stably, so that each rank's rows are one block, "
                           f"pair p being token p // k; step 2: the counts, so that every rank knows what arrives)")
            break
    if reasons:
        return reasons
    if y is None:
        return ["MoE's forward returned None: it returns the layer's output, (B, T, C)"]
    (y * g).sum().backward()
    serial.keep = keep
    suspects = [(_dense(_formula, weighted=False)(serial, x).detach(), "each expert's output was added as it is: "
                 "weight each row by its token's router probability for that expert (step 5)"),
                (_dense(_formula, renormalised=False)(serial, x).detach(), "the weights are the raw top-k "
                 "probabilities: renormalise a token's k probabilities to sum to 1 (Mixtral's convention)")]
    pairs = [("the layer's output", y.detach(), want["y"], suspects),
             ("the auxiliary loss (layer.aux)", None if layer.aux is None else layer.aux.detach(), want["aux"]),
             ("the router's gradient", layer.router.weight.grad, want["router"])]
    pairs += [(f"expert {e}'s gradient of {n}", p.grad, serial.get_parameter(f"experts.{e}.{n}").grad)
              for e, expert in layer.experts.items() for n, p in expert.named_parameters()]
    return differences(pairs)


def check_moe(impl):
    weights, refs = _layer_weights(), [serial_reference(moe) for moe, _ in LAYOUTS]  # before anything is installed
    with installed((experts, "MoE", impl["MoE"]), (experts, "aux_loss", _formula)):
        alone = first(merged(ranks(_layer_alone, WORLD, weights)))
        if alone:
            return [f"alone (one layer, E = {E1} over ep {WORLD}, top-{K1}, another number of tokens on every "
                    f"rank), {x}" for x in alone]
        for (moe, ep), ref in zip(LAYOUTS, refs):
            reasons = in_lesson_step(ref, moe, ep)
            if reasons:
                return reasons
    return []


LAYOUTS = [(experts.MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=1.0), 4),
           (experts.MoEConfig(num_experts=4, top_k=1, aux_loss_coeff=1.0), 2)]


# ----------------------------------------------------------------------------------------------
# 09.2 aux_loss


def check_aux(impl):
    fn = impl["aux_loss"]
    E, N = 4, 8
    even, one = torch.full((N, E), 1 / E, dtype=F64), torch.zeros(N, E, dtype=F64)
    one[:, 2] = 1
    gen = torch.Generator().manual_seed(1)
    probs, top2 = torch.randn(N, E, generator=gen, dtype=F64).softmax(-1), torch.randint(E, (N, 2), generator=gen)
    cases = [("an even load, top-1", even, torch.arange(N)[:, None] % E),
             ("every token on expert 2, top-1", one, torch.full((N, 1), 2)),
             ("a random routing, top-2", probs, top2),
             ("no token (a replica whose targets are all ignored), top-2", probs[:0], top2[:0])]
    pairs = []
    for what, p, c in cases:
        mine, theirs = p.clone().requires_grad_(), p.clone().requires_grad_()
        got, want = fn(mine, c, E), _formula(theirs, c, E)
        pairs.append((f"the loss of {what}", None if got is None else got.detach(), want.detach()))
        if got is not None and got.requires_grad and N and p.shape[0]:
            got.backward()
            want.backward()
            pairs.append((f"the gradient of the probabilities, {what}", mine.grad, theirs.grad))
    reasons = differences(pairs, hints={"k x too large": "f_i is the share of the N k choices, not of the N tokens",
                                        "nonfinite": "over no token the loss is 0, not 0/0"}, factors={"k": 2})
    if reasons:
        return reasons
    moe = experts.MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=1.0)
    ref = serial_reference(moe)
    with installed((experts, "aux_loss", fn)):
        return in_lesson_step(ref, moe, 1, dense=True)


# ----------------------------------------------------------------------------------------------
# Planted wrong answers: MoE forwards near the lesson's, each with one mistake


def _forward(sort=True, weighted=True, renormalised=True):
    def forward(self, x):
        B, T, C = x.shape
        ep, n, k = experts.size_of(self.group), self.E // experts.size_of(self.group), self.k
        tokens = x.reshape(B * T, C)
        probs = self.router(tokens).softmax(-1)
        top, chosen = probs.topk(k, dim=-1)
        weights = top / top.sum(-1, keepdim=True) if renormalised else top
        self.aux = experts.aux_loss(probs[self.keep.flatten()], chosen[self.keep.flatten()], self.E)
        order = chosen.flatten().argsort(stable=True) if sort else torch.arange(chosen.numel())
        counts = torch.bincount(chosen.flatten(), minlength=self.E)
        got = experts.all_to_all(counts, [n] * ep, [n] * ep, self.group)
        send, recv = counts.view(ep, n).sum(1).tolist(), got.view(ep, n).sum(1).tolist()
        rows = experts.all_to_all(tokens[order // k], send, recv, self.group)
        blocks = list(rows.split(got.tolist()))
        for i, expert in enumerate(self.experts.values()):
            mine = blocks[i::n]
            blocks[i::n] = expert(torch.cat(mine)).split([len(b) for b in mine])
        back = experts.all_to_all(torch.cat(blocks), recv, send, self.group)
        w = weights.flatten()[order, None] if weighted else 1
        return tokens.new_zeros(tokens.shape).index_add(0, order // k, back * w).view(B, T, C)
    return type("MoE", (MOE_CLASS,), {"forward": forward})


def _aux_over_tokens(probs, chosen, E):
    return REFERENCE["aux_loss"](probs, chosen, E) * chosen.shape[1]  # f_i over the N tokens, not the N k choices


def _aux_no_guard(probs, chosen, E):
    N, k = chosen.shape
    f = torch.bincount(chosen.flatten(), minlength=E).to(probs.dtype) / (N * k)
    return E * (f * probs.sum(0) / N).sum()  # over no token: 0 / 0


def _aux_not_returned(probs, chosen, E):
    loss = REFERENCE["aux_loss"](probs, chosen, E)  # the mistake: computed, never returned  # noqa: F841


EXERCISES = [
    Exercise("09.1", "moe", "one dispatch and combine: the lesson's MoE layer", ("MoE",),
             "Megatron's all-to-all token dispatcher; Liu et al. 2025 (MoE Parallel Folding)", check_moe,
             lambda: {"MoE": REFERENCE["MoE"]},
             [Planted("moe_unsorted", "the pairs are sent in token order, not sorted by expert",
                      lambda: {"MoE": _forward(sort=False)}, "some rows went to the wrong expert"),
              Planted("moe_combine_unweighted", "the combine adds the experts' outputs without the router's weights",
                      lambda: {"MoE": _forward(weighted=False)}, "weight each row by its token's router probability"),
              Planted("moe_weights_not_renormalised", "the top-k probabilities are used as they are",
                      lambda: {"MoE": _forward(renormalised=False)}, "renormalise a token's k probabilities")]),
    Exercise("09.2", "aux_loss", "the load-balancing loss: E sum f_i P_i", ("aux_loss",),
             "Fedus et al. 2022 (Switch Transformer), Section 2.2, eq. 4; Lepikhin et al. 2020 (GShard)", check_aux,
             lambda: {"aux_loss": REFERENCE["aux_loss"]},
             [Planted("aux_f_over_tokens", "f_i is counted over the N tokens, not the N k choices",
                      lambda: {"aux_loss": _aux_over_tokens}, "not of the N tokens"),
              Planted("aux_over_no_token_nan", "no guard for a replica with no counted token: 0 / 0",
                      lambda: {"aux_loss": _aux_no_guard}, "not 0/0"),
              Planted("aux_loss_not_returned", "aux_loss computes the loss and does not return it",
                      lambda: {"aux_loss": _aux_not_returned}, "it returned None", at_line=True)]),
]
