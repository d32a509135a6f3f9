"""The trainer's flags, argument handling that 05_3d_gpt.py does not teach: its layout and optimization,
the speed switches each chapter adds after its concept, the training loop's, and the files'. 05's
TrainConfig (05 imports it back; 06-09 subclass it) is one flat record made of these groups, which
--help prints apart (plumbing/command.py)."""
from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass
class Layout:
    tp: int = 2  # tensor-parallel size (ranks inside a stage)
    pp: int = 2  # pipeline stages
    dp: int = 2  # data-parallel replicas
    virtual_stages: int = 1  # v: model chunks per pipeline rank (interleaved 1F1B when > 1)
    batch_size: int = 32  # global batch B, in sequences
    microbatches: int = 4  # m per replica; micro-batch size b = B / (dp m)
    seq_len: int = 64  # T, tokens per sequence
    sequence_parallel: bool = False  # shard LayerNorm and dropout activations along T (Korthikanti)
    zero1: bool = False  # ZeRO-1 distributed optimizer instead of plain data parallelism
    recompute: Literal["none", "selective", "full"] = "none"  # rerun in backward: the attention core, or whole layers


@dataclass
class Optimization:
    steps: int = 200  # optimizer steps, counted from 0 (a resumed run stops at the same total)
    lr: float = 3e-3  # peak learning rate, reached after the warmup
    min_lr: float = 3e-4  # learning rate at the last step, after the cosine decay
    warmup_steps: int = 20  # linear warmup from lr/(warmup+1) to lr
    weight_decay: float = 0.1  # AdamW decay of the 2-D weights (not biases or LayerNorms)
    grad_clip: float = 1.0  # clip the global gradient norm to this
    loss_normalization: Literal["token", "microbatch"] = "token"  # the loss: every counted target of the batch alike, or each microbatch's mean alike (Megatron's default; docs/LOSS.md)
    dtype: Literal["auto", "float32", "float64", "bfloat16"] = "auto"  # auto: float32 on CPU, bfloat16 on GPU


@dataclass
class Speed:  # the optimizations each chapter adds after its concept: each on by default here
    overlap_input_grad: bool = True  # 01: a column-parallel input gradient's all-reduce runs beside the dW GEMM
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


@dataclass
class TrainConfig(Files, Loop, Speed, Optimization, Layout):
    """Every flag of the trainer, one flat record (tc.tp, tc.lr, ...); --help prints it in these groups."""


GROUPS = [(Layout, "layout"), (Optimization, "optimization"), (Speed, "speed: the chapters' optimizations"),
          (Loop, "the training loop"), (Files, "files")]
MODEL_DEFAULTS = dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)  # the main job's GPT-2


def resolve_dtype(tc, device):
    """--dtype's weights: auto is bf16 on a GPU (fp32 gradients and masters), fp32 on a CPU."""
    if tc.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, tc.dtype)
