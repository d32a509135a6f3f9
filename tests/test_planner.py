"""planner.py (05's --plan): closed forms against the paper's numbers and against 01's GPT-2; the
throughput model against Table 1's measurements; bad planner input refused by name.

Tolerances: exact for parameter counts of our own model; Table 1 prints one decimal, so eq. 2 is
held to 1% or that rounding; eq. 4 to 5% of the paper's quoted training times (its inputs are
rounded: 163 TFLOP/s, "1T" parameters). The throughput model is held to 10% of every Table 1 row
(the issue's bar: one set of constants from datasheets and published measurements, none fitted,
against end-to-end measurements that include data loading and logging the model leaves out).
"""
import argparse
import math
import random
import re

import pytest

import planner
from conftest import load, run_script

tensor_parallel, pipeline, gpt3d = load("01_tensor_parallel"), load("02_pipeline_1f1b"), load("05_3d_gpt")
interleaved = load("03_interleaved")

ONE_T = planner.model_spec("1T")
GPT3 = planner.ModelSpec(n_layer=96, n_embd=12288, n_head=96)  # Narayanan Section 5.1's example


@pytest.mark.parametrize("V, s, l, a, h", [(101, 16, 2, 2, 8), (1001, 64, 3, 4, 64),
                                           (50, 7, 1, 1, 12), (257, 32, 4, 6, 48)])
def test_exact_count_is_the_real_gpt(V, s, l, a, h):
    cfg = tensor_parallel.GPTConfig(vocab_size=V, block_size=s, n_layer=l, n_head=a, n_embd=h)
    # init=False: the same modules, without init_state_dict's meta-device model, whose first
    # normal_ makes torch import its reference kernels (~2 s).
    real = sum(p.numel() for p in tensor_parallel.GPT(cfg, init=False).parameters())
    assert planner.params_exact(planner.model_spec(cfg)) == real
    assert planner.params_exact(planner.model_spec(cfg)) - planner.params_eq2(planner.model_spec(cfg)) \
        == pytest.approx(2 * h)  # eq. 2 leaves out the final LayerNorm


@pytest.mark.parametrize("name", list(planner.PAPER_CONFIGS))
def test_eq2_reproduces_table1(name):
    row, m = planner.PAPER_CONFIGS[name], planner.model_spec(name)
    billions = planner.params_eq2(m) / 1e9
    # Table 1 prints one decimal: 1.7B is 1.652B and 3.6B is 3.562B (1.3% off, within rounding),
    # so the check is 1% or the table's rounding, and the rounded value must match exactly.
    assert abs(billions - row.billions) <= max(0.01 * row.billions, 0.05)
    assert round(billions, 1) == row.billions
    assert (m.vocab_size, m.seq_len) == (51200, 2048)


@pytest.mark.parametrize("name", list(planner.PAPER_CONFIGS))
def test_eq3_gives_plausible_iteration_times(name):
    row, m = planner.PAPER_CONFIGS[name], planner.model_spec(name)
    seconds = planner.flops_per_iteration(m, row.batch) / (row.n_gpus * row.tflops * 1e12)
    assert math.isfinite(seconds) and 1 < seconds < 200
    assert planner.layout_problems(m, planner.Layout(row.tp, row.pp, row.n_gpus // (row.tp * row.pp),
                                               row.batch), row.n_gpus) == []


def test_eq3_terms():
    B, s, l, h, V = 8, ONE_T.seq_len, ONE_T.n_layer, ONE_T.n_embd, ONE_T.vocab_size
    paper = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert planner.flops_per_iteration(ONE_T, B) == pytest.approx(paper, rel=1e-12)
    # Without recomputation exactly one forward of the layers goes, the logit layer stays.
    saved = paper - planner.flops_per_iteration(ONE_T, B, recompute=False)
    assert saved == pytest.approx(24 * B * s * l * h**2 * (1 + s / (6 * h)), rel=1e-12)


