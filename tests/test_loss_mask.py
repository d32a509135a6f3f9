"""--loss-mask (issue 41, point 4): one byte per token of --data, 0 where the target at that position
is not counted. The mask travels with its tokens (plumbing/data.Masked) through split_tokens and
global_batch, so that training and the eval loss both see -100 exactly where the mask says; it is
refused at start, by name, when it cannot be the mask of the data; every rank must hold the same mask,
and a resume on another mask (or with one where there was none) is refused.

Everything here runs in this process (the loader, preflight, the agreement's items, a manifest read
back) but one short training run that saves a checkpoint with a mask (the manifest must record it).
The refusal of a bad mask by the trainer's own command line, before any collective, is a row of
tests/test_bad_input.py's table. This file tests the masked targets only; the loss over them (per token,
across replicas) is issue 41's other points, tested with them.
"""
import json
import os
import shutil
from dataclasses import replace

import pytest
import torch

from conftest import TRAINER_BASE, TRAINER_CFG, load
from plumbing import agreement, checkpoint, checks, data

gpt3d = load("05_3d_gpt")

T = 16  # the trainer tests' seq_len
BASE = replace(TRAINER_BASE, seq_len=T)


def _ids_bin(folder, n):
    """A .bin whose token at position p is p itself (V = n): a target's value names its position."""
    path = os.path.join(folder, "ids.bin")
    with open(path, "wb") as f:
        f.write(b"".join(p.to_bytes(2, "little") for p in range(n)))
    return path


def _mask(folder, values, name="m.mask"):
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(bytes(values))
    return path


def _text(folder, n, name="t.txt"):
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(bytes(97 + i % 26 for i in range(n)))
    return path


# ----------------------------------------------------------------------------------------------
# The batches: -100 exactly where the mask is 0, in both splits; without a mask, today's batches


def test_a_target_is_minus_100_exactly_where_the_mask_byte_of_its_position_is_0_in_train_and_eval(tmp_path):
    n = 3000
    mask = [int((p * 7) % 5 != 0) for p in range(n)]
    path = _ids_bin(str(tmp_path), n)
    tokens = data.load_tokens(path, n, T, _mask(str(tmp_path), mask))
    plain = data.load_tokens(path, n, T)
    tc = replace(BASE, batch_size=8, dp=2)
    for masked_split, plain_split, salt in zip(data.split_tokens(tokens, T, path), data.split_tokens(plain, T, path),
                                               (0, 1)):
        assert len(masked_split) == len(plain_split)
        for step in range(3):
            idx, targets = data.global_batch(masked_split, step, tc, salt)
            idx0, targets0 = data.global_batch(plain_split, step, tc, salt)  # the same windows, unmasked
            assert torch.equal(idx, idx0)
            counted = torch.tensor(mask)[targets0] == 1  # targets0's value is its position in the file
            assert torch.equal(targets, torch.where(counted, targets0, -100))
            assert 0 < int(counted.sum()) < counted.numel()  # the test has both kinds in it
            rows = [data.replica_batch(masked_split, step, tc, r, salt) for r in range(2)]
            assert torch.equal(torch.cat([r[1] for r in rows]), targets)  # each replica its rows, masked


def test_without_a_mask_the_loader_gives_what_it_gave_before_and_a_mask_of_ones_changes_no_batch(tmp_path):
    path = _text(str(tmp_path), 2000)
    plain = data.load_tokens(path, 256, T)
    assert isinstance(plain, torch.Tensor)  # no wrapper without a mask: every caller as before
    ones = data.load_tokens(path, 256, T, _mask(str(tmp_path), [1] * 2000))
    assert isinstance(ones, data.Masked) and isinstance(ones.mask, data.MaskFile) and len(ones) == 2000
    assert torch.equal(ones[5:40], plain[5:40])  # tokens[a:b] are the ids, as for the tokens alone
    for a, b in zip(data.split_tokens(plain, T, path), data.split_tokens(ones, T, path)):
        for step in range(2):
            assert all(torch.equal(x, y) for x, y in zip(data.global_batch(a, step, BASE), data.global_batch(b, step, BASE)))


