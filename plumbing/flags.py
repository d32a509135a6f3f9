"""The trainer's flags that 05_3d_gpt.py does not teach: the speed switches each chapter adds after
its concept, the training loop's, and the files'. 05's TrainConfig is made of these and of its own
Layout and Optimization; --help prints each group apart (plumbing/command.py)."""
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Speed:  # the optimizations each chapter adds after its concept: each on by default here
    overlap_input_grad: bool = True  # 01: a column-parallel input gradient's all-reduce runs beside the dW GEMM
    merge_loss_reductions: bool = True  # 01: the cross-entropy's target-logit and sum-of-exp all-reduces as one
    background_sends: bool = True  # 02: a boundary waits for its receives only; its sends complete meanwhile
    overlap_grad_reduce: bool = True  # 04: reduce each gradient bucket during the chunk's last backward, not after the flush
    overlap_param_gather: bool = True  # 04, ZeRO-1: all-gather the updated weights during the next forward, not before it
    scatter_gather: bool = True  # 05: each tp rank sends 1/tp of a stage's output (Section 4.1); tp > 1 without sp
    bucket_numel: int = 2_000_000  # 04: gradient bucket, in elements
    fused_kernels: bool | None = None  # kernels/ fused ops; unset: on on GPU, off on CPU
    kernel_path: Literal["auto", "cuda", "reference", "simt"] = "auto"  # fused kernels: CUDA where they apply, forced, the PyTorch references, or (for tests, on a CPU) the CUDA source emulated (kernels/simt)
    flash_attention: bool = True  # with fused kernels: SDPA attention, or (off) matmul + fused causal softmax
    cuda_graphs: bool | None = None  # unset: on on GPU where the layout allows (tp = 1, no recompute)
    graph_scope: Literal["auto", "stage", "step"] = "auto"  # auto: the whole step at tp = pp = dp = 1, else per stage


@dataclass
class Loop:
    eval_every: int = 50  # steps between eval losses on the held-out split (0: never)
    eval_batches: int = 2  # held-out batches per eval loss
    seed: int = 1337  # weights, data order, dropout and sampling
    timeout_s: float = 120.0  # every collective's timeout, in seconds (at most 3600)
    max_skipped_steps: int = 5  # stop after this many steps in a row skipped for a non-finite loss or gradient norm
    hang_s: float | None = None  # no rank progressing this long while one waits: name the rank it waits for, stop (0: off; unset: half of --timeout-s, at least 1)
    straggler_every: int = 0  # compare every rank's busy time with its stage's every N steps (0: only at the end)
    rehearse_fault: list[str] = field(default_factory=list)  # KIND:RANK:ARG: slow:R:MS, hang:R:STEP, kill:R:STEP, stop:R:STEP
    watch: bool = True  # each rank's record on the side channel: the hang report, the straggler report (off: neither)
    check: bool | None = None  # 05's run first checks its lesson's float64 step at this layout against serial, and the machine against the lesson, and trains only if both pass (unset: on a CPU; off on GPUs, where it would add process groups to a cluster's start; 06-09's --train: never)


@dataclass
class Files:
    data: str = ""  # a text file (its bytes), or a uint16 .bin (scripts/prepare_data.py); none: the built-in corpus
    loss_mask: str = ""  # one byte per token of --data, 0 where that target is not counted (SFT: scripts/prepare_data.py --sft)
    save: str = ""  # write checkpoints under this directory
    save_every: int = 0  # steps between checkpoints (0: only at the end); needs --save
    keep: int = 2  # checkpoints kept, the newest
    save_timeout_s: float = 1800.0  # a save's own timeout: every rank's shard written and fsynced, and the rotation
    async_save: bool = False  # save in two stages: a snapshot in host memory (the only pause), then written in the background
    snapshot_every: int = 0  # steps between snapshots to --snapshot-dir, for --restarts (0: none)
    snapshot_dir: str = ""  # where snapshots go: node-local and fast, e.g. /dev/shm/snapshots
    restarts: int = 0  # when a rank dies or hangs, restart this many times from the newest snapshot or checkpoint (under torchrun: its --max-restarts)
    resume: str = ""  # continue from the newest complete checkpoint here (any layout)
    data_changed_ok: bool = False  # with --resume: go on although --data (or --loss-mask) is not the checkpoint's (said, not refused)
    init_from: str = ""  # start from GPT-2 weights: a Hugging Face GPT-2 directory, or a .pt state dict
    metrics: str = ""  # write one JSON line per step to this file (scripts/plot_metrics.py plots it)
    trace: str = ""  # write one step's per-rank timeline here (Chrome trace JSON)
    overwrite: bool = False  # let --metrics, --trace and the exports replace files this run did not write
