"""scripts/gpu_check.py, the one-command GPU check, on a CPU: its dry run prints every command and
what it must print, docs/GPU_CHECKLIST.md holds that plan, every trainer and benchmark command of
it is accepted by the script it runs, each judge reads a log the way the GPU will write it, and the
runner prints a row per item as it ends, stops at its budget and exits non-zero on any FAIL or SKIP.

No GPU here: the judges get logs in the formats their scripts print (05's progress notes, pytest's
summary, bench_kernels.py's rows), and the runner runs small stand-in commands. The CPU smoke of
the trainer items themselves (05 on CPU ranks) takes minutes and is not run here; the poisoned
trainer, at a tiny size, is.
"""
import importlib
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from conftest import ROOT, load
from plumbing import checks, cli, sample

sys.path.insert(0, str(ROOT / "scripts"))
gpu_check = importlib.import_module("gpu_check")
gpt3d = load("05_3d_gpt")
DOC = ROOT / "docs" / "GPU_CHECKLIST.md"


def script(*args, timeout=60):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def doc_plan():
    """The plan as docs/GPU_CHECKLIST.md holds it (the dry run with --out /tmp/gc)."""
    return gpu_check.Plan("/tmp/gc", "/SCRATCH", "/SCRATCH/torch_extensions")


# ----------------------------------------------------------------------------------------------
# The dry run, --help, and the checklist


