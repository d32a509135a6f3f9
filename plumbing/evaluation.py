"""The trainer's held-out loss, forward only: what 05's train() measures at each eval point, and the
pass the end report's sum probe reads the logits through. A measurement of the model, not PTD-P, so
it lives here; 05 imports both names back. What each batch's loss weighs is the loss contract
(docs/LOSS.md) of the numbered file that made the run (05's normalization and shared_loss).

    forward_only(run, idx, targets, chunks=None)   this replica's batch through the forwards only
    evaluate(run, tokens)                          the held-out loss over --eval-batches batches
"""
import importlib
import math
import sys

import torch

from plumbing.data import replica_batch


def _trainer(run):
    """The module whose Run this is (05, run as a script or imported): its loss contract."""
    return sys.modules[type(run).__module__]


def forward_only(run, idx, targets, chunks=None):
    """This replica's batch through the pipeline's forwards only (eval mode, no gradients); chunks:
    stand-ins for run.chunks that wrap them (the end report's probe reads the logits so)."""
    pipeline = importlib.import_module("02_pipeline_1f1b")  # a numbered file: imported when called
    valid = [int((t != -100).sum()) for t in targets.chunk(run.tc.microbatches)]  # on the host
    (norm, n), wire = _trainer(run).normalization(run, valid), run.wire or pipeline.Wire(run.act_shape)
    micro = pipeline.split_batch(idx.to(run.env.device), targets.to(run.env.device), run.tc.microbatches)
    for c in run.chunks:
        c.eval()
    try:
        with torch.no_grad():
            res = run.pipe.forward_only().executor(chunks or run.chunks, run.groups.pp, wire).run(micro, valid, norm)
        res.count = n  # the whole batch's counted targets
        return res
    finally:
        for c in run.chunks:
            c.train()


def evaluate(run, tokens):
    """The held-out loss over eval_batches batches, forward only: each counted target weighs the same
    (token), or each batch's loss does (microbatch); nan if none of them counts a target."""
    dp_rank, token, shared_loss = run.pipe.replica(run.groups), run.tc.loss_normalization == "token", \
        _trainer(run).shared_loss
    results = [forward_only(run, *replica_batch(tokens, i, run.tc, dp_rank, salt=1)) for i in range(run.tc.eval_batches)]
    weights = [r.count if token else 1.0 for r in results]  # a batch with no counted target: weight 0
    return math.fsum(shared_loss(r.loss, run) * w for r, w in zip(results, weights)) / sum(weights) \
        if sum(weights) else math.nan
