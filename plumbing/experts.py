"""09's plumbing: what its demo and its command line print and refuse, none of it the concept. The demo's
figures (draw_fold: both grids over the same ranks and what the fold did; report_routing: the tokens each
rank routes to each expert and the all-to-all bytes against the planner's formula), the trainer's line on
what the experts add (report_experts), and the command line's actions for a model with experts
(train_action: --print-layout's grids and the planner's figures, plan_figures; sampling, the exports and
--plan refused by name, NOT_FOR_EXPERTS). It imports a numbered file only when called (01's group sizes);
what it needs of 09 is handed to it. 09 re-exports every name.
"""
import importlib

import planner
from plumbing import cli
from plumbing.launch import gather_numbers


def draw_fold(grid):
    """Both grids over the same ranks, stage by stage: each rank's place in attention's (tp, dp; cp) and in
    the experts' (ep, edp; etp), then every group, and what the fold did."""
    cp = len(grid["cp"][0]) if "cp" in grid else 1
    kinds = [k for k in ("tp", "cp", "dp", "tp_cp", "ep", "edp", "etp", "pp") if k in grid]
    size = {k: len(grid[k][0]) for k in kinds}
    place = {k: {r: i for g in grid[k] for i, r in enumerate(g)} for k in kinds}
    which = {k: {r: i for i, g in enumerate(grid[k]) for r in g} for k in kinds}  # the index of r's group
    replica = {r: i // cp for r, i in place["dp"].items()}  # 08's dp group is dp x cp ranks: d cp + c
    attention = ("tp", "cp", "dp") if cp > 1 else ("tp", "dp")
    out = [f"attention: tp {size['tp']}" + (f" x cp {cp}" if cp > 1 else "") + f" x dp {size['dp'] // cp} x pp "
           f"{size['pp']} ({'08' if cp > 1 else '05'}'s grid: tp fastest, then {'cp, ' if cp > 1 else ''}dp, pp)",
           f"experts:   etp {size['etp']} x ep {size['ep']} x edp {size['edp']} x pp {size['pp']} over the same ranks "
           f"(etp fastest, then ep, edp, pp: Megatron's order)"]
    for stage in range(size["pp"]):
        ranks = sorted(r for r in place["pp"] if place["pp"][r] == stage)
        at = lambda k, r: replica[r] if k == "dp" else place[k][r]  # noqa: E731
        cell = lambda ks: "".join(f"{','.join(str(at(k, r)) for k in ks):>8}" for r in ranks)  # noqa: E731
        w = 18 + 3 * (cp > 1)  # the labels' width
        out += [f"{f'stage {stage}  rank':{w + 1}s}{''.join(f'{r:>8}' for r in ranks)}",
                f"{'  attention ' + ','.join(attention):{w}s}{cell(attention)}",
                f"{'  experts  ep,edp':{w}s}{cell(('ep', 'edp'))}"]
        out += [f"{'  experts     etp':{w}s}{cell(('etp',))}"] if size["etp"] > 1 else []
    for kind in ("tp", "cp", "dp", "tp_cp", "ep", "edp", "etp", "pp"):
        if kind in grid:
            groups = grid[kind] if len(grid[kind]) <= 16 else str(grid[kind][:16])[:-1] + ", ...]"
            name = {"dp": "dp x cp", "tp_cp": "tp x cp"}.get(kind, kind) if cp > 1 else kind
            out.append(f"{name + ' groups:':{16 if cp > 1 else 12}s}{groups}")
    first = grid["ep"][0]
    spans = f"{len({which['tp'][r] for r in first})} tp group(s)" + (
        f", {len({place['cp'][r] for r in first})} cp rank(s) of each sequence" if cp > 1 else "")
    block = " (each ep group is one tp x cp block)" if sorted(grid["ep"]) == grid.get("tp_cp") else ""
    out.append(f"the fold: an ep group spans {spans} and {len({replica[r] for r in first})} dp replica(s) of "
               f"attention{block}; expert gradients are summed over edp, dense ones over dp{' x cp' if cp > 1 else ''}")
    return "\n".join(out)


def report_routing(env, say, cfg, args, model, layers):
    """The first MoE layer's routing (layers: the model's MoE layers, 09's moe_layers), every rank's: its
    choices per expert and the rows it received; then every MoE layer's all-to-all bytes against the
    planner's formula (uniform routing)."""
    tensor_parallel = importlib.import_module("01_tensor_parallel")
    size_of, rank_of = tensor_parallel.tp_size, tensor_parallel.tp_rank  # of a group (None: 1 and 0), as 09's
    plan, E, ep = layers[0].plan, layers[0].E, size_of(layers[0].ep)
    table = gather_numbers(plan.counts + [sum(plan.recv)], device=env.device)
    say(f"\nlayer 0's routing: the (token, expert) pairs each rank sent to each expert (expert e on ep rank "
        f"e // {E // ep}), and the rows each rank's experts received")
    say("rank " + "".join(f"{'e' + str(e):>6}" for e in range(E)) + "  received")
    for r, row in enumerate(table):
        say(f"{r:4d} " + "".join(f"{int(c):6d}" for c in row[:-1]) + f"{int(row[-1]):10d}")
    elt = next(model.parameters()).element_size()
    sent = [(sum(p.send) - p.send[rank_of(lay.ep)]) + (sum(p.recv) - p.recv[rank_of(lay.ep)])
            for lay in layers for p in [lay.plan]]  # rows this rank sent to others: dispatch, combine
    measured = 2 * sum(x[0] for x in gather_numbers([sum(sent)], device=env.device)) * cfg.n_embd * elt  # x2: backward
    N = args.batch_size // args.dp * args.seq_len // (args.tp * args.cp)  # the tokens a rank routes
    formula = planner.moe_alltoall_bytes(N, layers[0].k, ep, cfg.n_embd, elt) * len(layers) * env.world_size
    say(f"all-to-all bytes of one forward and backward, every rank and MoE layer: {measured:,.0f} measured, "
        f"{formula:,.0f} by the planner's formula at uniform routing (4 all-to-alls a layer, each rank sending "
        f"(ep-1)/ep of its N k = {N} x {layers[0].k} rows of C = {cfg.n_embd})")


def report_experts(cfg, moe, tc):
    """What the experts add to 05's summary (which counts the dense model), printed before it: E, the MoE
    layers, top-k, the fold, the parameters in all and active per token; with --init-from, the upcycling."""
    spec = planner.MoESpec(moe.num_experts, moe.top_k, moe.moe_every)
    total, active = planner.moe_params(planner.ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size), spec)
    drops = f"capacity {moe.capacity_factor:g}" if moe.capacity_factor else "dropless"
    print(f"experts   {moe.num_experts} in each of layers {list(planner.moe_layers(cfg.n_layer, moe.moe_every))}, "
          f"top-{moe.top_k}, aux loss x {moe.aux_loss_coeff:g}, {drops}; etp {tc.etp} x ep {tc.ep} x edp "
          f"{tc.tp * tc.cp * tc.dp // (tc.ep * tc.etp)} over each stage's tp x {'cp x ' if tc.cp > 1 else ''}"
          f"dp; {total:,} parameters, {active:,} active per token")
    if tc.init_from:
        print(f"upcycling: each of the {moe.num_experts} experts of layers "
              f"{list(planner.moe_layers(cfg.n_layer, moe.moe_every))} starts as {tc.init_from}'s MLP of its "
              f"layer (Komatsuzaki et al. 2023); the routers are drawn from --seed {tc.seed}")