def test_the_mask_is_read_window_by_window_and_a_mask_truncated_mid_run_is_named(tmp_path):
    path = _text(str(tmp_path), 2000)
    mask = _mask(str(tmp_path), [1] * 2000)
    train, held = data.split_tokens(data.load_tokens(path, 256, T, mask), T, path)
    assert (train.mask.start, len(train.mask), held.mask.start, len(held.mask)) == (0, 1800, 1800, 200)
    assert held.mask[0:3].dtype == torch.uint8 and held.mask[0:3].tolist() == [1, 1, 1]
    os.truncate(mask, 1000)
    with pytest.raises(ValueError, match=f"--loss-mask {mask}: the file is 1,000 bytes now, shorter than the 1,803 "
                                         f"bytes this run reads from: it was truncated while the run trained on it"):
        held.mask[0:3]


# ----------------------------------------------------------------------------------------------
# Refused at start, by name, in preflight (before any process group): (the mask's bytes or a setup,
# the run's --data, the message). {mask} is the mask's path, {data} the data's; the data is 2,000
# tokens of text (a .bin of 1,000 where the case says bin), held out from token 1,800 (1,000: 900).

def _fifo(tmp):
    os.mkfifo(os.path.join(tmp, "m.mask"))


def _folder(tmp):
    os.makedirs(os.path.join(tmp, "m.mask"))