def test_the_dry_run_prints_each_command_and_what_it_must_print_and_runs_nothing(tmp_path):
    out = tmp_path / "gc"
    proc = script("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert text.startswith("environment (this machine: a dry run)\n")
    for key in ("torch", "CUDA (torch)", "TORCH_CUDA_ARCH_LIST", "nvcc", "GPU"):
        assert re.search(rf"^{re.escape(key)} +\S", text, re.M), key
    plan = gpu_check.Plan(out, "/SCRATCH", "/SCRATCH/torch_extensions")
    for item in plan.items:
        assert f"[{item.key}] {item.title}: estimate {item.estimate_s} s" in text
        for stage in item.stages:
            for command in stage:
                assert gpu_check.shown(command.argv, command.env).replace("/SCRATCH", "$SCRATCH") in text
    assert text.count("    must hold: ") == len(plan.items)
    total = int(re.search(r"Estimate in all: (\d+) s", text)[1])
    assert total <= gpu_check.BUDGET_S <= 8 * 60
    assert not out.exists()  # nothing written, nothing run


def refused(*args):
    """main()'s refusal of these arguments: the message it exits with."""
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(list(args))
    return str(stop.value.code)


def test_the_dry_run_of_some_items_keeps_the_build_first(capsys):
    assert gpu_check.main(["--dry-run", "--out", "/tmp/gc", "--only", "resume"])
    assert re.findall(r"^  \[([\w-]+)\]", capsys.readouterr().out, re.M) == ["build", "resume"]
    assert refused("--dry-run", "--out", "/tmp/gc", "--only", "resum").startswith(
        "error: --only resum: no such item; the items are build, resume,")


def test_help_names_every_option_and_the_one_command():
    text = script("--help").stdout
    assert "python3 scripts/gpu_check.py --out DIR" in text
    for option in ("--out DIR", "--dry-run", "--only ITEM", "--budget-s", "--extensions-dir", "--archive FILE"):
        assert option in text, option
    assert "--poison-steps" not in text  # the nonfinite item's trainer, not an option for a reader


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_the_check_says_so_and_fails(tmp_path):
    assert refused("--out", str(tmp_path / "gc")) == \
        "error: no CUDA device: this check needs one GPU (--dry-run prints the plan without one)"


def test_an_output_directory_holding_files_is_refused(tmp_path):
    (tmp_path / "old.log").write_text("x")
    assert refused("--out", str(tmp_path)) == f"error: --out {tmp_path} holds files already; give an empty or new directory"


def test_the_checklist_holds_the_dry_runs_plan_as_it_prints_it_today():
    plan = doc_plan()
    assert gpu_check.dry_run_text(plan, plan.items) in DOC.read_text(), \
        "docs/GPU_CHECKLIST.md: paste the plan of `python3 scripts/gpu_check.py --dry-run --out /tmp/gc`"


# ----------------------------------------------------------------------------------------------
# Every command of the plan is one its script accepts


def trainer_flags(argv):
    """The flags a plan's command gives 05 (directly, or through the poisoned trainer), or None."""
    if "05_3d_gpt.py" in argv:
        return argv[argv.index("05_3d_gpt.py") + 1:]
    if "--poison-steps" in argv:
        return argv[argv.index("--") + 1:]
    return None


def test_every_trainer_command_of_the_plan_passes_05s_own_checks():
    commands = [c for item in doc_plan().items for stage in item.stages for c in stage]
    checked = 0
    for command in commands:
        flags = trainer_flags(command.argv)
        if flags is None:
            continue
        p = gpt3d.parser()
        args = p.parse_args(flags)
        tc, cfg, sc = (cli.from_args(c, args) for c in (gpt3d.TrainConfig, gpt3d.tensor_parallel.GPTConfig,
                                                       sample.SampleConfig))
        checks.check_fields(tc, cfg, sc)
        assert checks.check_action(args, cli.given(p, flags)) is None, command.name  # it trains
        checked += 1
    assert checked == 10


def test_every_benchmark_command_of_the_plan_is_accepted_by_bench_kernels(monkeypatch, capsys):
    """argparse checks each value it reads, up to --help, which then exits 0: the plan's flags,
    every one read, with --help after them."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench_kernels")
    commands = [c for item in doc_plan().items for stage in item.stages for c in stage
                if "benchmarks/bench_kernels.py" in c.argv]
    assert len(commands) == 3
    for command in commands:
        monkeypatch.setattr(sys, "argv", [*command.argv[1:], "--help"])
        with pytest.raises(SystemExit) as stop:
            bench.main()
        assert stop.value.code == 0, (command.name, capsys.readouterr().err[-2000:])


def test_the_poisoned_trainer_skips_the_steps_it_poisons(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = script("--poison-steps", "1", "--", "--tp", "1", "--pp", "1", "--dp", "1", "--n-layer", "1", "--n-head",
                  "2", "--n-embd", "16", "--block-size", "16", "--seq-len", "16", "--batch-size", "4",
                  "--microbatches", "1", "--steps", "3", "--eval-every", "0", "--metrics", str(metrics), timeout=80)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"step 1 skipped: loss \S+, gradient norm inf \(1 in a row\)", proc.stdout + proc.stderr)
    assert [json.loads(x).get("skipped", False) for x in metrics.read_text().splitlines()] == [False, True, False]


# ----------------------------------------------------------------------------------------------
# The judges, on logs as the GPU will write them


def log(text, returncode=0):
    return gpu_check.Log(returncode, text, 1.0)


def statuses(rows):
    return [(r.name, r.status) for r in rows]


def test_the_build_judge_reads_the_slowest_process_and_fails_on_a_missing_family():
    plan = doc_plan()
    built = "built and probed: bias_gelu bias_dropout_add softmax layernorm in {} s\n"
    logs = {f"build_{r}": log(("kernels: waiting for another process's build of softmax.cu (it holds x.lock); then "
                               "loading it\n" if r else "") + built.format(60 + r)) for r in range(8)}
    rows = gpu_check.judge_build(logs, plan)
    assert statuses(rows) == [("cold build", "PASS")]
    assert rows[0].measured == "67.0 s, the slowest of 8 processes (the fastest 60.0 s); 7 waits for another's build"
    rows = gpu_check.judge_build({**logs, "build_3": log(built.format(61).replace("softmax ", ""))}, plan)
    assert statuses(rows) == [("cold build", "FAIL")] and rows[0].measured.startswith("process 3: built bias_gelu")
    rows = gpu_check.judge_build({**logs, "build_0": log("RuntimeError: Error building extension 'x'\n", 1)}, plan)
    assert rows[0].measured == "process 0: exit 1: RuntimeError: Error building extension 'x'"


def write_metrics(path, records):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_resume_judge_wants_every_resumed_step_equal_bit_for_bit(tmp_path):
    plan = gpu_check.Plan(tmp_path, tmp_path, tmp_path)
    first = [dict(step=s, loss=5.0 - s / 7, grad_norm=1.0 + s / 3) for s in range(8)]
    write_metrics(plan.metrics("resume_a"), first)
    logs = {"resume_a": log("saved step 4 to x: 1 MB\nsaved step 8 to x: 1 MB\nmemory    rank 0, measured peak "
                            "(torch.cuda.max_memory_allocated): 1,234.50 MiB, estimated 1,100.00 MiB (weights, ...)\n"),
            "resume_b": log("resumed from /s/resume/step_00000004: 4 steps done\n"),
            "resume_cpu": log("resharded /s/resume/step_00000004 from cuda to cpu; dropout streams, default and "
                              "tracked, reseeded from the step\nresumed from /s/resume/step_00000004: 4 steps done\n")}
    write_metrics(plan.metrics("resume_b"), first[4:])
    rows = gpu_check.judge_resume(logs, plan)
    assert statuses(rows) == [("save on the GPU", "PASS"), ("resume bit for bit", "PASS"),
                              ("the GPU's checkpoint resumes on the CPU", "PASS"),
                              ("the end report's measured peak memory", "PASS")]
    assert rows[3].measured == "measured 1,234.50 MiB, estimated 1,100.00 MiB"
    write_metrics(plan.metrics("resume_b"), first[4:6] + [dict(first[6], loss=first[6]["loss"] + 1e-7)] + first[7:])
    rows = gpu_check.judge_resume(logs, plan)
    assert statuses(rows)[1] == ("resume bit for bit", "FAIL") and rows[1].measured.startswith("step 6: loss")
    crashed = {"resume_a": log("RuntimeError: Expected all tensors to be on the same device, but found at least two "
                               "devices, cuda:0 and cpu!\n", 1)}
    rows = gpu_check.judge_resume(crashed, plan)
    assert statuses(rows) == [("save on the GPU", "FAIL")] and "Expected all tensors" in rows[0].measured


def test_the_capture_judge_says_whether_the_graph_captured_or_fell_back(tmp_path):
    plan = gpu_check.Plan(tmp_path, tmp_path, tmp_path)
    eager = [dict(step=s, loss=5.0 - s / 10, grad_norm=1.0) for s in range(6)]
    for name in ("capture_eager", "capture_step", "capture_stage"):
        write_metrics(plan.metrics(name), eager)
    logs = {"capture_eager": log("device    ...; CUDA graphs: off\n"),
            "capture_step": log("device    ...; CUDA graphs: whole step\nCUDA graphs: capturing the whole step failed "
                                "on rank 0 (unique_by_key: failed to synchronize: cudaErrorStreamCaptureUnsupported: "
                                "operation not permitted when stream is capturing); this rank trains without graphs "
                                "from this step on, as with --no-cuda-graphs\n"),
            "capture_stage": log("device    ...; CUDA graphs: per stage and microbatch\n")}
    rows = gpu_check.judge_capture(logs, plan)
    assert statuses(rows) == [("capture, whole step", "PASS"), ("capture, per stage and microbatch", "PASS")]
    assert rows[0].measured.startswith("fell back: unique_by_key: failed to synchronize")
    assert rows[1].measured.startswith("captured and replayed")
    write_metrics(plan.metrics("capture_stage"), [dict(r, loss=r["loss"] * 1.1) for r in eager])
    assert statuses(gpu_check.judge_capture(logs, plan))[1][1] == "FAIL"


def test_the_kernel_tests_judge_fails_when_gpu_tests_were_skipped():
    plan = doc_plan()
    passed = "........\n312 passed, 4 skipped in 88.02s (0:01:28)\n"
    assert statuses(gpu_check.judge_kernel_tests({"kernel_tests": log(passed)}, plan)) == [
        ("kernel and graph tests", "PASS")]
    no_gpu = "SKIPPED [126] tests/test_kernel_layernorm.py:248: needs a CUDA GPU\n200 passed, 126 skipped in 9.1s\n"
    rows = gpu_check.judge_kernel_tests({"kernel_tests": log(no_gpu)}, plan)
    assert statuses(rows) == [("kernel and graph tests", "FAIL")] and rows[0].measured.startswith("1 skipped for want")
    failed = "FAILED tests/test_kernels.py::test_x - RuntimeError\n1 failed, 311 passed in 80.0s\n"
    assert gpu_check.judge_kernel_tests({"kernel_tests": log(failed, 1)}, plan)[0].measured == "1 failed, 311 passed"


def bench_row(name, shape, dtype, direction, speed, share):
    """A row as benchmarks/bench_kernels.py prints it (its kernels_section's format)."""
    return (f"{name:17s} {str(shape):18s} {dtype:5s} {direction:3s} {10.0:9.1f} {10.0 * speed:9.1f} {speed:7.2f}x "
            f"{3000:7.0f} {share:7.0%} {'yes':>4s} {'yes':>4s} {1e-6:8.1e}")


def test_the_kernel_benchmark_judge_holds_every_family_to_both_goals():
    plan = doc_plan()
    lines = ["copy bandwidth: dst.copy_(src) of 1 GiB, counted 2 x 1 GiB: 4,012 GB/s"]
    for dtype in ("f32", "bf16"):
        for name, shape in (("bias_gelu", (8192, 4096)), ("bias_dropout_add", (8192, 1024)),
                            ("softmax", (8, 16, 1024, 1024)), ("layernorm", (8192, 1024))):
            for direction in ("fwd", "bwd"):
                slow = dtype == "f32" and name == "layernorm" and direction == "bwd"
                lines.append(bench_row(name, shape, dtype, direction, 1.2 if slow else 2.0, 0.55 if slow else 0.8))
    rows = gpu_check.judge_bench_kernels({"bench_kernels": log("\n".join(lines) + "\n")}, plan)
    assert statuses(rows) == [("kernels vs unfused, bf16", "PASS"), ("kernels vs unfused, fp32", "FAIL")]
    assert rows[1].measured == ("copy 4,012 GB/s; 7 of 8 meet both; slowest 1.20x (layernorm bwd), least 55% of "
                                "copy (layernorm bwd)")


def test_the_graph_and_mfu_judges_read_the_benchmarks_rows():
    plan = doc_plan()
    graphs = "pytorch       5.12      2.01    2.55x  1.2e-03\nfused         4.00      3.50    1.14x  2.0e-03\n"
    assert statuses(gpu_check.judge_graphs_speed({"bench_graphs": log(graphs)}, plan)) == [
        ("graphs vs eager, pytorch ops", "PASS"), ("graphs vs eager, fused ops", "FAIL")]
    mfu = ("  350M fused+graphs, 354,871,296 parameters, B=8 T=1024: 12 steps after the first 3, median 61.0 ms (min "
           "60.1, max 63.0); 134,295 tokens/s; MFU 48.1%; run took 41 s\n"
           "  350M unfused, 354,871,296 parameters, B=8 T=1024: 12 steps after the first 3, median 80.0 ms (min "
           "79.1, max 82.0); 102,400 tokens/s; MFU 36.7%; run took 45 s\n")
    rows = gpu_check.judge_mfu({"bench_mfu": log(mfu)}, plan)
    assert statuses(rows) == [("350M, kernels and graphs on", "PASS"), ("350M, kernels and graphs off", "PASS")]
    assert rows[0].measured == "134,295 tokens/s, 61.0 ms a step, MFU 48.1% (354,871,296 parameters)"
    below = mfu.replace("MFU 48.1%", "MFU 40.0%")
    assert statuses(gpu_check.judge_mfu({"bench_mfu": log(below)}, plan))[0][1] == "FAIL"
    fell = ("  CUDA graphs: capturing the whole step failed on rank 0 (operation not permitted when stream is "
            "capturing); this rank trains without graphs from this step on, as with --no-cuda-graphs\n")
    rows = gpu_check.judge_mfu({"bench_mfu": log(fell + mfu)}, plan)
    assert rows[0].measured.endswith("; the graph's capture fell back to eager: operation not permitted when stream "
                                     "is capturing") and rows[0].status == "PASS"


# ----------------------------------------------------------------------------------------------
# The runner, with stand-in commands


def stand_in(plan, key, group, code, estimate=1, judge=None):
    command = gpu_check.Command(key, [sys.executable, "-c", code])
    judge = judge or (lambda logs, plan: [gpu_check.Row(key, "", "ok" if logs[key].returncode == 0 else
                                                        gpu_check.tail(logs[key]), "PASS" if logs[key].returncode == 0
                                                        else "FAIL")])
    return gpu_check.Item(key, key, estimate, group, [[command]], "it exits 0", judge)


def test_the_runner_prints_rows_as_items_end_stops_at_its_budget_and_keeps_every_log(tmp_path, capsys):
    plan = gpu_check.Plan(tmp_path / "out", tmp_path, tmp_path / "ext")
    plan.out.mkdir()
    plan.items = [stand_in(plan, "fast", 0, "print('done')"),
                  stand_in(plan, "broken", 1, "raise SystemExit('it broke')"),
                  stand_in(plan, "slow", 1, "import time; time.sleep(60)"),
                  stand_in(plan, "late", 2, "print('never')", estimate=60)]
    archive = tmp_path / "logs.tar.gz"
    runner = gpu_check.Runner(plan, budget_s=4, archive=archive)
    runner.run(plan.items)
    rows = {key: [r.status for r in rs] for key, (_, rs, _) in runner.rows.items()}
    assert rows == {"fast": ["PASS"], "broken": ["FAIL"], "slow": ["FAIL"], "late": ["SKIP"]}
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in printed] == ["| fast", "| broken", "| slow", "| late"]  # as they ended
    assert "exit 1: it broke" in printed[1] and "stopped at its time limit" in printed[2]
    assert "not started: 0 s of the budget left, estimate 60 s" in printed[3]
    assert "[gpu_check: stopped at its time limit" in (plan.out / "slow.log").read_text()
    assert (plan.out / "table.md").read_text() == gpu_check.table(plan.items, runner.rows)
    with tarfile.open(archive) as tar:
        assert {"out/fast.log", "out/broken.log", "out/slow.log", "out/table.md"} <= set(tar.getnames())


# ----------------------------------------------------------------------------------------------
# Found by running the plan's trainer commands on CPU ranks: 05 at T = 1024 (the capture item, the
# MFU item's 350M model) trained, then crashed in the end report's sum probe, whose rows were
# shorter than T (a filler of 8 sentences, ~570 bytes) and so of unequal lengths.


@pytest.mark.parametrize("seq_len", [16, 64, 583, 1024, 2048])
def test_the_sum_probe_fills_every_row_to_the_sequence_length(seq_len):
    from plumbing.data import sum_probe

    batches = sum_probe(seq_len, 8)
    assert sum(1 for _, _, pairs in batches for p in pairs if p is not None) == 100
    for idx, targets, _ in batches:
        assert idx.shape == targets.shape == (8, seq_len)


def test_a_whole_run_prints_the_environment_the_rows_and_a_summary_and_exits_by_the_rows(tmp_path, monkeypatch,
                                                                                      capsys):
    """main() as on a GPU (torch.cuda answering as one would), with stand-in items: the table and
    the summary last, table.md, env.txt and the archive written; False (exit 1) when a row failed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(gpu_check, "environment", lambda cuda: [("GPU", "NVIDIA H200"), ("torch", "2.11.0")])
    monkeypatch.setattr(gpu_check.tempfile, "mkdtemp", lambda prefix: str(tmp_path))  # the scratch directory
    for outcome, code in (("PASS", "print('fine')"), ("FAIL", "raise SystemExit(3)")):
        monkeypatch.setattr(gpu_check, "items", lambda plan, code=code: [stand_in(plan, "build", 0, "print('built')"),
                                                                         stand_in(plan, "other", 1, code)])
        out = tmp_path / outcome
        assert gpu_check.main(["--out", str(out), "--archive", str(tmp_path / f"{outcome}.tar.gz")]) == (outcome == "PASS")
        printed = capsys.readouterr().out
        assert printed.startswith("environment\nGPU    NVIDIA H200\ntorch  2.11.0\n")
        assert printed.rstrip().splitlines()[-1].startswith(
            f"{1 + (outcome == 'PASS')} PASS, {int(outcome == 'FAIL')} FAIL, 0 SKIP in ")
        assert (out / "env.txt").read_text() == "GPU    NVIDIA H200\ntorch  2.11.0\n"
        assert (out / "table.md").read_text().count("\n| ") == 2 and (tmp_path / f"{outcome}.tar.gz").exists()
