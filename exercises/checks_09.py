"""The checks of 09's exercises (exercises/ex09_expert_parallel.py), and the planted wrong answers.

4 fork-started CPU ranks, a two-layer GPT-2 with 4 experts in each MoE layer, float64. 09.1 runs the
student's dispatch alone first, with identity experts (which tokens each rank receives, in which
order, and whether combine gives every token back exactly), then in 09's whole model against the
serial model with experts (09's against_serial: the loss, the auxiliary loss and every gradient), at
tp 2 x dp 2 -> ep 4 and dp 4 -> ep 2. 09.2 compares the student's loss with the formula on known
routings, then on tp 2 ranks that split each microbatch, then in the whole model.
"""
from argparse import Namespace

import torch
import torch.distributed as dist

from exercises.autograder import Exercise, Planted, differences, first, installed, merged, numbered, ranks, warm
from plumbing.launch import gather_rows

tensor_parallel = numbered("01_tensor_parallel")
gpt3d = numbered("05_3d_gpt")
experts = numbered("09_expert_parallel")
F64 = torch.float64
CFG = tensor_parallel.GPTConfig(vocab_size=53, block_size=16, n_layer=2, n_head=2, n_embd=16)
WORLD = 4
REFERENCE = {"dispatch": experts.dispatch, "load_balancing_loss": experts.load_balancing_loss}


# ----------------------------------------------------------------------------------------------
# The whole model against the serial one (09's against_serial), on each rank


def _model(env, layouts):
    reasons = []
    for layout, moe in layouts:
        args = Namespace(etp=1, sequence_parallel=False, **layout)
        groups = gpt3d.new_groups(env, experts.fold(gpt3d.rank_grid(env.world_size, args.tp, args.dp), args.ep))
        full = experts.moe_state_dict(CFG, moe, 7, dtype=F64, random_all=True)
        idx, targets = torch.randint(CFG.vocab_size, (2, 2 * args.dp, 8), generator=torch.Generator().manual_seed(11))
        diffs = experts.against_serial(env, CFG, moe, args, groups, full, idx, targets)[0]
        where = f"tp {args.tp} x dp {args.dp} -> ep {args.ep}, top-{moe.top_k}"
        reasons += [f"in the whole model ({where}): the {what} differs from the serial model's by {d:.2e}"
                    for what, d in sorted(diffs.items(), key=lambda x: -x[1])[:2] if d > 1e-10]
    return reasons


LAYOUTS = [(dict(tp=2, dp=2, ep=4), experts.MoEConfig(num_experts=4, top_k=2, aux_loss_coeff=1.0)),
           (dict(tp=1, dp=4, ep=2), experts.MoEConfig(num_experts=4, top_k=1, aux_loss_coeff=1.0))]


def whole_model():
    warm(meta=True)  # 09's weights are drawn on the meta device's shapes: import that once, here
    return first(merged(ranks(_model, WORLD, LAYOUTS)))


# ----------------------------------------------------------------------------------------------
# 09.1 dispatch


