"""05's command line, which 06 and 07 run with their own flags and schedules: the parser (the config
groups, the actions, the planner's flags) and main, which checks every flag, then either does one of
the actions instead of training (--plan, --print-layout, --self-check, --sample, the exports) or
launches the trainer on its ranks, under --restarts. None of it is the concept; 05's train() is.
"""
import dataclasses
import functools
import importlib
import os
import sys

import torch

import planner
from plumbing import cli, report, sample, selfcheck, watch
from plumbing.checkpoint import newest_checkpoint, resumable, verify_checkpoint
from plumbing.checks import SAMPLING, check_action, check_fields, check_model_flags, check_plan_flags, \
    layout_sizes, preflight, world_size
from plumbing.gpt2 import export_checkpoint, import_gpt2
from plumbing.launch import launch, launcher_ranks


def parser(doc, groups, model_defaults):
    """Every flag of the trainer: its config dataclasses ([(dataclass, title)]), the actions, the
    sampling and the planner's flags; --help prints each group apart."""
    tensor_parallel = importlib.import_module("01_tensor_parallel")
    p = cli.make_parser(doc)
    actions = p.add_argument_group("actions instead of training (each prints and exits)")
    actions.add_argument("--print-layout", action="store_true", help="print the rank grid and exit")
    actions.add_argument("--self-check", action="store_true", help="try every rank (a timed matmul), every tp "
                         "and dp group (an all-reduce) and every pair of neighbouring stages (a ping-pong), "
                         "each under a short timeout; print a table, name what is out of line, and exit")
    actions.add_argument("--export-hf", metavar="DIR", help="write --resume's newest checkpoint as a "
                         "Hugging Face GPT-2 directory and exit")
    actions.add_argument("--export-state-dict", metavar="FILE", help="write --resume's newest checkpoint "
                         "as a plain serial state dict (.pt) and exit")
    actions.add_argument("--verify", metavar="CKPT", help="check the newest checkpoint under CKPT as a load "
                         "does (every shard's sha256, step and run, no links, every tensor finite and of its "
                         "shape, the optimizer's step counts, the random streams) without loading it, and exit")
    p.add_argument("--resume-if-present", metavar="DIR", help="as --resume DIR, but start from step 0 when DIR "
                   "holds no checkpoint yet (or does not exist): for a restart wrapper that submits the same "
                   "command again; a plain --resume that finds nothing is refused")
    cli.add_dataclass_args(p, tensor_parallel.GPTConfig, "model", **model_defaults)
    for group, title in groups:
        cli.add_dataclass_args(p, group, title)
    cli.add_dataclass_args(p, sample.SampleConfig, "sampling (with --resume or --init-from)")
    planner.add_plan_args(p)
    return p


