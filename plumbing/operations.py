"""What a run needs around 05's training loop that is not the loop: before_training (the refusals, the
ranks' agreement, 05's check, the kernels' build), then one object, Operations, called at four points
of each step (step, record, phase, end) and once at the end (finish), so that 05's train() reads as
nanoGPT's loop. Each thing it does is someone else's; it only says when:

    the watch        plumbing/watch.py's Recorder (each rank's record on the side channel), its
                     heartbeat and, under torchrun, the watchdog; the step and phase it is in
    rehearsed faults --rehearse-fault, acted out at the start of their step (watch.rehearse)
    the trace        --trace: one step (not the first, which allocates, compiles and captures)
                     observed from outside by plumbing/trace.py's StepTrace, then written
    skipped steps    a step whose loss or gradient norm is not finite was skipped on every rank (05's
                     train_step); --max-skipped-steps of them in a row stop the run
    stragglers       --straggler-every N, and at the end: every rank's busy time against its stage's
    the log          the step's JSON line (--metrics) and the progress bar, durable before a save
    saves            --save, every --save-every steps and at the end (plumbing/checkpoint.py's Saver);
                     --snapshot-every to --snapshot-dir, for --restarts
"""
import contextlib
import importlib
import math
import sys
import time

from plumbing import agreement, watch
from plumbing.checkpoint import Saver
from plumbing.checks import acceleration, preflight
from plumbing.launch import launcher_ranks, side_channel
from plumbing.trace import StepTrace


def before_training(env, cfg, tc, say, check=None):
    """What 05's train() does before it builds anything: every refusal, before the first collective
    (preflight); every rank the same flags, data and checkpoint, or none trains (agreement); then
    check(env, tc, say) (05's demo) under --check (unset: on a CPU), whose False stops every rank alike;
    the fused kernels built. Returns preflight's (train tokens, eval tokens, checkpoint path, start step)."""
    train_tokens, eval_tokens, path, start = preflight(cfg, tc, env.world_size, env.device, say, ranks_here=1,
                                                       writer=env.rank == 0)
    agreement.check(env, cfg, tc, path, start)
    checking = tc.check if tc.check is not None else env.device.type == "cpu"
    if check and checking and not check(env, tc, say):  # the same on every rank: none trains
        raise FloatingPointError("the check before training failed (FAIL above): nothing was trained")
    if acceleration(tc, env.device)[0]:
        importlib.import_module("kernels").prebuild(tc.kernel_path)  # minutes when cold: before any collective can time out
    return train_tokens, eval_tokens, path, start