def _dispatch_alone(env):
    E, k, N = 8, 2, 5 + env.rank  # another number of tokens on every rank
    x = (torch.arange(N, dtype=F64) + 10 * env.rank)[:, None].repeat(1, 3)  # token t of rank r: 10 r + t
    gen = torch.Generator().manual_seed(env.rank)
    chosen = torch.stack([torch.randperm(E - 2, generator=gen)[:k] for _ in range(N)])  # experts 6, 7: no token
    rows, plan = experts.dispatch(x, chosen, E, dist.group.WORLD)
    pairs = torch.tensor([(10 * env.rank + t) * E + e for t in range(N) for e in chosen[t].tolist()], dtype=F64)
    every = [p.long().tolist() for p in gather_rows(pairs)]  # each rank's (token, expert) pairs
    n, mine = E // env.world_size, range(E // env.world_size * env.rank, E // env.world_size * (env.rank + 1))
    want = [p // E for s in range(env.world_size) for le in range(n) for p in every[s] if p % E == mine[le]]
    got = [int(v) for v in rows[:, 0].tolist()]
    reasons = []
    if sorted(got) != sorted(want):
        wrong = sorted(set(got) - set(want))[:3]
        reasons.append(f"this rank received the tokens {got}, where the pairs for its experts {list(mine)} are "
                       f"{sorted(want)}" + (f": {wrong[0] // 10}.{wrong[0] % 10} chose none of them; the rows must "
                                            f"be the pairs sorted by expert (step 1), each pair's token "
                                            f"(pair p is token p // k)" if wrong else ""))
    elif got != want:
        reasons.append(f"this rank received the right tokens in the wrong order ({got}, not {want}): rank s's "
                       f"rows must come sorted by expert, so that 09's run_experts finds each local expert's "
                       f"block where plan.blocks says")
    back = experts.combine(rows, torch.full((N, k), 0.5, dtype=F64), plan, dist.group.WORLD)
    if not reasons and not torch.equal(back, x):
        reasons.append("09's combine, with identity experts and weights 1/2, does not give the tokens back exactly: "
                       "the Plan's order, send or recv are not what the rows were sent with")
    return reasons


def check_dispatch(impl):
    with installed((experts, "dispatch", impl["dispatch"])):
        alone = first(merged(ranks(_dispatch_alone, WORLD)))
        if alone:
            return ["alone, with identity experts (E = 8 over 4 ranks, top-2):"] + alone
        return whole_model()


def _unsorted(x, chosen, E, group):  # the pairs in token order: each rank's rows go to the wrong ranks
    ep, k = experts.size_of(group), chosen.shape[1]
    order = torch.arange(chosen.numel())  # the mistake: no sort
    counts = torch.bincount(chosen.flatten(), minlength=E)
    blocks = experts.all_to_all(counts, [E // ep] * ep, [E // ep] * ep, group)
    counts, blocks, n = counts.tolist(), blocks.tolist(), E // ep
    send, recv = ([sum(c[s * n:(s + 1) * n]) for s in range(ep)] for c in (counts, blocks))
    return experts.all_to_all(x[order // k], send, recv, group), experts.Plan(order, k, send, recv, blocks, counts)


def _choice_major(x, chosen, E, group):  # pair p read as choice p // N of token p % N
    rows, plan = REFERENCE["dispatch"](x, chosen, E, group)  # 09's own (the module's is this one now)
    N = x.shape[0]
    rows = experts.all_to_all(x[plan.order % N], plan.send, plan.recv, group)  # the mistake: % N, not // k
    return rows, plan


# ----------------------------------------------------------------------------------------------
# 09.2 load_balancing_loss


def _formula(probs, chosen):
    E, k = probs.shape[1], chosen.shape[1]
    f = torch.bincount(chosen.flatten(), minlength=E).to(probs.dtype) / chosen.numel()
    return E * (f * probs.mean(0)).sum()


def _aux_split(env):
    """tp = every rank: each holds T/tp of one microbatch's tokens; the loss must be the whole one's."""
    group = gpt3d.new_groups(env, gpt3d.rank_grid(env.world_size, env.world_size, 1)).tp
    gen = torch.Generator().manual_seed(3)
    logits, chosen = torch.randn(16, 4, generator=gen, dtype=F64), torch.randint(4, (16, 2), generator=gen)
    whole = logits.softmax(-1).requires_grad_()
    want = _formula(whole, chosen)
    want.backward()
    mine = slice(16 // env.world_size * env.rank, 16 // env.world_size * (env.rank + 1))
    probs = logits[mine].softmax(-1).requires_grad_()
    got = experts.load_balancing_loss(probs, chosen[mine], group)
    got.backward()
    split = _formula(probs.detach(), chosen[mine])  # the loss of this rank's tokens alone
    return differences([(f"the loss on tp rank {env.rank} of {env.world_size}", got.detach(), want.detach(),
                         [(split, "is the loss of this rank's tokens alone: sum the counts, the probabilities and N "
                                  "over the group first")]),
                        ("the gradient of this rank's probabilities", probs.grad, whole.grad[mine])],
                       factors={"k": 2, "tp": env.world_size})


def check_load_balancing_loss(impl):
    fn = impl["load_balancing_loss"]
    E, N = 4, 8
    even, one = torch.full((N, E), 1 / E, dtype=F64), torch.zeros(N, E, dtype=F64)
    one[:, 2] = 1
    gen = torch.Generator().manual_seed(1)
    probs, top2 = torch.randn(N, E, generator=gen, dtype=F64).softmax(-1), torch.randint(E, (N, 2), generator=gen)
    cases = [("an even load, top-1", even, torch.arange(N)[:, None] % E),
             ("every token on expert 2, top-1", one, torch.full((N, 1), 2)),
             ("a random routing, top-2", probs, top2)]
    reasons = differences([(f"the loss of {what}", fn(p, c, None), _formula(p, c)) for what, p, c in cases],
                          hints={"k x too large": "f_i is the share of the N k choices, not of the N tokens"},
                          factors={"k": 2})
    if reasons:
        return reasons
    with installed((experts, "load_balancing_loss", fn)):
        split = first(merged(ranks(_aux_split, 2)))
        if split:
            return split
        return whole_model()


def _not_summed(probs, chosen, group):  # each tp rank's own tokens only
    return REFERENCE["load_balancing_loss"](probs, chosen, None)


def _per_token_share(probs, chosen, group):  # f_i over N, not N k
    return REFERENCE["load_balancing_loss"](probs, chosen, group) * chosen.shape[1]


EXERCISES = [
    Exercise("09.1", "dispatch", "the token dispatcher: sort, counts, uneven all-to-all",
             ("dispatch",), "Megatron's all-to-all token dispatcher; Liu et al. 2025 (MoE Parallel Folding)", check_dispatch,
             lambda: {"dispatch": REFERENCE["dispatch"]},
             [Planted("dispatch_unsorted", "the pairs are sent in token order, not sorted by expert",
                      lambda: {"dispatch": _unsorted}, "the rows must be the pairs sorted by expert"),
              Planted("dispatch_choice_major", "pair p is read as token p % N (choice-major), not p // k",
                      lambda: {"dispatch": _choice_major}, "pair p is token p // k")]),
    Exercise("09.2", "load_balancing_loss", "the load-balancing loss over the whole microbatch",
             ("load_balancing_loss",), "Fedus et al. 2022 (Switch Transformer), Section 2.2, eq. 4; Lepikhin et "
             "al. 2020 (GShard)", check_load_balancing_loss,
             lambda: {"load_balancing_loss": REFERENCE["load_balancing_loss"]},
             [Planted("aux_not_summed_over_tp", "each tp rank's loss is over its own tokens only",
                      lambda: {"load_balancing_loss": _not_summed}, "sum the counts, the probabilities and N over the group"),
              Planted("aux_f_over_tokens", "f_i is counted over the N tokens, not the N k choices",
                      lambda: {"load_balancing_loss": _per_token_share}, "not of the N tokens")]),
]