def main(p, config, train, schedule_of, rank_grid, check=None):
    """Parse p's flags into `config` (05's TrainConfig, or a later file's) and act on them. train(env,
    cfg, tc, quiet, schedule_of, check) runs on every rank; rank_grid is 05's; check: 05's demo, which
    05's own run passes (a later chapter's --train has none, and refuses --check). Returns whether it succeeded."""
    if check is None and "--check" in sys.argv[1:]:
        raise ValueError("--check checks 05's lesson step before 05 trains; a later chapter's --train has its own "
                         "demo for that: run it without --train")
    train = functools.partial(train, check=check) if check else train
    tensor_parallel = importlib.import_module("01_tensor_parallel")
    args = p.parse_args()
    if args.plan:  # the planner checks its own flags, and refuses any other
        check_plan_flags(cli.given(p), [name for _, name in planner.MODEL_FLAGS])
        print(planner.plan_from_args(args))
        return True
    tc, cfg, sc = (cli.from_args(c, args) for c in (config, tensor_parallel.GPTConfig, sample.SampleConfig))
    check_fields(tc, cfg, sc)  # every flag's type and range, whatever the action
    given = cli.given(p)  # the flags on the command line: no action may ignore one
    lenient = getattr(args, "resume_if_present", None)
    if lenient is not None:  # one flag of the two: the same checkpoint, with "none yet" allowed
        for other in ("resume", "init_from"):
            if getattr(tc, other):
                raise ValueError(f"--resume-if-present {lenient} and --{other.replace('_', '-')} {getattr(tc, other)} "
                                 f"both give the starting point; give one of them")
        tc = dataclasses.replace(tc, resume=lenient)
        args.resume = lenient
    own = {f.name for f in dataclasses.fields(config)}  # a flag of the trainer's is not sampling's (09's --top-k)
    action = check_action(args, given, [k for k, _ in layout_sizes(tc)], [n for n in SAMPLING if n not in own])
    grid = lambda tc: schedule_of(tc).grid(world_size(tc), tc.tp, tc.dp)  # noqa: E731  (the schedule's groups)
    if action == "print_layout":
        report.print_layout(tc, lambda world, tp, dp, pp: schedule_of(tc).grid(world, tp, dp))
    elif action == "self_check":
        selfcheck.run(tc, grid(tc))
    elif action == "sample":
        sample.from_weights(cfg, tc, sc, given)
    elif action == "export":
        export_checkpoint(tc.resume, args.export_hf, args.export_state_dict, tc.overwrite)
    elif action == "verify":
        verify_checkpoint(args.verify)
    else:
        if tc.resume and lenient is None:  # a --resume that finds nothing is refused, not a run from step 0
            resumable(tc.resume)
        if tc.init_from:  # the imported weights decide the model's shape
            imported = import_gpt2(tc.init_from, cfg)[0]
            if imported:
                check_model_flags(given, cfg, imported, tc.init_from)
                cfg = dataclasses.replace(imported, dropout=cfg.dropout)
                print(f"model from {tc.init_from}: {cfg}")
        ranks = launcher_ranks()  # (rank, world, local rank) under torchrun, else None
        if ranks and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # torchrun --max-restarts
            tc = dataclasses.replace(tc, resume=newest_checkpoint(tc.snapshot_dir, tc.save) or tc.resume,
                                     rehearse_fault=[])
        world = ranks[1] if ranks else world_size(tc)
        device = torch.device("cuda" if ranks and torch.cuda.is_available() else "cpu")  # as launch decides
        preflight(cfg, tc, world, device, ranks_here=1 if ranks else world,  # again on every rank
                  writer=not ranks or ranks[0] == 0)
        # Under a fault, --restarts N starts again from the newest snapshot (plumbing/watch.py).
        return watch.with_restarts(lambda tc: launch(train, world_size(tc), cfg, tc, False, schedule_of,
                                                     timeout_s=tc.timeout_s, watch=watch.launcher_watch(tc)),
                                   tc, grid(tc))
    return True


def later_chapter(demo_parser, flags, title, train_config, schedule_of, start_demo):
    """The command line of a chapter after 05 (06, 07, ...): with --train, 05's trainer with the
    chapter's flags added (the dataclass `flags`, its --help group `title`; train_config: 05's
    TrainConfig with them) and its schedules, schedule_of(tc); without, its demo: the demo's flags
    parsed and checked (one of training's given without --train is named as such), then
    start_demo(cfg, args). A demo's unset --batch-size is 2 m."""
    gpt3d = importlib.import_module("05_3d_gpt")

    def train_parser():
        p = gpt3d.parser()
        p.conflict_handler = "resolve"  # a chapter's flag named as one of 05's replaces it (09's --top-k)
        cli.add_dataclass_args(p, flags, title)
        return p

    if "--train" in sys.argv[1:]:
        sys.argv.remove("--train")
        return gpt3d.main(train_parser, train_config, schedule_of)
    cfg, args = cli.demo_args(demo_parser(), train_parser=train_parser(),
                              batch_size=lambda a: 2 * a.microbatches if a.batch_size is None else a.batch_size)
    return start_demo(cfg, args)