# ----------------------------------------------------------------------------------------------
# The command line's actions for a model with experts (09's main calls train_action)


NOT_FOR_EXPERTS = {  # 05's actions that read a checkpoint into 01's GPT-2, which has no experts
    "sample": "--sample reads the weights into 01's serial GPT-2, which has no experts; 09 does not sample",
    "export_hf": "--export-hf writes a Hugging Face GPT-2, and GPT-2 has no experts",
    "export_state_dict": "--export-state-dict writes 01's GPT-2 state dict, which has no experts (nor does --init-from "
                         "read one back)",
    "plan": "--plan estimates 05's dense GPT-2; the experts' figures come with --print-layout (planner.py's moe_*)"}


LAYOUT_FLAGS = {"print_layout", "tp", "cp", "dp", "pp", "ep", "etp", "schedule", "virtual_stages", "num_experts",
                "top_k", "moe_every", "batch_size", "microbatches", "seq_len", "sequence_parallel", "zero1", "recompute",
                "cp_schedule", "cp_attention"}


def train_action(argv, train_parser, config, schedule_of, moe_of):
    """What 05's command line would do instead of training, for a model with experts (09's train_parser,
    TrainConfig, schedule_of and MoEConfig.of): --print-layout draws both grids, the fold and the planner's
    figures; sampling, the exports and --plan are refused by name. Returns True if it was an action, None
    to train."""
    tensor_parallel = importlib.import_module("01_tensor_parallel")
    p = train_parser()
    given = cli.given(p, argv)
    for name, why in NOT_FOR_EXPERTS.items():
        if name in given:
            raise ValueError(why)
    if "print_layout" not in given:
        return None
    args = p.parse_args(argv)
    tc, cfg = cli.from_args(config, args), cli.from_args(tensor_parallel.GPTConfig, args)
    extra = sorted(given - LAYOUT_FLAGS - set(cfg.__dataclass_fields__))
    if extra:
        raise ValueError(f"--print-layout does not use {', '.join('--' + n.replace('_', '-') for n in extra)}: it "
                         f"draws the grids and starts nothing; drop them")
    tc.check_relations(cfg)
    print(draw_fold(schedule_of(tc).grid(tc.tp * tc.cp * tc.dp * tc.pp, tc.tp, tc.dp)))
    print(plan_figures(cfg, tc, moe_of(tc)))
    return True


def plan_figures(cfg, tc, moe):
    """The planner's figures of a model with experts under the fold (planner.py's moe_*). With cp, to the planner
    a cp rank is a replica of sequences of T/cp tokens: its activations and all-to-alls are those of T/cp, and
    its ZeRO-1 shards are over dp x cp (08's dp groups); its FLOPs per token are the whole sequence's."""
    m, e = planner.ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, tc.seq_len), moe
    total, active = planner.moe_params(m, e)
    per_rank = planner.ModelSpec(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, tc.seq_len // tc.cp)
    L = planner.Layout(tc.tp, tc.pp, tc.dp * tc.cp, tc.batch_size * tc.cp, b=tc.batch_size // (tc.dp * tc.microbatches),
                       v=tc.virtual_stages, recompute=tc.recompute, sequence_parallel=tc.sequence_parallel)
    tokens = L.b * per_rank.seq_len // tc.tp  # a rank routes its 1/tp of a microbatch (of its T/cp)
    return (f"planner: {total:,} parameters, {active:,} active per token; {planner.moe_flops_per_token(m, e):,.0f} "
            f"FLOPs per token (forward and backward); the fullest rank's memory "
            f"{planner.moe_memory_per_rank(per_rank, e, L, tc.ep, tc.etp, tc.zero1) / 2**20:,.1f} MiB (bf16 weights, fp32 "
            f"gradients and AdamW, activations); all-to-all bytes per MoE layer and microbatch, per rank: "
            f"{planner.moe_alltoall_bytes(tokens, e.top_k, tc.ep, cfg.n_embd):,.0f} (bf16, uniform routing)")
