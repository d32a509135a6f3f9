"""Bad input never costs a run: one table of bad command lines and bad files across all five
files, the planner and every artefact the trainer reads (issue 15).

Each case runs the script as a user does (conftest.run_script: its own process group, exit code
and output) and must exit non-zero within 10 s on 2 cores, with a message that names the flag or
the file, without a traceback, and with no process of the run left behind. Every field of every
config must have its constraint in plumbing/checks.FIELDS (the last tests), so none can slip past.
"""
import dataclasses
import json
import os
import shutil
import struct
from dataclasses import replace

import pytest
import torch

from conftest import TRAINER_BASE, TRAINER_CFG, load, run_script
from plumbing import checks, sample

tensor_parallel, pipeline = load("01_tensor_parallel"), load("02_pipeline_1f1b")
interleaved, data_parallel, gpt3d = load("03_interleaved"), load("04_data_parallel"), load("05_3d_gpt")

# 05 with the trainer tests' model, so that the checkpoint made below fits it.
T05 = ["--tp", "1", "--pp", "2", "--dp", "1", "--n-layer", "8", "--n-head", "2", "--n-embd", "16",
       "--block-size", "16", "--batch-size", "8", "--microbatches", "2", "--seq-len", "16"]
HF = dict(vocab_size=256, n_positions=16, n_layer=8, n_head=2, n_embd=16)  # a GPT-2 config.json that fits

