"""Plumbing: what the numbered files need in order to run, but not what they teach. Skip it on a
first read; each module opens with what it does and how it is called.

    launch.py      one code path from 1 CPU rank to a cluster: fork-started gloo ranks on a laptop,
                   torchrun's environment (NCCL) on GPUs; a failing rank or a hang is a clear error;
                   tp groups of consecutive ranks; tensor-only gathers (no pickling, no numpy)
    cli.py         the command line, generated from the config dataclasses (help from comments)
    trace.py       every collective as it runs (01's demo lists them), Chrome traces of timelines
    charts.py      terminal charts: the loss curve, bars, 04's bucket timeline
    data.py        the built-in corpus, text and .bin files, batches every rank agrees on, the
                   token check
    tokenizer.py   GPT-2's BPE when tiktoken is installed; which tokenizer a data file names
    flags.py       05's flags: its config dataclasses (TrainConfig and its groups), which cli.py reads
    checks.py      05's config checked before any process group exists
    agreement.py   every rank of a run started with the same flags, data and checkpoint, or none trains
    paths.py       what a run writes against what it reads: no output replaces an input, lies in a
                   checkpoint or replaces a file the run did not write (--overwrite); one run per
                   --save directory
    checkpoint.py  sharded atomic checkpoints, loadable in any layout
    gpt2.py        GPT-2 weights in and out (Hugging Face's layout)
    sample.py      text from a trained model of any layout
    report.py      what 05 prints: the rank grid, the summary, the progress bar, the end report
    evaluation.py  05's held-out loss, forward only (and the pass the end report's probe reads)
    demos.py       the demos' timing, fingerprints and printed reports; 02's and 03's harness
    interleaved_demo.py  03's flags, its schedule's check and its demo's machine part
    ddp_demo.py    04's flags, checks, serial reference and its demo's machine part
    pipeline_ddp.py  what 05 adds to 04's machine for a pipeline: PipelineDDP, OverlappedGather
    replicas.py    which ranks hold a parameter's copies (04's by_replicas; 09's .replica_group)
    reference.py   the serial references the demos and tests compare with
    validate.py    02's validator: a schedule's lists complete and in order, its plans deadlock-free
    meter.py       02's executor observed from outside: each step's timeline, messages and
                   activation memory (StepRecord, ActivationMeter)
    operations.py  what 05's training loop needs that is not the loop: the refusals, the ranks'
                   agreement and 05's check before it; the watch, rehearsed faults, skipped steps,
                   the trace, saves and snapshots
    command.py     05's command line (its actions, checks and launch), and a later chapter's
    shards.py      full weights to shards and back (FullWeights: 01's ParallelGPT takes it)
    watch.py       the watch: each rank's record, the heartbeat, the watchdog, faults, restarts
    health.py      who waits for whom, stragglers: pure functions the watch reads
    selfcheck.py   --self-check: every rank, group and link tried before training
    rings.py       08's ring schedules read as data: the validator, the demo's reports
    ulysses.py     DeepSpeed-Ulysses' all-to-all attention core, 08's contrast (--cp-attention ulysses)
    experts.py     09's demo's figures (the fold, the routing) and its command line's actions

Dependencies run one way, with no cycle: a module imports at import only numbered files that do not
import it at import. Those a chapter loads at import (launch, cli, data, demos, meter, validate,
reference, replicas, ...) import no numbered file then; checkpoint.py, gpt2.py, sample.py and
report.py import 01 or 02 at import and are imported by none of 01-04 at import; ddp_demo.py and
interleaved_demo.py import 04 and 03 only when called, since those import them; pipeline_ddp.py
subclasses 04's machine, so it imports 04 at import, and 04 imports it only on first use of its two
names. tests/test_imports.py holds this.
"""
