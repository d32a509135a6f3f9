"""Multi-node launch, rehearsed on one machine: scripts/train_3d.sbatch runs as written.

On a cluster, srun starts one torchrun agent per node, each agent starts its node's ranks, and the
agents meet by torchrun's c10d rendezvous on the head node. Here three stand-ins on the PATH (srun:
the command once per node, each node a session of its own; scontrol: the node list; torchrun: this
interpreter's `-m torch.distributed.run`) let the sbatch file itself run: two nodes of two CPU ranks
on loopback, gloo, 05 at tp=2 x pp=2 x dp=1, so each stage is one node and the pipeline's messages
cross between them. docs/RUNBOOK.md's multi-node command is checked to be the same launch.

- The losses equal the single launcher's (`python 05_3d_gpt.py`, four forked ranks) exactly, with
  no tolerance: the same ranks do the same arithmetic, one thread each, through the same gloo
  collectives; only the way the processes were started differs, so any difference is a bug.
- Killing one node's agent (SIGKILL to its process group, mid-run) is a node failure: that node's
  ranks die with their agent, and the other node's ranks, agent, srun and the job all exit non-zero
  within the collective timeout plus a margin, saying that a peer is gone. Nothing is left running.
"""
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, run_script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the stand-in srun and the leftover check read /proc (Linux)")

SBATCH = ROOT / "scripts" / "train_3d.sbatch"
RUNBOOK = ROOT / "docs" / "RUNBOOK.md"

# A small 05 that still has every part: two stages of one layer, tp=2 inside each, two microbatches,
# an eval every other step.
TRAIN_FLAGS = ["--tp", "2", "--pp", "2", "--dp", "1", "--n-layer", "2", "--n-head", "2", "--n-embd", "16",
               "--block-size", "16", "--seq-len", "16", "--batch-size", "4", "--microbatches", "2",
               "--eval-every", "2", "--eval-batches", "1", "--no-check"]
# The collective timeout of the run whose node is killed: well above the spread of the ranks'
# start-up (each imports torch, which on a loaded 2-core machine takes from seconds to tens of
# seconds), so that only the kill can end the run. The kill itself is seen at once (the dead
# node's connections close): the job ended 3 to 8 s after it in every run here.
KILL_TIMEOUT_S = 30
MARGIN_S = 20  # on top of it: the survivors' exit, their agent's teardown, a loaded 2-core machine

SRUN = '''#!{python}
"""srun on one machine: the command once per node of SLURM_JOB_NODELIST, each node a session of
its own, its output in FAKE_SLURM_DIR/node<i>.log and its agent's pid on line i of
FAKE_SLURM_DIR/agents. Two things a cluster has and one machine has not are given to torchrun:
- Each node its own address (PET_LOCAL_ADDR, torchrun's --local-addr; here 127.0.0.<i+1>): on a
  cluster each agent names itself by its host, and the rendezvous numbers nodes in that order; on
  one machine every agent is "localhost" and the order would be the agents' pids.
- The head node's agent starts first: on a cluster only its address matches the rendezvous
  endpoint, so it hosts the store; on loopback every agent's does, and the first to bind hosts it.
So node 0 hosts the rendezvous and holds ranks 0 and 1, as on a cluster."""
import os, socket, subprocess, sys, time
root, cmd = os.environ["FAKE_SLURM_DIR"], sys.argv[1:]
host, port = cmd[cmd.index("--rdzv-endpoint") + 1].rsplit(":", 1)
procs = []
for node, address in enumerate(os.environ["SLURM_JOB_NODELIST"].split(",")):
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), PET_LOCAL_ADDR=address)
    with open(os.path.join(root, f"node{{node}}.log"), "wb") as log:
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True))
    with open(os.path.join(root, "agents"), "a") as f:
        f.write(f"{{procs[-1].pid}}\\n")
    while node == 0 and procs[0].poll() is None:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
codes = [p.wait() for p in procs]
sys.exit(max(c if c >= 0 else 128 - c for c in codes))  # srun: the worst task's exit code
'''
SCONTROL = '''#!/bin/sh
# scontrol show hostnames LIST: one host a line (LIST here is comma-separated, never compressed)
[ "$1" = show ] && [ "$2" = hostnames ] || {{ echo "stand-in scontrol: only 'show hostnames'" >&2; exit 1; }}
echo "$3" | tr , '\\n'
'''
TORCHRUN = '''#!/bin/sh
exec {python} -m torch.distributed.run "$@"
'''