def test_eq4_training_days_within_5_percent_of_the_paper():
    assert planner.training_days(450e9, planner.params_eq2(ONE_T), 3072, 163) == pytest.approx(84, rel=0.05)
    assert planner.training_days(300e9, planner.params_eq2(GPT3), 1024, 140) == pytest.approx(34, rel=0.05)
    assert planner.training_days(1, 1, 1, 1, recompute=False) == pytest.approx(
        0.75 * planner.training_days(1, 1, 1, 1))


def test_bubble():
    assert planner.bubble_fraction(8, 32) == 7 / 32
    assert planner.bubble_fraction(8, 32, v=2) == 7 / 64
    assert planner.bubble_fraction(1, 5) == 0


def test_layers_in_flight_follow_korthikanti():
    l = ONE_T.n_layer
    L = planner.Layout(8, 16, 24, 3072)
    assert planner.layers_in_flight(ONE_T, L) == l  # 1F1B: pp microbatches x l/pp layers
    Lv = planner.Layout(8, 16, 24, 3072, v=4)
    assert planner.layers_in_flight(ONE_T, Lv) == pytest.approx(l * (1 + 15 / (16 * 4)))
    few = planner.Layout(8, 16, 24, 24 * 4)  # m = 4 < pp: only 4 microbatches exist
    assert planner.layers_in_flight(ONE_T, few) == 4 * l / 16


def test_activation_formulas_agree_at_tp1_and_sp_divides_by_tp():
    m = planner.model_spec("145.6B")
    ref = m.seq_len * m.n_embd * (34 + 5 * m.n_head * m.seq_len / m.n_embd)
    for sp in (False, True):
        L = planner.Layout(1, 1, 1, 1, recompute=False, sequence_parallel=sp)
        assert planner.activation_bytes_per_layer(m, L) == pytest.approx(ref)
    L8 = planner.Layout(8, 1, 1, 1, recompute=False, sequence_parallel=True)
    assert planner.activation_bytes_per_layer(m, L8) == pytest.approx(ref / 8)
    full = planner.Layout(8, 1, 1, 1, recompute=True, sequence_parallel=True)
    assert planner.activation_bytes_per_layer(m, full) == 2 * m.seq_len * m.n_embd / 8


def test_memory_falls_as_tp_pp_dp_grow():
    m, B = planner.model_spec("145.6B"), 2304
    total = lambda **k: planner.memory_per_gpu(m, planner.Layout(batch=B, **k))["total"]  # noqa: E731
    tps = [total(tp=t, pp=8, dp=8) for t in (1, 2, 4, 8)]
    pps = [total(tp=8, pp=p, dp=8) for p in (1, 2, 4, 8, 16)]
    dps = [total(tp=8, pp=8, dp=d, zero1=True) for d in (1, 2, 4, 8)]
    for seq in (tps, pps, dps):
        assert all(a > b for a, b in zip(seq, seq[1:])), seq


def test_zero1_divides_only_optimizer_bytes_by_dp():
    m = planner.model_spec("145.6B")
    plain = planner.memory_per_gpu(m, planner.Layout(8, 8, 12, 2304))
    zero = planner.memory_per_gpu(m, planner.Layout(8, 8, 12, 2304, zero1=True))
    assert zero["optimizer"] == pytest.approx(plain["optimizer"] / 12)
    assert plain["optimizer"] == pytest.approx(12 * plain["params"])
    for k in ("params", "weights", "gradients", "activations"):
        assert zero[k] == plain[k]
    assert plain["weights"] == 2 * plain["params"] and plain["gradients"] == 4 * plain["params"]


def test_params_per_gpu_split_the_model():
    m = planner.model_spec("145.6B")
    whole = planner.params_per_gpu(m, planner.Layout(1, 1, 1, 1))
    assert whole == pytest.approx(planner.params_exact(m))
    # P / (tp pp) plus the embeddings that only the first stage has (over tp).
    first = planner.params_per_gpu(m, planner.Layout(8, 8, 1, 8))
    assert planner.params_eq2(m) / 64 < first < planner.params_eq2(m) / 64 + (51200 + 2048) * m.n_embd / 8