class Operations:
    """This rank's operations around the loop of `run` (05's Run), whose steps `progress` (plumbing/
    report.py's Progress) counts from `start`."""

    def __init__(self, run, progress, start):
        env, tc = run.env, run.tc
        self.run, self.tc, self.progress, self.start = run, tc, progress, start
        self.saver = Saver(tc.save, tc.keep, tc.save_timeout_s, tc.async_save) if tc.save else None
        self.snapshots = Saver(tc.snapshot_dir, 2, tc.save_timeout_s, tc.async_save) if tc.snapshot_every else None
        self.recorder = watch.Recorder(env.rank, lambda r: watch.coords(r, tc))
        self.faults = watch.parse_faults(tc.rehearse_fault, env.world_size)
        self.beats = watch.start(env, side_channel(), self.recorder.install(), watch.hang_seconds(tc),
                                 launcher_ranks()) if tc.watch else None
        self.traced = min(start + 1, tc.steps - 1) if tc.trace else None  # not the first step
        self.trace, self.in_a_row, self.skipped, self.busy = None, 0, [], None

    @contextlib.contextmanager
    def step(self, step):
        """Around one train_step: the watch's step, this rank's rehearsed faults, the traced step."""
        self.trace = StepTrace(self.run.env.device).start() if step == self.traced else None
        self.recorder.begin_step(step)
        watch.rehearse(self.faults, self.run.env.rank, step, self.recorder)
        self.t0 = time.perf_counter()
        with self.trace.observe(self.run, sys.modules[type(self.run).__module__]) if self.trace \
                else contextlib.nullcontext():
            yield
        self.recorder.end_step()
        self.time_s = time.perf_counter() - self.t0

    def record(self, record):
        """The step's record, with its time; a non-finite step counted (the update was skipped on every
        rank: the loss and the norm are all-reduced), and so many in a row stop every rank together;
        the traced step written."""
        record["time_s"] = self.time_s
        step, loss, norm = record["step"], record["loss"], record["grad_norm"]
        self.in_a_row = 0 if math.isfinite(loss) and math.isfinite(norm) else self.in_a_row + 1
        if self.in_a_row:
            self.skipped.append(step)
            record["skipped"] = True
            self.progress.note(f"step {step} skipped: loss {loss}, gradient norm {norm} ({self.in_a_row} in a row)")
            if self.in_a_row >= self.tc.max_skipped_steps:
                raise FloatingPointError(f"{self.in_a_row} steps in a row ({step - self.in_a_row + 1} to {step}) had "
                                         f"a non-finite loss or gradient norm; stopping (--max-skipped-steps "
                                         f"{self.tc.max_skipped_steps}). Saved checkpoints hold only finite values.")
        if self.trace:  # one track per rank, named by its place in the grid (tp fastest, then dp, pp)
            self.trace.write(self.tc.trace, f"step {step}", [f"rank {r}: {watch.coords(r, self.tc)}"
                                                             for r in range(self.run.env.world_size)])
            self.progress.note(f"trace of step {step}, one track per rank: {self.tc.trace} (open it in "
                               f"chrome://tracing or ui.perfetto.dev)")
        return record

    def phase(self, name):
        """What the watch says this rank is doing outside a train step (the eval)."""
        self.recorder.set_phase(name)

    def end(self, step, record):
        """The end of a step: the straggler report when due, the log line (on disk before a checkpoint:
        a crash between loses no line), then the checkpoint or the snapshot when one is due."""
        tc, run = self.tc, self.run
        if tc.watch and tc.straggler_every and (step + 1 - self.start) % tc.straggler_every == 0:
            record["busy_ms"] = watch.report_stragglers(run.env, tc, self.recorder, tc.straggler_every,
                                                        self.progress.note)
        if tc.watch and step == tc.steps - 1:  # the whole run's, per rank: the end report's, and this line's
            self.busy = record["busy_ms_run"] = watch.gather_busy(run.env, self.recorder, len(self.recorder.busy_ms))
        if step == self.start and run.ops:  # what the dispatcher chose
            self.progress.note(f"kernel paths: {importlib.import_module('kernels.build').report()}")
        saving = self.saver and ((tc.save_every and (step + 1) % tc.save_every == 0) or step + 1 == tc.steps)
        self.progress.log(record, durable=saving)
        if saving:
            run.opt.wait_gather()  # ZeRO-1's gathers may still be in flight; the checkpoint reads every weight
            self.recorder.set_phase("save")  # it waits under its own timeout, not the watchdog's
            self.saver.save(run, step + 1, self.progress.note)
        if self.snapshots and (step + 1) % tc.snapshot_every == 0 and step + 1 < tc.steps:
            run.opt.wait_gather()
            self.recorder.set_phase("save snapshot")
            self.snapshots.save(run, step + 1, lambda text: None)  # quietly: one a step, perhaps

    def finish(self, say):
        """After the loop: saves still being written waited for, the progress bar closed, the
        straggler report with its heat map, the watch stopped. Returns every rank's busy ms."""
        for s in (self.saver, self.snapshots):
            if s:
                self.recorder.set_phase("save")
                s.wait()
        self.progress.close()
        if self.busy:
            watch.report_stragglers(self.run.env, self.tc, self.recorder, len(self.recorder.busy_ms), say,
                                    final=True, busy=self.busy)
        watch.stop(self.beats, self.recorder)
        return self.busy