# ----------------------------------------------------------------------------------------------
# The stand-in cluster.


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_corpus(path):
    path.write_text("".join(f"{x} plus {y} is {x + y}. " for x in range(10) for y in range(10)))
    return path


class Job:
    """`sbatch scripts/train_3d.sbatch FLAGS` on two stand-in nodes, started, not waited for."""

    def __init__(self, tmp_path, flags, nodes=2, ranks_per_node=2):
        self.dir = tmp_path / "slurm"
        bin_dir = self.dir / "bin"
        bin_dir.mkdir(parents=True)
        for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("torchrun", TORCHRUN)):
            (bin_dir / name).write_text(text.format(python=sys.executable))
            (bin_dir / name).chmod(0o755)
        self.id = f"multinode-{os.getpid()}-{time.monotonic_ns()}"  # in every process's environment
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               "FAKE_SLURM_DIR": str(self.dir), "SLURM_JOB_ID": self.id, "SLURM_NNODES": str(nodes),
               "SLURM_JOB_NODELIST": ",".join(f"127.0.0.{i + 1}" for i in range(nodes)),
               "SLURM_GPUS_ON_NODE": str(ranks_per_node), "RDZV_PORT": str(free_port()),
               # One thread per rank, as the single launcher's ranks have: the same arithmetic.
               "OMP_NUM_THREADS": "1"}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        self.log = open(self.dir / "job.log", "wb")
        self.proc = subprocess.Popen(["bash", str(SBATCH), *flags], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def agents(self):
        path = self.dir / "agents"
        return [int(line) for line in path.read_text().split()] if path.exists() else []

    def output(self, name):
        path = self.dir / f"{name}.log"
        return path.read_bytes().decode(errors="replace") if path.exists() else ""

    def outputs(self):
        return "\n".join(f"--- {name}\n{self.output(name)[-3000:]}" for name in ("job", "node0", "node1"))

    def leftover(self, grace_s=5.0):
        """The job's processes still alive grace_s after it ended (ranks die with their agent, which
        takes a moment), found by the job id in their environment, as a cluster's cgroup would."""
        deadline = time.monotonic() + grace_s
        while (alive := processes_with(f"SLURM_JOB_ID={self.id}")) and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive

    def clean_up(self):
        for pid in processes_with(f"SLURM_JOB_ID={self.id}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def processes_with(marker):
    """Live (not zombie) processes whose environment holds marker."""
    found, needle = [], marker.encode() + b"\0"
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or not ours
            continue
        if state != "Z" and (b"\0" + environ).find(b"\0" + needle) >= 0:
            found.append(int(entry))
    return found


def records(path):
    """Each step's --metrics line without its timings: what the two runs must share exactly."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # complete lines only
    timings = ("time_s", "tokens_per_s", "busy_ms", "busy_ms_run")
    return [{k: v for k, v in json.loads(line).items() if k not in timings} for line in lines]


def launcher_flags(text):
    """The torchrun flags (names, and the rendezvous backend) of the first multi-node torchrun
    command in text, up to the script."""
    command = text[re.search(r"torchrun[\s\\]+--nnodes", text).start():].replace("\\\n", " ")
    words = shlex.split(command.split("05_3d_gpt.py")[0], comments=True)
    names = [w for w in words if w.startswith("--")]
    return names, words[words.index("--rdzv-backend") + 1]


# ----------------------------------------------------------------------------------------------
# The tests.


def test_the_runbook_launches_several_nodes_as_the_sbatch_script_does():
    names, backend = launcher_flags(SBATCH.read_text())
    assert names == ["--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"]
    assert backend == "c10d"
    runbook = RUNBOOK.read_text().split("**Several nodes**")[1]
    assert launcher_flags(runbook) == (names, backend)


def test_two_nodes_under_torchrun_train_exactly_as_the_single_launcher(tmp_path):
    data, steps = write_corpus(tmp_path / "sums.txt"), 4
    flags = [*TRAIN_FLAGS, "--steps", str(steps), "--data", str(data), "--timeout-s", "60"]
    job = Job(tmp_path, [*flags, "--metrics", str(tmp_path / "two_nodes.jsonl")])
    try:
        # The reference runs meanwhile (forked from this process: no second torch import).
        single = run_script("05_3d_gpt.py", *flags, "--metrics", tmp_path / "single.jsonl", timeout=80)
        assert single.returncode == 0, single.stderr[-3000:]
        assert single.leftover == []
        try:
            code = job.proc.wait(timeout=80)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the two-node job was still running 80 s after the single launcher ended:\n{job.outputs()}")
        assert code == 0, job.outputs()
        assert job.leftover() == []
    finally:
        job.clean_up()
    expected = records(tmp_path / "single.jsonl")
    assert len(expected) == steps and sum("eval_loss" in r for r in expected) == 2
    assert records(tmp_path / "two_nodes.jsonl") == expected
    # Both nodes ran: world 4 from two agents of two ranks each; rank 0's node printed the run.
    logs = [job.output("node0"), job.output("node1")]
    assert sum("layout    world 4 = tp 2 x pp 2 x dp 1" in log for log in logs) == 1, job.outputs()
    assert sum(f"done: {steps} steps" in log for log in logs) == 1, job.outputs()


def test_a_killed_node_stops_the_job_within_the_timeout_and_leaves_nothing_running(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    flags = [*TRAIN_FLAGS, "--steps", "100000", "--data", str(write_corpus(tmp_path / "sums.txt")),
             "--timeout-s", str(KILL_TIMEOUT_S), "--metrics", str(metrics)]
    job = Job(tmp_path, flags)
    try:
        while len(records(metrics)) < 2:  # mid-run: both nodes have finished steps together
            assert job.proc.poll() is None, job.outputs()
            time.sleep(0.05)
        victim = job.agents()[1]  # node 1: neither the rendezvous host nor rank 0 (see SRUN)
        os.killpg(victim, signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = job.proc.wait(timeout=KILL_TIMEOUT_S + MARGIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job ran on for {KILL_TIMEOUT_S + MARGIN_S} s after node 1's agent was "
                        f"killed\n{job.outputs()}")
        print(f"the job ended {time.monotonic() - killed:.1f} s after node 1's agent was killed")
        assert code != 0, job.outputs()
        survivor = job.output("node0")
        assert "a collective failed because a peer rank is gone" in survivor, job.outputs()
        assert job.leftover() == [], job.outputs()
    finally:
        job.clean_up()


# ----------------------------------------------------------------------------------------------
# Ranks that disagree (issue 36): two torchrun agents on loopback, one rank each, each node given
# its own command line, as two nodes of a cluster would be when their commands differ. Every rank
# compares what it was given before the first training collective (plumbing/agreement.py), and a
# difference is refused on both nodes in one sentence naming the flag, the values and the ranks
# that hold each; nothing is trained and nothing written. A command that differs only in spelling
# (a relative path, 3e-3 for 0.003, a default given explicitly) trains.

AGREE_FLAGS = ["--tp", "1", "--pp", "2", "--dp", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
               "--seq-len", "16", "--batch-size", "4", "--microbatches", "2", "--eval-every", "0", "--timeout-s", "30",
               "--no-check"]
AGREE_TIMEOUT_S = 90  # two agents and two ranks, each importing torch afresh, on a loaded 2-core machine


class Agents:
    """Two torchrun agents on loopback with a static rendezvous (node 0 hosts it): node i runs 05
    with flags[i], ranks numbered by node. Started at once, in tmp_path, not waited for."""

    def __init__(self, tmp_path, flags):
        self.id, port = f"agents-{os.getpid()}-{time.monotonic_ns()}", free_port()
        env = {**os.environ, "AGENTS_ID": self.id, "OMP_NUM_THREADS": "1"}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        self.logs = [tmp_path / f"agent{i}.log" for i in range(2)]
        self.procs = []
        for node, own in enumerate(flags):
            with open(self.logs[node], "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                     "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                     str(ROOT / "05_3d_gpt.py"), *map(str, own)],
                    cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        self.t0 = time.monotonic()

    def wait(self):
        """(exit codes, seconds, each node's output, processes left behind)."""
        try:
            codes = [p.wait(timeout=AGREE_TIMEOUT_S) for p in self.procs]
        finally:
            seconds = time.monotonic() - self.t0
            deadline = time.monotonic() + 5
            while (left := processes_with(f"AGENTS_ID={self.id}")) and time.monotonic() < deadline:
                time.sleep(0.1)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            for p in self.procs:
                p.kill() if p.poll() is None else None
        return codes, seconds, [log.read_text(errors="replace") for log in self.logs], left


def ours(output):
    """A node's output up to torchrun's own report of a failed worker (the agent's traceback)."""
    return output.split("torch/distributed/elastic/multiprocessing/api.py")[0]


def _tree(root):
    """Every file under root with its bytes' hash, and every directory."""
    import hashlib
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.join(folder, name)] = "directory"
        for name in files:
            out[os.path.join(folder, name)] = hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
    return out


# the flag: (node 0's flags, node 1's flags, what the sentence says, * where it varies: a hash); {tmp}:
# the test's directory
DISAGREEMENTS = {
    "--n-layer": (["--n-layer", "2"], ["--n-layer", "4"], "--n-layer (rank 0: 2; rank 1: 4)"),
    "--seed": (["--seed", "1"], ["--seed", "2"], "--seed (rank 0: 1; rank 1: 2)"),
    "--save": (["--save", "{tmp}/a"], ["--save", "{tmp}/b"], "--save (rank 0: {tmp}/a; rank 1: {tmp}/b)"),
    "--data": (["--data", "{tmp}/sums.txt"], [], "--data (rank 0: {tmp}/sums.txt (1,545 bytes, head and tail *; rank 1: "
                                                 "the built-in corpus (1,143,984 bytes"),
    "--resume": (["--resume", "{tmp}/ckpt/step_00000001"], ["--resume", "{tmp}/ckpt/step_00000002"],
                 "--resume (rank 0: {tmp}/ckpt/step_00000001 (step 1); rank 1: {tmp}/ckpt/step_00000002 (step 2))"),
}


@pytest.mark.grid(keep=['--resume'])
@pytest.mark.parametrize("name", list(DISAGREEMENTS))
def test_two_nodes_given_different_flags_are_refused_together_in_one_sentence(tmp_path, name):
    tmp = os.path.realpath(tmp_path)
    write_corpus(tmp_path / "sums.txt")
    if name == "--resume":  # a checkpoint of steps 1 and 2, by the single launcher
        made = run_script("05_3d_gpt.py", *AGREE_FLAGS, "--n-layer", "2", "--steps", "2", "--save", tmp_path / "ckpt",
                          "--save-every", "1", timeout=80)
        assert made.returncode == 0, made.stderr[-2000:]
    node0, node1, said = (x if isinstance(x, str) else [a.replace("{tmp}", tmp) for a in x]
                          for x in DISAGREEMENTS[name])
    said = said.replace("{tmp}", tmp)
    common = [*AGREE_FLAGS, "--steps", "3"] + ([] if name == "--n-layer" else ["--n-layer", "2"])
    common += [] if name == "--save" else ["--save", f"{tmp}/saves"]
    before = _tree(tmp)
    codes, seconds, outputs, left = Agents(tmp_path, [common + node0, common + node1]).wait()
    print(f"{name}: both nodes ended {seconds:.1f} s after they started")
    assert codes[0] != 0 and codes[1] != 0, outputs
    for output in outputs:  # the same sentence on both nodes, first, and no traceback of ours
        lines = [x for x in ours(output).splitlines() if x.startswith("error:")]
        assert lines and all(part in lines[0] for part in said.split("*")), output[-3000:]
        assert "nothing was trained or written" in lines[0], output[-3000:]
        assert "Traceback" not in ours(output), output[-3000:]
    assert left == []
    after = {p: v for p, v in _tree(tmp).items() if not p.endswith(".log")}
    assert {p: v for p, v in after.items() if p in before} == {p: v for p, v in before.items() if not p.endswith(".log")}
    assert [p for p, v in after.items() if p not in before and v != "directory"] == []  # nothing written


def test_two_nodes_whose_commands_differ_only_in_spelling_train_together(tmp_path):
    tmp = os.path.realpath(tmp_path)
    write_corpus(tmp_path / "sums.txt")
    common = [*AGREE_FLAGS, "--n-layer", "2", "--steps", "2"]
    node0 = common + ["--data", "sums.txt", "--lr", "0.003", "--save", "ckpt"]  # relative to the same directory
    node1 = common + ["--data", f"{tmp}/./sums.txt", "--lr", "3e-3", "--save", f"{tmp}/ckpt/", "--hang-s", "15",
                      "--dtype", "float32", "--no-cuda-graphs"]  # half of --timeout-s 30, the CPU's dtype, off on CPU
    codes, seconds, outputs, left = Agents(tmp_path, [node0, node1]).wait()
    assert codes == [0, 0], outputs
    assert sum("done: 2 steps" in output for output in outputs) == 1, outputs
    assert sorted(os.listdir(tmp_path / "ckpt" / "step_00000002")) == ["manifest.json", "rank_00000.pt",
                                                                      "rank_00001.pt"]
    assert left == []