REFUSED = {
    "a mask without --data": (None, "", "--loss-mask {mask} needs --data FILE: the mask has one byte per token of a "
                                        "data file, and the built-in corpus has no mask; add --data FILE, or drop "
                                        "--loss-mask"),
    "a mask that does not exist": (None, "text", "--loss-mask {mask}: cannot read the mask file: No such file or "
                                                 "directory"),
    "a mask that is a directory": (_folder, "text", "--loss-mask {mask}: it is a directory, not a mask file (one byte, "
                                                    "0 or 1, per token of --data {data})"),
    "a mask that is a FIFO": (_fifo, "text", "--loss-mask {mask}: it is a FIFO (a named pipe), not a regular file: the "
                                             "mask is read window by window beside --data; write it to a file first"),
    "a mask a byte short": ([1] * 1999, "text", "--loss-mask {mask}: it is 1,999 bytes, but --data {data} holds 2,000 "
                                                "tokens: the mask must have exactly one byte (0 or 1) per token"),
    "a mask a byte long": ([1] * 2001, "text", "--loss-mask {mask}: it is 2,001 bytes, but --data {data} holds 2,000 "
                                               "tokens"),
    "a mask of one byte per byte of a .bin": ([1] * 2000, "bin", "--loss-mask {mask}: it is 2,000 bytes, but --data "
                                                                 "{data} holds 1,000 tokens"),
    "a mask holding a 2": ([1] * 7 + [2] + [1] * 1992, "text", "--loss-mask {mask}: byte 7 is 2, but every byte must "
                                                               "be 0 (the target at that position is not counted) or "
                                                               "1 (it is)"),
    "a mask of ASCII digits": (b"01" * 1000, "text", "--loss-mask {mask}: byte 0 is 48, but every byte must be 0"),
    "a mask all 0": ([0] * 2000, "text", "--loss-mask {mask}: every one of its 2,000 bytes is 0: no target of --data "
                                         "{data} would be counted, and there would be nothing to train on"),
    "a mask that counts no target of the train split": ([0] * 1801 + [1] * 199, "text",
        "--loss-mask {mask}: the train split's targets (tokens 1 to 1,799 of --data {data}) are all masked: its bytes "
        "there are all 0, and each split needs at least one 1 (the last 10% of the tokens are held out for the eval "
        "loss)"),
    "a mask that counts only the first token, which no window predicts": ([1] + [0] * 1998 + [1], "text",
        "--loss-mask {mask}: the train split's targets (tokens 1 to 1,799 of --data {data}) are all masked"),
    "a mask that counts no target of the held-out split": ([1] * 1801 + [0] * 199, "text",
        "--loss-mask {mask}: the held-out eval split's targets (tokens 1,801 to 1,999 of --data {data}) are all "
        "masked"),
    "a mask that counts no target of a .bin's held-out split": ([1] * 901 + [0] * 99, "bin",
        "--loss-mask {mask}: the held-out eval split's targets (tokens 901 to 999 of --data {data}) are all masked"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_bad_mask_is_refused_by_name_in_preflight_before_any_process_group(case, tmp_path):
    setup, kind, message = REFUSED[case]
    tmp = str(tmp_path)
    path = {"": "", "text": lambda: _text(tmp, 2000), "bin": lambda: _ids_bin(tmp, 1000)}[kind]
    path = path() if kind else ""
    mask = os.path.join(tmp, "m.mask")
    if callable(setup):
        setup(tmp)
    elif setup is not None:
        _mask(tmp, setup)
    cfg = replace(TRAINER_CFG, vocab_size=1024)
    tc = replace(BASE, data=path, loss_mask=mask)
    with pytest.raises(ValueError) as e:
        checks.preflight(cfg, tc, 1, torch.device("cpu"))
    assert message.format(mask=mask, data=path) in str(e.value)


def test_the_command_line_refuses_a_mask_without_data_and_an_empty_mask_path():
    with pytest.raises(ValueError, match="--loss-mask m.mask needs --data FILE: the mask has one byte per token"):
        checks.check_action(replace(BASE, loss_mask="m.mask"), {"loss_mask"})
    with pytest.raises(ValueError, match=r"--loss-mask: the path is empty; give the mask file \(one byte, 0 or 1, per "
                                         r"token of --data\)"):
        checks.check_action(replace(BASE, data="t.txt"), {"data", "loss_mask"})
    assert checks.check_action(replace(BASE, data="t.txt", loss_mask="m.mask"), {"data", "loss_mask"}) is None


def test_no_output_may_overwrite_the_mask(tmp_path):
    path, mask = _text(str(tmp_path), 2000), _mask(str(tmp_path), [1] * 2000)
    with pytest.raises(ValueError, match=f"--metrics {mask} would overwrite --loss-mask {mask}, which this run reads"):
        checks.check_outputs(replace(BASE, data=path, loss_mask=mask, metrics=mask, overwrite=True))


# ----------------------------------------------------------------------------------------------
# Every rank the same mask, by identity (plumbing/agreement.py)


def test_every_rank_must_hold_the_same_mask_by_its_identity_not_its_path(tmp_path):
    path = _text(str(tmp_path), 2000)
    a = _mask(str(tmp_path), [1, 0] * 1000, "a.mask")
    copy = shutil.copy(a, os.path.join(tmp_path, "copy.mask"))
    other = _mask(str(tmp_path), [0, 1] * 1000, "b.mask")
    mine = agreement.items(TRAINER_CFG, replace(BASE, data=path, loss_mask=a), None, 0)
    assert agreement.digest(mine) == agreement.digest(agreement.items(TRAINER_CFG, replace(BASE, data=path,
                                                                                           loss_mask=copy), None, 0))
    for theirs in (replace(BASE, data=path, loss_mask=other), replace(BASE, data=path)):
        items = agreement.items(TRAINER_CFG, theirs, None, 0)
        assert agreement.digest(items) != agreement.digest(mine)
        said = agreement.disagreement([mine, items])
        assert f"--loss-mask (rank 0: {a} (2,000 bytes, head and tail " in said, said
        assert ("rank 1: none)" if not theirs.loss_mask else f"rank 1: {other} (2,000 bytes") in said, said


# ----------------------------------------------------------------------------------------------
# The checkpoint records the mask; a resume on another (or with one where there was none) is refused


def _train(env, tc):
    gpt3d.train(env, TRAINER_CFG, tc, quiet=True)


@pytest.fixture(scope="module")
def masked_checkpoint(tmp_path_factory):
    """One real checkpoint (step 2, one rank, the trainer tests' model) trained with a mask."""
    from plumbing.launch import launch
    root = str(tmp_path_factory.mktemp("masked"))
    path, mask = _text(root, 2000), _mask(root, [int(p % 3 == 0) for p in range(2000)])
    launch(_train, 1, replace(BASE, steps=2, data=path, loss_mask=mask, save=os.path.join(root, "s")),
           timeout_s=20, deadline_s=60)
    return os.path.join(root, "s", "step_00000002"), path, mask


def test_the_manifest_records_the_mask_as_the_run_loaded_it(masked_checkpoint):
    ckpt, _, mask = masked_checkpoint
    manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
    assert manifest["loss_mask"] == data.identity(mask) and manifest["loss_mask"]["bytes"] == 2000


def _copy(masked_checkpoint, tmp_path, edit=None):
    ckpt = shutil.copytree(masked_checkpoint[0], os.path.join(tmp_path, "step_00000002"))
    if edit:
        file = os.path.join(ckpt, "manifest.json")
        manifest = json.load(open(file))
        edit(manifest)
        json.dump(manifest, open(file, "w"))
    return ckpt


def test_a_resume_on_the_same_mask_or_a_copy_of_it_reads_the_manifest(masked_checkpoint, tmp_path):
    ckpt, path, mask = masked_checkpoint
    copy = shutil.copy(mask, os.path.join(tmp_path, "copy.mask"))
    for m in (mask, copy):
        assert checkpoint.read_manifest(ckpt, TRAINER_CFG, replace(BASE, data=path, loss_mask=m))["step"] == 2


RESUMED = {  # case: (the resumed run's mask: "other", "none"; the manifest's edit; the message)
    "another mask": ("other", None, "--loss-mask {other} is not the mask the checkpoint {ckpt} was trained with (the "
                                    "same 2,000 bytes, other contents at its head or tail): a resumed run would count "
                                    "other targets than the run it continues; give --loss-mask the mask it was "
                                    "trained with, or give --data-changed-ok to continue all the same"),
    "no mask where it had one": ("none", None, "no --loss-mask: the checkpoint {ckpt} was trained with one (2,000 "
                                               "bytes, head and tail "),
    "a mask where it had none": ("other", lambda m: m.update(loss_mask=None),
                                 "--loss-mask {other}: the checkpoint {ckpt} was trained without a loss mask (every "
                                 "target counted): a resumed run would count other targets than the run it "
                                 "continues; drop --loss-mask"),
    "a manifest whose mask record lies": ("other", lambda m: m.update(loss_mask={"bytes": 3}),
                                          "manifest.json is malformed: missing or wrong loss_mask {{'bytes': 3}} (null, "
                                          "or an object: bytes, a whole number, and head_tail_sha256, 64 hex digits)"),
}


@pytest.mark.parametrize("case", RESUMED)
def test_a_resume_on_another_mask_is_refused_by_name(masked_checkpoint, tmp_path, case):
    which, edit, message = RESUMED[case]
    _, path, _ = masked_checkpoint
    ckpt = _copy(masked_checkpoint, str(tmp_path), edit)
    other = _mask(str(tmp_path), [int(p % 3 == 1) for p in range(2000)], "other.mask")
    tc = replace(BASE, data=path, loss_mask=other if which == "other" else "")
    with pytest.raises(ValueError) as e:
        checkpoint.read_manifest(ckpt, TRAINER_CFG, tc)
    assert message.format(ckpt=ckpt, other=other) in str(e.value)
    said = []  # --data-changed-ok goes on, and says so (a lying record is still refused)
    if "lies" not in case:
        checkpoint.read_manifest(ckpt, TRAINER_CFG, replace(tc, data_changed_ok=True), said.append)
        assert len(said) == 1 and said[0].endswith("continuing (--data-changed-ok): other targets are counted from "
                                                   "here on"), said


def test_a_checkpoint_from_before_masks_were_recorded_resumes_with_or_without_one(masked_checkpoint, tmp_path):
    _, path, mask = masked_checkpoint
    ckpt = _copy(masked_checkpoint, str(tmp_path), lambda m: m.pop("loss_mask"))
    for m in (mask, ""):
        assert checkpoint.read_manifest(ckpt, TRAINER_CFG, replace(BASE, data=path, loss_mask=m))["step"] == 2