def test_comm_volumes():
    m = planner.model_spec("145.6B")
    sg = planner.comm_bytes_per_gpu(m, planner.Layout(8, 8, 12, 2304))
    no_sg = planner.comm_bytes_per_gpu(m, planner.Layout(8, 8, 12, 2304, scatter_gather=False))
    assert sg["pp"] == pytest.approx(no_sg["pp"] / 8)  # scatter/gather divides pp bytes by tp
    inter = planner.comm_bytes_per_gpu(m, planner.Layout(8, 8, 12, 2304, v=2))
    assert inter["pp"] == pytest.approx(2 * sg["pp"])
    bsh, mb = m.seq_len * m.n_embd, 2304 // 12
    assert no_sg["pp"] == 2 * mb * 2 * bsh  # act + grad per microbatch, bf16
    assert sg["tp"] == pytest.approx(6 * mb * (80 / 8) * 2 * bsh * 2 * 7 / 8)
    norc = planner.comm_bytes_per_gpu(m, planner.Layout(8, 8, 12, 2304, recompute=False))
    assert norc["tp"] == pytest.approx(sg["tp"] * 4 / 6)
    n = planner.params_per_gpu(m, planner.Layout(8, 8, 12, 2304))
    assert sg["dp"] == pytest.approx(2 * 11 / 12 * n * 4)
    zero = planner.comm_bytes_per_gpu(m, planner.Layout(8, 8, 12, 2304, zero1=True))
    assert zero["dp"] == pytest.approx(11 / 12 * n * (4 + 2))  # fp32 grads out, bf16 weights in
    alone = planner.comm_bytes_per_gpu(m, planner.Layout(1, 1, 1, 2304))
    assert alone == dict(tp=0, pp=0, dp=0)