# (script, arguments, what the message must say). {tmp} is the case's own directory, {ckpt} a copy
# of a real checkpoint, {file} a file the case's `files` entry wrote, {hf} a GPT-2 directory.
CASES = {
    # 01: tensor parallelism
    "01 tp 0": ("01", ["--tp", "0"], "--tp must be at least 1, got 0"),
    "01 tp -2": ("01", ["--tp", "-2"], "--tp must be at least 1, got -2"),
    "01 tp not an int": ("01", ["--tp", "two"], "--tp: invalid int value: 'two'"),
    "01 tp not dividing heads": ("01", ["--tp", "3"], "--n-head: need n_embd=64 divisible by n_head=4, and n_head divisible by tp=3"),
    "01 n_head 0": ("01", ["--n-head", "0"], "--n-head must be at least 1, got 0"),
    "01 n_embd not divisible": ("01", ["--n-head", "3"], "n_embd=64 divisible by n_head=3"),
    "01 n_embd 0": ("01", ["--n-embd", "0"], "--n-embd must be at least 1, got 0"),
    "01 n_layer 0": ("01", ["--n-layer", "0"], "--n-layer must be at least 1, got 0"),
    "01 vocab 0": ("01", ["--vocab-size", "0"], "--vocab-size must be at least 1, got 0"),
    "01 block 0": ("01", ["--block-size", "0"], "--block-size must be at least 1, got 0"),
    "01 seq 0": ("01", ["--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    "01 seq beyond block": ("01", ["--seq-len", "65"], "--seq-len 65 exceeds --block-size 64"),
    "01 batch 0": ("01", ["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    "01 seed -1": ("01", ["--seed", "-1"], "--seed must be in [0, 2**31), got -1"),
    "01 dropout 1": ("01", ["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    "01 dropout nan": ("01", ["--dropout", "nan"], "--dropout must be a finite number, got nan"),
    "01 sp with odd T": ("01", ["--sequence-parallel", "--seq-len", "33"], "--sequence-parallel needs --seq-len 33 divisible by tp=2"),
    "01 unknown flag": ("01", ["--pipeline", "2"], "unrecognized arguments: --pipeline 2"),
    # 02: GPipe and 1F1B
    "02 pp 0": ("02", ["--pp", "0"], "--pp must be at least 1, got 0"),
    "02 pp not dividing layers": ("02", ["--pp", "3"], "n_layer=4 is not divisible by 3 pipeline stages"),
    "02 pp beyond layers": ("02", ["--pp", "8"], "n_layer=4 is not divisible by 8 pipeline stages"),
    "02 m 0": ("02", ["--microbatches", "0"], "--microbatches must be at least 1, got 0"),
    "02 m -3": ("02", ["--microbatches", "-3"], "--microbatches must be at least 1, got -3"),
    "02 batch not divisible by m": ("02", ["--batch-size", "7"], "--batch-size: the global batch of 7 sequences is not divisible by dp x m = 1 x 8"),
    "02 seq 0": ("02", ["--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    "02 unknown schedule": ("02", ["--schedule", "zb"], "--schedule: invalid choice: 'zb'"),
    "02 trace in a missing folder": ("02", ["--trace", "{tmp}/no/t.json"], "--trace {tmp}/no/t.json: the directory"),
    "02 trace is a folder": ("02", ["--trace", "{tmp}"], "--trace {tmp}: it is a directory"),
    "02 seed too large": ("02", ["--seed", "4294967296"], "--seed must be in [0, 2**31)"),
    "02 n_layer 0": ("02", ["--n-layer", "0"], "--n-layer must be at least 1, got 0"),
    # 03: interleaved 1F1B
    "03 v 0": ("03", ["--virtual-stages", "0"], "--virtual-stages must be at least 1, got 0"),
    "03 v -1": ("03", ["--virtual-stages", "-1"], "--virtual-stages must be at least 1, got -1"),
    "03 m not a multiple of pp": ("03", ["--microbatches", "6"], "m=6 must be divisible by pp=4"),
    "03 layers not dividing pp v": ("03", ["--virtual-stages", "3"], "n_layer=8 is not divisible by 12 pipeline stages"),
    "03 pp 3": ("03", ["--pp", "3", "--microbatches", "6"], "n_layer=8 is not divisible by 6 pipeline stages"),
    "03 trace is a folder": ("03", ["--trace", "{tmp}"], "--trace {tmp}: it is a directory"),
    "03 batch -2": ("03", ["--batch-size", "-2"], "--batch-size must be at least 1, got -2"),
    "03 dropout -0.5": ("03", ["--dropout", "-0.5"], "--dropout must be in [0, 1), got -0.5"),
    # 04: data parallelism
    "04 dp 0": ("04", ["--dp", "0"], "--dp must be at least 1, got 0"),
    "04 steps 0": ("04", ["--steps", "0"], "--steps must be at least 1, got 0"),
    "04 m 0": ("04", ["--microbatches", "0"], "--microbatches must be at least 1, got 0"),
    "04 bucket 0": ("04", ["--bucket-numel", "0"], "--bucket-numel must be at least 1, got 0"),
    "04 batch not divisible": ("04", ["--batch-size", "12", "--microbatches", "2"], "not divisible by dp x m = 4 x 2"),
    "04 lr 0": ("04", ["--lr", "0"], "--lr must be positive, got 0.0"),
    "04 lr -1": ("04", ["--lr", "-1"], "--lr must be positive, got -1.0"),
    "04 lr inf": ("04", ["--lr", "inf"], "--lr must be a finite number, got inf"),
    "04 seq beyond block": ("04", ["--seq-len", "65"], "--seq-len 65 exceeds --block-size 64"),
    "04 n_embd 63": ("04", ["--n-embd", "63"], "n_embd=63 divisible by n_head=4"),
    # 05: the trainer's flags
    "05 tp 0": ("05", ["--tp", "0"], "--tp must be at least 1, got 0"),
    "05 pp -1": ("05", ["--pp", "-1"], "--pp must be at least 1, got -1"),
    "05 dp 0": ("05", ["--dp", "0"], "--dp must be at least 1, got 0"),
    "05 v 0": ("05", ["--virtual-stages", "0"], "--virtual-stages must be at least 1, got 0"),
    "05 batch 0": ("05", ["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    "05 m 0": ("05", ["--microbatches", "0"], "--microbatches must be at least 1, got 0"),
    "05 seq 0": ("05", ["--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    "05 steps 0": ("05", ["--steps", "0"], "--steps must be at least 1, got 0"),
    "05 lr 0": ("05", ["--lr", "0"], "--lr must be positive, got 0.0"),
    "05 lr nan": ("05", ["--lr", "nan"], "--lr must be a finite number, got nan"),
    "05 min_lr -1": ("05", ["--min-lr", "-1"], "--min-lr must be at least 0, got -1.0"),
    "05 min_lr above lr": ("05", ["--min-lr", "0.1"], "--min-lr 0.1 is above --lr 0.003"),
    "05 warmup -1": ("05", ["--warmup-steps", "-1"], "--warmup-steps must be at least 0, got -1"),
    "05 weight decay -1": ("05", ["--weight-decay", "-1"], "--weight-decay must be at least 0, got -1.0"),
    "05 clip 0": ("05", ["--grad-clip", "0"], "--grad-clip must be positive, got 0.0"),
    "05 bucket 0": ("05", ["--bucket-numel", "0"], "--bucket-numel must be at least 1, got 0"),
    "05 eval every -1": ("05", ["--eval-every", "-1"], "--eval-every must be at least 0, got -1"),
    "05 eval batches 0": ("05", ["--eval-batches", "0"], "--eval-batches must be at least 1, got 0"),
    "05 seed -5": ("05", ["--seed", "-5"], "--seed must be in [0, 2**31), got -5"),
    "05 timeout 0": ("05", ["--timeout-s", "0"], "--timeout-s must be positive and at most 3600"),
    "05 timeout 1e12": ("05", ["--timeout-s", "1e12"], "--timeout-s must be positive and at most 3600 (seconds), got 1000000000000.0"),
    "05 timeout nan": ("05", ["--timeout-s", "nan"], "--timeout-s must be a finite number, got nan"),
    "05 save timeout 0": ("05", ["--save-timeout-s", "0"], "--save-timeout-s must be positive and at most 86400 (seconds), got 0.0"),
    "05 hang above the timeout": ("05", ["--hang-s", "200"], "--hang-s 200 must be below --timeout-s 120"),
    "05 hang negative": ("05", ["--hang-s", "-1"], "--hang-s must be 0 (off) or positive, at most 3600 (seconds), got -1.0"),
    "05 straggler every negative": ("05", ["--straggler-every", "-2"], "--straggler-every must be at least 0, got -2"),
    "05 snapshots without a directory": ("05", ["--snapshot-every", "2"], "--snapshot-every 2 needs --snapshot-dir DIR"),
    "05 restarts negative": ("05", ["--restarts", "-1"], "--restarts must be at least 0, got -1"),
    "05 fault unknown kind": ("05", ["--rehearse-fault", "melt:1:2"], "--rehearse-fault 'melt:1:2' must be KIND:RANK:ARG"),
    "05 fault rank outside the world": ("05", ["--rehearse-fault", "kill:8:3"],
                                        "--rehearse-fault 'kill:8:3': rank 8 is not below the world size 8"),
    "05 save every -1": ("05", ["--save-every", "-1"], "--save-every must be at least 0, got -1"),
    "05 save every without save": ("05", ["--save-every", "5"], "--save-every 5 needs --save DIR"),
    "05 keep 0": ("05", ["--keep", "0"], "--keep must be at least 1, got 0"),
    "05 max skipped 0": ("05", ["--max-skipped-steps", "0"], "--max-skipped-steps must be at least 1, got 0"),
    "05 n_head 0": ("05", ["--n-head", "0"], "--n-head must be at least 1, got 0"),
    "05 n_head 3": ("05", ["--n-head", "3"], "n_embd=64 divisible by n_head=3"),
    "05 n_embd 0": ("05", ["--n-embd", "0"], "--n-embd must be at least 1, got 0"),
    "05 layers not dividing pp v": ("05", ["--n-layer", "6", "--virtual-stages", "2"], "n_layer=6 is not divisible by 4 pipeline stages"),
    "05 vocab 0": ("05", ["--vocab-size", "0"], "--vocab-size must be at least 1, got 0"),
    "05 block 0": ("05", ["--block-size", "0"], "--block-size must be at least 1, got 0"),
    "05 dropout 1.5": ("05", ["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
    "05 seq beyond block": ("05", ["--seq-len", "65"], "--seq-len 65 exceeds --block-size 64"),
    "05 sp with odd T": ("05", ["--sequence-parallel", "--seq-len", "63"], "--sequence-parallel needs --seq-len 63 divisible by tp=2"),
    "05 batch not divisible": ("05", ["--batch-size", "12"], "not divisible by dp x m = 2 x 4"),
    "05 interleaving m": ("05", ["--virtual-stages", "2", "--n-layer", "8", "--microbatches", "3", "--batch-size", "12"], "m=3 must be divisible by pp=2"),
    "05 unknown dtype": ("05", ["--dtype", "float16"], "--dtype: invalid choice: 'float16'"),
    "05 unknown kernel path": ("05", ["--kernel-path", "fast"], "--kernel-path: invalid choice: 'fast'"),
    "05 whole-step graph with world 8": ("05", ["--graph-scope", "step"], "it needs tp = pp = dp = 1, got tp=2"),
    "05 CUDA graphs on CPU": ("05", ["--cuda-graphs", "--tp", "1", "--dp", "4"], "--cuda-graphs needs a GPU"),
    "05 CUDA graphs with tp 2": ("05", ["--cuda-graphs"], "needs tp=1 (a stage with tp > 1 holds all-reduces)"),
    "05 CUDA kernels forced on CPU": ("05", ["--fused-kernels", "--kernel-path", "cuda"], "--kernel-path cuda forces the CUDA kernels"),
    "05 model beyond memory": ("05", ["--n-layer", "200", "--n-embd", "8192", "--n-head", "64"], "--n-layer 200 --n-embd 8192"),
    "05 layout with tp 0": ("05", ["--print-layout", "--tp", "0"], "--tp must be at least 1, got 0"),
    "05 export without resume": ("05", ["--export-state-dict", "{tmp}/m.pt"], "exporting needs --resume DIR"),
    # 05: data
    "data missing": ("05", ["--data", "{tmp}/missing.txt"], "cannot read the data file"),
    "data is a folder": ("05", ["--data", "{tmp}"], "--data {tmp}: it is a directory"),
    "data folder named .bin": ("05", ["--data", "{tmp}/x.bin"], "--data {tmp}/x.bin: it is a directory"),
    "data empty": ("05", ["--data", "{file}"], "is empty"),
    "data odd-length bin": ("05", ["--data", "{file}"], "is not a whole number of 2-byte (uint16) token ids"),
    "data shorter than a sequence": ("05", ["--data", "{file}"], "fewer than one sequence of seq_len + 1 = 65"),
    "data too short for the eval split": ("05", ["--data", "{file}", "--seq-len", "16"], "cannot hold a sequence of seq_len + 1 = 17 to train on and another held out"),
    "data ids beyond the vocabulary": ("05", ["--data", "{file}"], "token id 1000 >= vocab_size=256"),
    # 05: output paths
    "save is a file": ("05", ["--save", "{file}"], "it is a file, not a directory for checkpoints"),
    "save under a file": ("05", ["--save", "{file}/ckpt"], "cannot write checkpoints there"),
    "metrics in a missing folder": ("05", ["--metrics", "{tmp}/no/m.jsonl"], "--metrics {tmp}/no/m.jsonl: the directory"),
    "metrics is a folder": ("05", ["--metrics", "{tmp}"], "--metrics {tmp}: it is a directory"),
    "trace is a folder": ("05", ["--trace", "{tmp}"], "--trace {tmp}: it is a directory"),
    "trace under a file": ("05", ["--trace", "{file}/t.json"], "the directory"),
    # 05: checkpoints to resume
    "resume a manifest that is not JSON": ("05", [*T05, "--resume", "{ckpt}"], "no readable manifest.json"),
    "resume a manifest without its step": ("05", [*T05, "--resume", "{ckpt}"], "manifest.json is malformed: missing or wrong step"),
    "resume a manifest whose layout is not its world": ("05", [*T05, "--resume", "{ckpt}"], "tp x pp x dp must equal world=5"),
    "resume another model": ("05", [*T05, "--n-layer", "4", "--resume", "{ckpt}"], "was written with n_layer=8 (this run 4)"),
    "resume another batch": ("05", [*T05, "--batch-size", "16", "--resume", "{ckpt}"], "batch_size=8 (this run 16)"),
    "resume a truncated shard": ("05", [*T05, "--steps", "4", "--resume", "{ckpt}"], "rank_00001.pt is missing, truncated or corrupt"),
    "resume a missing shard": ("05", [*T05, "--steps", "4", "--resume", "{ckpt}"], "rank_00000.pt is missing, truncated or corrupt"),
    "resume a shard that is not a shard": ("05", [*T05, "--steps", "4", "--resume", "{ckpt}"], "rank_00000.pt is malformed"),
    "export a truncated shard": ("05", ["--resume", "{ckpt}", "--export-hf", "{tmp}/out"], "rank_00001.pt is missing, truncated or corrupt"),
    "sample from a shard of wrong shapes": ("05", ["--resume", "{ckpt}", "--sample", "a"], "rank_00000.pt is malformed"),
    # 05: GPT-2 weights and state dicts
    "init from nothing": ("05", ["--init-from", "{tmp}/none"], "--init-from {tmp}/none: no such file or directory"),
    "init from a garbage .pt": ("05", ["--init-from", "{file}"], "not a state dict that --export-state-dict writes"),
    "init from a .pt holding a list": ("05", ["--init-from", "{file}"], "holds a list, not a state dict"),
    "init from a .pt that does not fit its config": ("05", ["--init-from", "{file}"], "does not fit its own config"),
    "gpt2 config without n_embd": ("05", ["--init-from", "{hf}"], "config.json: n_embd must be a positive integer, got 'nothing'"),
    "gpt2 config not an object": ("05", ["--init-from", "{hf}"], "config.json is not a JSON object"),
    "gpt2 relu": ("05", ["--init-from", "{hf}"], "activation_function='relu' is not supported"),
    "gpt2 erf gelu": ("05", ["--init-from", "{hf}"], "activation_function='gelu' is not supported"),
    "gpt2 untied config": ("05", ["--init-from", "{hf}"], "tie_word_embeddings=False is not supported"),
    "gpt2 epsilon": ("05", ["--init-from", "{hf}"], "layer_norm_epsilon=0.01 is not supported"),
    "gpt2 unscaled attention": ("05", ["--init-from", "{hf}"], "scale_attn_weights=False is not supported"),
    "gpt2 inverse layer scaling": ("05", ["--init-from", "{hf}"], "scale_attn_by_inverse_layer_idx=True is not supported"),
    "gpt2 wider mlp": ("05", ["--init-from", "{hf}"], "n_inner=32 is not supported"),
    "gpt2 untied weights": ("05", ["--init-from", "{hf}"], "lm_head.weight differs from transformer.wte.weight"),
    "gpt2 garbage weights": ("05", ["--init-from", "{hf}"], "pytorch_model.bin cannot be read as weights"),
    # 05: sampling
    "sample with temperature 0": ("05", ["--init-from", "{file}", "--sample", "a", "--temperature", "0"], "--temperature must be positive (for greedy decoding use --top-k 1), got 0.0"),
    "sample with top-k -1": ("05", ["--init-from", "{file}", "--sample", "a", "--top-k", "-1"], "--top-k must be at least 0, got -1"),
    "sample no new tokens": ("05", ["--init-from", "{file}", "--sample", "a", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
    "sample an empty prompt": ("05", ["--init-from", "{file}", "--sample", ""], "--sample: the prompt is empty"),
    "sample without weights": ("05", ["--sample", "a"], "--sample needs"),
    # the planner (planner.py checks its own flags; tests/test_planner.py has the full table)
    "plan on 0 GPUs": ("05", ["--plan", "1T", "--gpus", "0"], "--gpus"),
    "plan on -8 GPUs": ("05", ["--plan", "1T", "--gpus", "-8"], "--gpus"),
    "plan a negative batch": ("05", ["--plan", "1T", "--gpus", "3072", "--plan-batch", "-1"], "--plan-batch"),
    "plan an unknown model": ("05", ["--plan", "2T"], "--plan=2T: give a model of Table 1"),
    "plan a model with 0 heads": ("05", ["--plan", "custom", "--n-head", "0", "--gpus", "8"], "--n-head"),
}

SCRIPTS = {"01": "01_tensor_parallel.py", "02": "02_pipeline_1f1b.py", "03": "03_interleaved.py",
           "04": "04_data_parallel.py", "05": "05_3d_gpt.py"}


def _train(env, root):
    gpt3d.train(env, TRAINER_CFG, replace(TRAINER_BASE, pp=2, steps=2, save=root), quiet=True)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """One real checkpoint (step 2, tp1 x pp2, the trainer tests' model), copied for each case."""
    from plumbing.launch import launch
    root = str(tmp_path_factory.mktemp("ckpt"))
    launch(_train, 2, root, timeout_s=20, deadline_s=60)
    return os.path.join(root, "step_00000002")


def _json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def _gpt2_dir(folder, config=None, weights=True, head=None):
    os.makedirs(folder)
    _json(os.path.join(folder, "config.json"), config if config is not None else HF)
    if weights:
        full = tensor_parallel.init_state_dict(TRAINER_CFG, 0)
        if head is not None:
            full["lm_head.weight"] = head
        torch.save(full, os.path.join(folder, "pytorch_model.bin"))


def _edit_manifest(ckpt, edit):
    file = os.path.join(ckpt, "manifest.json")
    with open(file) as f:
        manifest = json.load(f)
    edit(manifest)
    _json(file, manifest)


def _setup(case, tmp, ckpt):
    """Write what the case reads; returns the substitutions for its arguments."""
    file, hf = os.path.join(tmp, "input"), os.path.join(tmp, "gpt2")
    if case == "data folder named .bin":
        os.makedirs(os.path.join(tmp, "x.bin"))
    writes = {
        "data empty": b"", "data odd-length bin": b"\x01\x00\x02",
        "data shorter than a sequence": struct.pack("<10H", *range(10)),
        "data too short for the eval split": bytes(range(30)),
        "data ids beyond the vocabulary": struct.pack("<200H", *[1000] * 200),
        "save is a file": b"x", "save under a file": b"x", "trace under a file": b"x",
        "init from a garbage .pt": b"this is not a zip archive",
    }
    if case.startswith("data ") and case in writes and case != "data empty":
        file += ".bin" if "bin" in case or "beyond" in case or "shorter" in case else ".txt"
    if case in writes:
        with open(file, "wb") as f:
            f.write(writes[case])
    if case == "init from a .pt holding a list":
        file += ".pt"
        torch.save([1, 2, 3], file)
    if case == "init from a .pt that does not fit its config":
        file += ".pt"
        torch.save({**tensor_parallel.init_state_dict(replace(TRAINER_CFG, n_embd=32, n_head=2), 0),
                    "_config": dataclasses.asdict(TRAINER_CFG)}, file)
    if case.startswith("sample with") or case.startswith("sample no") or case == "sample an empty prompt":
        file += ".pt"
        torch.save({**tensor_parallel.init_state_dict(TRAINER_CFG, 0), "_config": dataclasses.asdict(TRAINER_CFG)}, file)
    gpt2_configs = {
        "gpt2 config without n_embd": {k: v for k, v in HF.items() if k != "n_embd"},
        "gpt2 config not an object": [HF], "gpt2 relu": {**HF, "activation_function": "relu"},
        "gpt2 erf gelu": {**HF, "activation_function": "gelu"}, "gpt2 untied config": {**HF, "tie_word_embeddings": False},
        "gpt2 epsilon": {**HF, "layer_norm_epsilon": 1e-2}, "gpt2 unscaled attention": {**HF, "scale_attn_weights": False},
        "gpt2 inverse layer scaling": {**HF, "scale_attn_by_inverse_layer_idx": True}, "gpt2 wider mlp": {**HF, "n_inner": 32},
    }
    if case in gpt2_configs:
        _gpt2_dir(hf, gpt2_configs[case], weights=False)
    if case == "gpt2 untied weights":
        _gpt2_dir(hf, head=torch.zeros(256, 16))
    if case == "gpt2 garbage weights":
        _gpt2_dir(hf, weights=False)
        with open(os.path.join(hf, "pytorch_model.bin"), "wb") as f:
            f.write(b"garbage")
    copy = os.path.join(tmp, "ckpt")
    if "{ckpt}" in " ".join(CASES[case][1]):
        shutil.copytree(ckpt, copy)
        shard0, shard1 = os.path.join(copy, "rank_00000.pt"), os.path.join(copy, "rank_00001.pt")
        if case == "resume a manifest that is not JSON":
            with open(os.path.join(copy, "manifest.json"), "w") as f:
                f.write("{not json")
        if case == "resume a manifest without its step":
            _edit_manifest(copy, lambda m: m.pop("step"))
        if case == "resume a manifest whose layout is not its world":
            _edit_manifest(copy, lambda m: m.update(world=5))
        if case in ("resume a truncated shard", "export a truncated shard"):
            with open(shard1, "r+b") as f:
                f.truncate(os.path.getsize(shard1) // 2)
        if case == "resume a missing shard":
            os.remove(shard0)
        if case == "resume a shard that is not a shard":
            torch.save({"weights": torch.zeros(3)}, shard0)
        if case == "sample from a shard of wrong shapes":
            shard = torch.load(shard0, weights_only=True)
            shard["chunks"][0]["transformer.wpe.weight"] = torch.zeros(3, 3)
            torch.save(shard, shard0)
    return {"{tmp}": tmp, "{ckpt}": copy, "{file}": file, "{hf}": hf}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_by_name_within_seconds_and_leaves_nothing_running(case, tmp_path, checkpoint_dir):
    script, args, message = CASES[case]
    subs = _setup(case, str(tmp_path), checkpoint_dir)
    for key, value in subs.items():
        args = [a.replace(key, value) for a in args]
        message = message.replace(key, value)
    proc = run_script(SCRIPTS[script], *args, timeout=30)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.seconds < 10, f"{proc.seconds:.1f} s"
    assert proc.leftover == []


def test_the_table_covers_a_hundred_cases_and_every_file():
    assert len(CASES) >= 100
    assert {script for script, _, _ in CASES.values()} == set(SCRIPTS)


zero_bubble, vocab_parallel = load("06_zero_bubble"), load("07_vocab_parallel")
CONFIGS = [tensor_parallel.GPTConfig, gpt3d.TrainConfig, sample.SampleConfig, tensor_parallel.DemoConfig,
           pipeline.DemoConfig, interleaved.DemoConfig, data_parallel.DemoConfig, zero_bubble.DemoConfig,
           zero_bubble.TrainConfig, vocab_parallel.DemoConfig, vocab_parallel.TrainConfig]


@pytest.mark.parametrize("cls", CONFIGS, ids=[f"{c.__module__}.{c.__name__}" for c in CONFIGS])
def test_every_config_field_has_its_constraint_in_the_one_table(cls):
    assert [f.name for f in dataclasses.fields(cls) if f.name not in checks.FIELDS] == []
    checks.check_fields(cls())  # and every default passes it