def test_ranking_1t_on_3072():
    c = planner.Cluster()
    ranked = planner.rank_layouts(ONE_T, 3072, 3072)
    assert ranked
    for L, est in ranked:
        assert L.tp <= 8 and L.tp * L.pp * L.dp == 3072
        assert ONE_T.n_layer % L.pp == 0 and 3072 % (L.dp * L.b) == 0
        assert planner.memory_per_gpu(ONE_T, L)["total"] <= c.gpu_mem_gb * 1e9
    rates = [est["tflops"] for _, est in ranked]
    assert rates == sorted(rates, reverse=True)
    best = ranked[0][0]
    assert best.tp == 8 and best.pp >= 32
    layouts = {(L.tp, L.pp, L.dp) for L, _ in ranked}
    assert (8, 64, 6) in layouts  # the paper's own layout runs
    assert (8, 32, 12) not in layouts  # 87 GB without ZeRO-1
    assert any("GB of 80" in why for why in
               planner.layout_problems(ONE_T, planner.Layout(8, 32, 12, 3072), 3072))
    assert any("spans nodes" in why for why in
               planner.layout_problems(ONE_T, planner.Layout(16, 32, 6, 3072), 3072))
    # More memory per GPU, or ZeRO-1, admits more layouts.
    def runnable(**options):  # tp = 8 layouts that fit (memory is the only problem they can have)
        return sum(not planner.layout_problems(ONE_T, planner.Layout(8, pp, 384 // pp, 3072, **options), 3072)
                   for pp in (1, 2, 4, 8, 16, 32, 64, 128))
    assert runnable(zero1=True) > runnable() == sum(L.tp == 8 for L, _ in ranked)


def test_names_and_report():
    assert planner.paper_row("1T").billions == 1008.0 and planner.paper_row("145.6B").n_layer == 80
    with pytest.raises(ValueError):
        planner.paper_row("2T")
    text = planner.plan_report("1T", 3072, tokens=450e9)
    for needle in ("tp=8 pp=64 dp=6", "(eq. 2)", "EFLOP", "12.3%", "days", "GB", "TFLOP/s"):
        assert needle in text
    given = planner.plan_report("1T", 3072, layout=(8, 32, 12))
    assert "CANNOT RUN" in given
    with pytest.raises(ValueError):
        planner.plan_report(GPT3, 1024)  # no Table 1 batch to fall back on
    assert "tp=" in planner.plan_report(GPT3, 1024, batch=1536)


def test_cli_helpers():
    p = argparse.ArgumentParser()
    p.add_argument("--n-layer", type=int, default=2)  # as 05's GPTConfig flags would be
    p.add_argument("--seq-len", type=int, default=32)
    planner.add_plan_args(p)
    assert "tp=8 pp=64 dp=6" in planner.plan_from_args(p.parse_args(["--plan", "1T"]))
    args = p.parse_args("--plan custom --gpus 64 --n-layer 24 --n-embd 2048 --n-head 16 "
                        "--vocab-size 51200 --seq-len 2048 --plan-batch 512 "
                        "--plan-layout 2,2,16 --plan-zero1".split())
    text = planner.plan_from_args(args)
    assert "layout (given): tp=2 pp=2 dp=16" in text and "ZeRO-1" in text


# ----------------------------------------------------------------------------------------------
# The throughput model against Table 1


def table1_estimate(name):
    """The model's estimate for a Table 1 row, from the row's own layout and batch and the one
    default Cluster (b = 1, full recomputation, scatter/gather, no ZeRO, as in the paper)."""
    row, m = planner.PAPER_CONFIGS[name], planner.model_spec(name)
    L = planner.Layout(row.tp, row.pp, row.n_gpus // (row.tp * row.pp), row.batch)
    return planner.estimate_iteration(m, L, row.n_gpus)


PARTS = ("gemm", "memory", "tp", "bubble", "dp", "optimizer")


@pytest.mark.parametrize("name", list(planner.PAPER_CONFIGS))
def test_table1_throughput_within_10_percent_with_no_per_row_constant(name):
    """Every row with the same Cluster(): its constants come from datasheets and published
    measurements, and nothing in the model depends on which row it is. At the time of writing the
    misses run from -6% (7.5B, 18.4B) to +9% (76.1B); the paper's own rows scatter by a few percent
    around any smooth trend (18.4B measures 135, below both neighbours), so 10% is the bar the
    issue set, not a tolerance chosen to pass."""
    est = table1_estimate(name)
    assert est["tflops"] == pytest.approx(planner.PAPER_CONFIGS[name].tflops, rel=0.10)
    assert est["total"] == pytest.approx(sum(est[k] for k in PARTS), rel=1e-12)
    assert min(est[k] for k in PARTS) >= -1e-9 * est["total"]  # no part negative (bubble: rounding)


def test_table1_trend_the_smallest_models_are_the_least_efficient():
    """Section 5.1: throughput per GPU rises with model size ("larger matrix multiplications"). The
    paper's four smallest models measure 135-142 TFLOP/s and its three largest 155-163; the model
    must order them the same way, and put 1.7B at least 10% below 1T (paper: 16% below)."""
    paper = {name: row.tflops for name, row in planner.PAPER_CONFIGS.items()}
    model = {name: table1_estimate(name)["tflops"] for name in planner.PAPER_CONFIGS}
    for rates in (paper, model):
        names = list(rates)
        assert max(rates[n] for n in names[:4]) < min(rates[n] for n in names[-3:]), rates
        assert rates["1.7B"] < 0.9 * rates["1008.0B"], rates


def test_why_small_models_are_slower():
    """The causes the model gives, each measured against 1T's: the memory-bound kernels (mostly
    softmax and dropout over the s^2 attention scores: s/h is 0.9 at 1.7B) take a larger share;
    the projection GEMMs run further below the ceiling (ragged tiles and waves at small h/t); and
    at tp = 8 with h/t = 768 (18.4B) the all-reduces take a larger share than at 1T."""
    small, big, mid = table1_estimate("1.7B"), table1_estimate("1008.0B"), table1_estimate("18.4B")
    share = lambda est, k: est[k] / est["total"]  # noqa: E731
    assert share(small, "memory") > 2 * share(big, "memory")
    assert share(mid, "tp") > 2 * share(big, "tp") and share(small, "tp") == 0  # tp = 1: none

    def linear_tflops(name):  # the four projections of a layer, in TFLOP/s
        row, m = planner.paper_row(name), planner.model_spec(name)
        gemms = planner.layer_gemms(m, planner.Layout(row.tp, row.pp, 1, row.batch))
        shapes = [gemms[k] for k in ("qkv", "proj", "fc1", "fc2")]
        flops = sum(2 * M * N * K * B for M, N, K, B in shapes)
        return flops / sum(planner.gemm_seconds(*x) for x in shapes) / 1e12
    assert linear_tflops("1.7B") < 0.9 * linear_tflops("1T")
    assert linear_tflops("1T") <= planner.Cluster().gemm_tflops


def test_eq4_worked_examples_from_the_models_throughput():
    """Section 5.1's worked examples of eq. 4, with X from the model instead of the paper.
    1T on 3072 GPUs (450B tokens, Table 1's layout): 84 days at the measured 163 TFLOP/s; the model
    is held to 10%. GPT-3 on 1024 GPUs (300B tokens, B = 1536): 34 days at the 140 TFLOP/s the
    paper reports for a layout it does not name. The model's best-ranked layout comes out near
    159 TFLOP/s, 30 days: 12% short, more than 10%, and this test says so rather than bending
    the model; it holds the example to 15%, and to the model being the faster of the two."""
    one_t = table1_estimate("1008.0B")["tflops"]
    assert planner.training_days(450e9, planner.params_eq2(ONE_T), 3072, one_t) == pytest.approx(84, rel=0.10)
    L, est = planner.rank_layouts(GPT3, 1024, 1536)[0]
    days = planner.training_days(300e9, planner.params_eq2(GPT3), 1024, est["tflops"])
    assert days == pytest.approx(34, rel=0.15) and days < 34


# ----------------------------------------------------------------------------------------------
# The pieces of the throughput model


def test_gemm_time_is_a_roofline_with_tile_and_wave_quantization():
    c = planner.Cluster()
    # A 2048 x 6912 output is 8 x 54 = 432 tiles of 256x128, exactly 4 waves on 108 SMs: the ceiling.
    full = planner.gemm_seconds(2048, 6912, 4096)
    assert full == pytest.approx(2 * 2048 * 6912 * 4096 / (c.gemm_tflops * 1e12), rel=1e-12)
    # One more column needs a 55th tile column (or a 28th the other way round): a fifth wave.
    assert planner.gemm_seconds(2048, 6913, 4096) == pytest.approx(full * 5 / 4, rel=1e-12)
    # K = 64 (an attention-sized inner dimension): far below the ridge point, the bytes decide.
    M, N, K = 8192, 8192, 64
    assert planner.gemm_seconds(M, N, K) == pytest.approx(2 * (M * K + K * N + M * N) / (c.hbm_gbs * 1e9))
    # A batch of 108 tiles, one per GEMM, is one wave of math, but each GEMM reads its own operands:
    # the bytes of 108 separate 256 x 4096 and 4096 x 128 inputs decide.
    c_bytes = 2 * 108 * (256 * 4096 + 4096 * 128 + 256 * 128) / (c.hbm_gbs * 1e9)
    assert planner.gemm_seconds(256, 128, 4096, batch=108) == pytest.approx(c_bytes)


def test_memory_bound_bytes_follow_the_kernel_table():
    m = planner.ModelSpec(n_layer=1, n_embd=8, n_head=2, vocab_size=10, seq_len=4)
    tokens_h, scores = 4 * 8, 2 * 4 * 4  # b s h with b = 1; b a s^2
    core, rest, backward = planner.memory_bound_bytes(m, planner.Layout(1, 1, 1, 1))
    assert core == (4 + 5) * scores  # softmax in and out; dropout in, out and its 1-byte mask
    assert rest == 2 * 4 * tokens_h + 2 * 7 * tokens_h + 4 * 4 * tokens_h  # LayerNorms, dropout-adds, GeLU
    assert backward == (6 + 5) * scores + 2 * 6 * tokens_h + 2 * 11 * tokens_h + 6 * 4 * tokens_h \
        + 10 * (12 * 8 * 8 + 13 * 8)  # + the fp32 gradient accumulation, 10 B per parameter
    # tp = 2 splits the heads and GeLU's 4h, not the LayerNorms and dropout-adds; sp splits those too.
    core2, rest2, _ = planner.memory_bound_bytes(m, planner.Layout(2, 1, 1, 1))
    _, rest_sp, _ = planner.memory_bound_bytes(m, planner.Layout(2, 1, 1, 1, sequence_parallel=True))
    assert core2 == core / 2 and rest2 == 22 * tokens_h + 8 * tokens_h and rest_sp == rest / 2


def test_rings_inside_a_node_run_on_nvlink_and_across_nodes_on_each_members_card():
    c = planner.Cluster()
    assert planner.ring_gbs(8, 1) == c.nvlink_gbs  # tp = 8: one node
    assert planner.ring_gbs(4, 2) == c.nvlink_gbs  # dp = 4 beside tp = 2: still one node
    assert planner.ring_gbs(32, 1) == min(c.nvlink_gbs, 8 * c.ib_gbs)  # 1.7B's dp: 8 cards a node
    assert planner.ring_gbs(16, 2) == 4 * c.ib_gbs  # 4 members a node, 4 cards
    assert planner.ring_gbs(6, 8) == c.ib_gbs  # 1T's dp: one member a node, one card
    m, L = ONE_T, planner.Layout(8, 64, 6, 3072)
    hidden = 2 * m.seq_len * m.n_embd
    assert planner.tp_allreduce_seconds(m, L) == pytest.approx(2 * 7 / 8 * hidden / (c.nvlink_gbs * 1e9))
    # Scatter/gather: 1/8 over InfiniBand, then the all-gather of the pieces over NVLink.
    assert planner.p2p_seconds(m, L) == pytest.approx(hidden / 8 / (c.ib_gbs * 1e9)
                                                      + 7 / 8 * hidden / (c.nvlink_gbs * 1e9))
    assert planner.p2p_seconds(m, planner.Layout(8, 1, 384, 3072)) == 0


def test_each_constant_moves_only_its_own_part():
    m, L = planner.model_spec("145.6B"), planner.Layout(8, 8, 24, 2304)  # Table 1's layout
    base = planner.estimate_iteration(m, L, 1536)
    fast_nvlink = planner.estimate_iteration(m, L, 1536, planner.Cluster(nvlink_gbs=400.0))
    assert fast_nvlink["tp"] == pytest.approx(base["tp"] / 2) and fast_nvlink["gemm"] == base["gemm"]
    fast_ib = planner.estimate_iteration(m, L, 1536, planner.Cluster(ib_gbs=50.0))  # dp: one GPU a node
    assert fast_ib["dp"] < base["dp"] and fast_ib["bubble"] < base["bubble"] and fast_ib["tp"] == base["tp"]
    fast_hbm = planner.estimate_iteration(m, L, 1536, planner.Cluster(hbm_gbs=3600.0))
    assert fast_hbm["memory"] == pytest.approx(base["memory"] / 2) and fast_hbm["tp"] == base["tp"]
    assert fast_hbm["gemm"] <= base["gemm"]  # only the memory-bound attention GEMMs gain
    faster = planner.estimate_iteration(m, L, 1536, planner.Cluster(gemm_tflops=2 * 267.9))
    assert faster["gemm"] < base["gemm"] and faster["memory"] == base["memory"]


def test_selective_recomputation_reruns_only_the_attention_core():
    B, s, l, h = 8, ONE_T.seq_len, ONE_T.n_layer, ONE_T.n_embd
    none, sel, full = (planner.flops_per_iteration(ONE_T, B, r) for r in ("none", "selective", "full"))
    assert sel - none == pytest.approx(4 * B * s * s * h * l, rel=1e-12)  # QK^T and scores @ V again
    assert full == planner.flops_per_iteration(ONE_T, B, True)  # a bool still works: True is full
    assert none == planner.flops_per_iteration(ONE_T, B, False)
    # Korthikanti Table 2: selective keeps s b h (10 + 24/t) per layer (34/t with sp), no s^2 terms.
    L = planner.Layout(8, 64, 6, 3072, recompute="selective")
    assert planner.activation_bytes_per_layer(ONE_T, L) == pytest.approx(s * h * (10 + 24 / 8))
    # In time: full recomputation's backward reruns the whole forward and its two all-reduces per
    # layer; selective only the core, with no all-reduce.
    bwd = {r: planner.microbatch_seconds(ONE_T, planner.Layout(8, 64, 6, 3072, recompute=r))[1]
           for r in ("none", "selective", "full")}
    assert bwd["none"]["gemm"] < bwd["selective"]["gemm"] < bwd["full"]["gemm"]
    assert bwd["none"]["tp"] == bwd["selective"]["tp"] < bwd["full"]["tp"]
    with pytest.raises(ValueError, match="recompute='some'"):
        planner.Layout(1, 1, 1, 1, recompute="some").recompute_mode


def test_the_1f1b_replay_shortcut_equals_replaying_every_microbatch():
    """pipeline_seconds replays m1 and m1 + pp microbatches and extends 1F1B's period to m: the
    same step time as 02's simulate() on all m, for random stage counts, microbatch counts and
    times, messages up to 20 times slower than a forward included (float sums: 1e-9)."""
    rng = random.Random(17)
    for _ in range(40):
        pp, t_f, t_b = rng.randint(1, 6), rng.uniform(0.1, 3), rng.uniform(0.1, 6)
        m, t_comm = rng.randint(1, 5 * pp), rng.choice([0.0, rng.uniform(0, 0.3), rng.uniform(0, 20 * t_f)])
        full = pipeline.simulate(pipeline.Schedule([pipeline.one_f_one_b(pp, m, r) for r in range(pp)]), t_f, t_b, t_comm)
        assert planner.pipeline_seconds(pp, m, 1, t_f, t_b, t_comm) == pytest.approx(full.step_time, rel=1e-9)
    # Interleaved 1F1B is replayed whole: the same lists 03 builds, the same step time.
    full = pipeline.simulate(pipeline.Schedule([interleaved.interleaved(4, 24, r, 2) for r in range(4)]), 1.0, 2.5, 0.3)
    assert planner.pipeline_seconds(4, 24, 2, 1.0, 2.5, 0.3) == full.step_time


@pytest.mark.parametrize("pp, m, v", [(8, 64, 1), (4, 16, 2), (6, 4, 1)])
def test_replay_without_messages_has_the_formulas_bubble(pp, m, v):
    step = planner.pipeline_seconds(pp, m, v, 1.0, 2.0, 0.0)
    busy = m * v * 3.0
    if m >= pp:
        assert (step - busy) / busy == pytest.approx(planner.bubble_fraction(pp, m, v), rel=1e-12)
    else:  # fewer microbatches than stages: each still crosses all pp stages each way
        assert step == pytest.approx((m + pp - 1) * 3.0)


# ----------------------------------------------------------------------------------------------
# Bad planner input (issue 15): refused in one place, by flag, value and constraint


CUSTOM = dict(plan="custom", n_layer=24, n_embd=2048, n_head=16, vocab_size=51200, seq_len=2048,
              gpus=64, plan_batch=512)


def argv(**flags):
    """05's command line for a custom model, with flags changed (None: left out)."""
    out = []
    for k, v in {**CUSTOM, **flags}.items():
        out += [] if v is None else ["--" + k.replace("_", "-"), str(v)]
    return out


ONE_T_ARGS = ["--plan", "1T", "--gpus", "3072"]
BAD_PLANS = {  # what, command line, the flag and the value the message must name
    "an unknown model": (["--plan", "2T"], "--plan", "2T"),
    "custom without GPUs": (argv(gpus=None), "--gpus", "None"),
    "zero GPUs": (ONE_T_ARGS[:2] + ["--gpus", "0"], "--gpus", "0"),
    "negative GPUs": (ONE_T_ARGS[:2] + ["--gpus", "-8"], "--gpus", "-8"),
    "zero heads": (argv(n_head=0), "--n-head", "0"),
    "zero width": (argv(n_embd=0), "--n-embd", "0"),
    "zero layers": (argv(n_layer=0), "--n-layer", "0"),
    "zero vocabulary": (argv(vocab_size=0), "--vocab-size", "0"),
    "zero sequence": (argv(seq_len=0), "--seq-len", "0"),
    "heads not dividing the width": (argv(n_embd=100, n_head=3), "--n-embd", "100"),
    "custom without a batch": (argv(plan_batch=None), "--plan-batch", "None"),
    "a negative batch": (ONE_T_ARGS + ["--plan-batch", "-512"], "--plan-batch", "-512"),
    "a zero micro-batch": (ONE_T_ARGS + ["--plan-micro-batch", "0"], "--plan-micro-batch", "0"),
    "a micro-batch not dividing B": (ONE_T_ARGS + ["--plan-micro-batch", "5"], "--plan-micro-batch", "5"),
    "zero virtual stages": (ONE_T_ARGS + ["--plan-v", "0"], "--plan-v", "0"),
    "v not dividing the layers": (ONE_T_ARGS + ["--plan-v", "3"], "--plan-v", "3"),
    "a layout of two sizes": (ONE_T_ARGS + ["--plan-layout", "8,64"], "--plan-layout", "8,64"),
    "a layout with a zero": (ONE_T_ARGS + ["--plan-layout", "8,0,6"], "--plan-layout", "8,0,6"),
    "a layout not of --gpus": (ONE_T_ARGS + ["--plan-layout", "8,64,5"], "--plan-layout", "8,64,5"),
    "tp not dividing the heads": (ONE_T_ARGS + ["--plan-layout", "3,64,16"], "--plan-layout", "3,64,16"),
    "pp not dividing the layers": (ONE_T_ARGS + ["--plan-layout", "8,48,8"], "--plan-layout", "8,48,8"),
    "dp b not dividing B": (ONE_T_ARGS + ["--plan-layout", "8,64,6", "--plan-batch", "3070"],
                            "--plan-layout", "8,64,6"),
    "interleaving with pp not dividing m": (ONE_T_ARGS + ["--plan-layout", "8,64,6", "--plan-v", "2",
                                                          "--plan-batch", "3000"], "--plan-v", "2"),
    "sequence parallelism with tp not dividing s": (argv(seq_len=100, gpus=8, plan_batch=8) + [
        "--plan-layout", "8,1,1", "--plan-sequence-parallel"], "--plan-sequence-parallel", "True"),
    "zero tokens": (ONE_T_ARGS + ["--plan-tokens", "0"], "--plan-tokens", "0"),
    "NaN tokens": (ONE_T_ARGS + ["--plan-tokens", "nan"], "--plan-tokens", "nan"),
    "a negative throughput": (ONE_T_ARGS + ["--plan-tflops", "-5"], "--plan-tflops", "-5"),
    "a throughput above the peak": (ONE_T_ARGS + ["--plan-tflops", "400"], "--plan-tflops", "400"),
    "no GPU memory": (ONE_T_ARGS + ["--plan-gpu-mem", "0"], "--plan-gpu-mem", "0"),
}


@pytest.mark.parametrize("what", list(BAD_PLANS))
def test_bad_planner_input_is_refused_naming_the_flag(what):
    args, flag, value = BAD_PLANS[what]
    parsed = gpt3d.parser().parse_args(args)  # 05's own parser: its model flags and the planner's
    with pytest.raises(ValueError, match=re.escape(flag)) as err:
        planner.plan_from_args(parsed)
    assert value in str(err.value) and ":" in str(err.value), str(err.value)


def test_plan_1t_on_3072_end_to_end_prints_the_model_and_its_constants():
    """`python 05_3d_gpt.py --plan 1T --gpus 3072` as a user runs it (conftest's run_script), and
    a bad value through the same door: exit 1 and the flag on stderr (plumbing.launch.run_main)."""
    proc = run_script("05_3d_gpt.py", "--plan", "1T", "--gpus", "3072", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = planner.Cluster()
    for needle in ("tp=8 pp=64 dp=6", "TFLOP/s per GPU", f"{c.peak_tflops:g} TFLOP/s",
                   f"{c.gemm_tflops:g} TFLOP/s", f"{c.tile[0]}x{c.tile[1]} tile", f"{c.sms} SMs",
                   f"{c.hbm_gbs:g} GB/s", f"{c.nvlink_gbs:g} GB/s", f"{c.ib_gbs:g} GB/s", "simulate()"):
        assert needle in proc.stdout, needle
    bad = run_script("05_3d_gpt.py", "--plan", "1T", "--gpus", "0", timeout=60)
    assert bad.returncode == 1 and "error: --gpus=0" in bad.stderr, bad.stderr[-2000:]
