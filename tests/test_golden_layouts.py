"""Golden directories across layouts (issue 42, point 4): `python3 -m megatron_scratch.golden --layout
tp2pp2dp2 --config small --steps 3 --out DIR` and its checker, `... golden check DIR --grads FILE`.

What is checked, and the tolerances:
  - The layout's run is 05's machine at tp2pp2dp2; its losses against the serial model trained by
    torch's AdamW: golden.LAYOUT_RTOL = 1e-12 relative (float64 sums in another order, ~1e-15; a
    wrong weighting is off by 1e-2). Its step-0 gradients against serial: testing's float64 defaults
    (rtol 1e-10, atol 1e-12), the floor for the key bias's gradient, 0 in math.
  - A second run: every file's bytes equal (float64, every sum's order fixed, gloo's too).
  - The checker: serial gradients pass, one element off by one part in 1e8 fails naming its tensor
    (the default rtol is 1e-10), a missing gradient and a wrong loss fail, on the function and the CLI.
  - The safetensors files are read by a second reader written here from the format's description
    (8-byte little-endian length, JSON header, raw bytes), so the writer is not only checked by itself.
  - Bad flags: refused before anything runs, each naming the flag, the value and the rule.
Cost: the generator runs in this process (no fresh interpreter: it would import torch again), each run
about 2.5 s on 2 cores for 8 forked ranks; three runs (the fixture, the rerun, README's example).
"""
import json
import re
import shlex
import struct

import pytest
import torch

from conftest import ROOT
from megatron_scratch import golden, reference
from megatron_scratch.testing import compare_state

COMMAND = "python3 -m megatron_scratch.golden --layout tp2pp2dp2 --config small --steps 3 --out {out}"


def _main(command, capsys=None):
    """The command line `python3 -m megatron_scratch.golden ...`, run in this process: its exit code."""
    words = shlex.split(command)
    assert words[:3] == ["python3", "-m", "megatron_scratch.golden"], command
    try:
        return golden.main(words[3:]) or 0
    except SystemExit as e:
        return e.code


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("golden") / "tp2pp2dp2"
    assert _main(COMMAND.format(out=out)) == 0
    return out


def _by_hand(path):
    """A second safetensors reader, from the format's description: {name: (dtype, shape, bytes)}."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n].decode().rstrip(" "))
    header.pop("__metadata__", None)
    ends = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and ends[-1][1] == len(data) - 8 - n
    return {k: (v["dtype"], v["shape"], data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items()}


def test_the_layouts_run_equals_serial_and_every_file_holds_what_it_says(made):
    assert sorted(p.name for p in made.iterdir()) == sorted(golden.FILES)
    got = golden.read_dir(made)
    cfg = reference.gpt_config(**golden.CONFIGS["small"])
    full = reference.init_weights(cfg, seed=golden.SEED)
    assert got["config"]["model"] == golden.CONFIGS["small"] and (got["config"]["tp"], got["config"]["pp"],
                                                                  got["config"]["dp"]) == (2, 2, 2)
    assert set(got["weights"]) == set(full) and all(torch.equal(got["weights"][k], full[k]) for k in full)
    batches = golden.layout_batches(cfg, 3)
    assert len(got["batches"]) == 3 and all(torch.equal(a, c) and torch.equal(b, d)
                                            for (a, b), (c, d) in zip(got["batches"], batches))
    assert all(int((t == golden.IGNORE_INDEX).sum()) > 0 for _, t in batches)
    # independent of the generator's own check: serial training here, on the files' weights and batches
    losses, grads = golden.serial_training(cfg, got["weights"], got["batches"])
    assert len(got["losses"]) == 3 and len(set(got["losses"])) == 3
    assert all(abs(a - b) <= golden.LAYOUT_RTOL * abs(b) for a, b in zip(got["losses"], losses)), (got["losses"], losses)
    compare_state(got["grads"], grads)
    assert all(g.dtype == torch.float64 and g.shape == full[n].shape for n, g in got["grads"].items())
    # the bytes, read by a second reader
    for name, want in (("weights", full), ("grads", got["grads"])):
        raw = _by_hand(made / f"{name}.safetensors")
        assert set(raw) == set(want)
        for k, (dtype, shape, blob) in raw.items():
            assert dtype == "F64" and shape == list(want[k].shape)
            assert struct.unpack(f"<{len(blob) // 8}d", blob) == tuple(want[k].reshape(-1).tolist()), k
    raw = _by_hand(made / "batches.safetensors")
    assert raw["step2.targets"][0] == "I64" and struct.unpack("<3q", raw["step2.targets"][2][:24]) == (-100,) * 3
    manifest = json.loads((made / "manifest.json").read_text())
    assert manifest["command"] == COMMAND.format(out=made)
    assert manifest["versions"]["torch"] == torch.__version__ and set(manifest["sha256"]) == set(golden.FILES[:-1])


def test_a_second_run_reproduces_the_files_bit_for_bit_and_replacing_them_is_deliberate(made, capsys):
    before = {p.name: p.read_bytes() for p in made.iterdir()}
    assert _main(COMMAND.format(out=made)) == 2  # not without --overwrite
    assert "exists: regenerating golden values is deliberate, add --overwrite" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in made.iterdir()} == before
    assert _main(COMMAND.format(out=made) + " --overwrite") == 0
    after = {p.name: p.read_bytes() for p in made.iterdir()}
    assert after.keys() == before.keys()
    assert [n for n in before if after[n] != before[n]] == ["manifest.json"]  # only its command differs:
    assert json.loads(after["manifest.json"])["command"] == COMMAND.format(out=made) + " --overwrite"
    again = json.loads(after["manifest.json"])
    again["command"] = COMMAND.format(out=made)
    assert again == json.loads(before["manifest.json"])


def test_a_wrong_gradient_or_loss_fails_the_check_and_serials_pass(made, tmp_path, capsys):
    got = golden.read_dir(made)
    cfg = reference.gpt_config(**got["config"]["model"])
    tokens, targets = got["batches"][0]
    mine = reference.serial_loss_and_grads(cfg, got["weights"], tokens, targets)
    assert golden.check(made, grads=mine.grads, losses=[mine.loss.item()]) == []
    wrong = dict(mine.grads)
    name = "transformer.h.3.attn.c_attn.weight"
    wrong[name] = wrong[name].clone()
    at = divmod(int(wrong[name].abs().argmax()), wrong[name].shape[1])  # its largest element, ~1e-2
    wrong[name][at] *= 1 + 1e-8  # one element, one part in 1e8
    problems = golden.check(made, grads=wrong)
    assert len(problems) == 1 and f"FAIL {name}: 1 of" in problems[0] and str(list(at)) in problems[0], problems
    del wrong["transformer.ln_f.bias"]
    assert "missing from got (in want): transformer.ln_f.bias" in golden.check(made, grads=wrong)[0]
    assert golden.check(made, losses=[mine.loss.item() * (1 + 1e-9)])[0].startswith("step 0 loss: got ")
    assert golden.check(made, losses=[1.0] * 4)[0] == "losses: 4 given, the golden directory has 3 steps"
    # the CLI: exit 0 with PASS, 1 with the report
    golden.write_safetensors(tmp_path / "ok.safetensors", mine.grads)
    golden.write_safetensors(tmp_path / "bad.safetensors", {k: v for k, v in wrong.items()})
    assert _main(f"python3 -m megatron_scratch.golden check {made} --grads {tmp_path / 'ok.safetensors'}") == 0
    assert capsys.readouterr().out.startswith("PASS")
    assert _main(f"python3 -m megatron_scratch.golden check {made} --grads {tmp_path / 'bad.safetensors'}") == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL") and f"FAIL {name}" in out and "transformer.ln_f.bias" in out
    # a looser tolerance, as a float32 system would pass, lets the 1e-8 through (and only it)
    wrong["transformer.ln_f.bias"] = mine.grads["transformer.ln_f.bias"]
    assert golden.check(made, grads=wrong, rtol=1e-6) == []


def test_the_readme_example_runs_and_passes(made, tmp_path, monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    section = text.split("**Golden files, for a system that cannot import us**")[1].split("\n**")[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    assert [kind for kind, _ in blocks] == ["bash", "python", "bash"], blocks
    (_, generate), (_, code), (_, check) = blocks
    monkeypatch.chdir(tmp_path)
    assert generate.strip() == COMMAND.format(out="golden_small")  # the fixture's command, run already:
    (tmp_path / "golden_small").symlink_to(made)
    exec(compile(code, "README.md", "exec"), {})
    assert _main(check.strip()) == 0
    assert capsys.readouterr().out.startswith("PASS")
    # README's check with a planted mistake in the example's gradients fails
    grads = golden.read_safetensors("my_grads.safetensors")[0]
    grads["transformer.wpe.weight"] = -grads["transformer.wpe.weight"]
    golden.write_safetensors("my_grads.safetensors", grads)
    assert _main(check.strip()) == 1
    assert "FAIL transformer.wpe.weight" in capsys.readouterr().out


@pytest.mark.parametrize("flags, said", [
    ("--layout tp2pp2 --out D", "--layout 'tp2pp2': the form is tp<T>pp<P>dp<D>"),
    ("--layout tp0pp1dp1 --out D", "--layout 'tp0pp1dp1': the form is tp<T>pp<P>dp<D>, each a whole number of at least 1"),
    ("--layout tp3pp1dp1 --config small --out D", "--layout tp3pp1dp1 --config small: tp=3 must divide the config's n_head=4"),
    ("--layout tp1pp3dp1 --config small --out D", "pp=3 must divide the config's n_layer=4"),
    ("--layout tp1pp1dp3 --out D", "dp=3 must divide the global batch of 8 sequences"),
    ("--layout tp4pp4dp2 --config small --out D", "tp x pp x dp = 32 ranks, at most 16 on this machine"),
    ("--layout tp1pp1dp1 --config huge --out D", "--config 'huge': the golden configs are small, tiny"),
    ("--layout tp1pp1dp1 --steps 0 --out D", "--steps 0: a whole number of steps from 1 to 20"),
    ("--layout tp1pp1dp1 --steps 21 --out D", "--steps 21: a whole number of steps from 1 to 20"),
    ("--layout tp1pp1dp1 --steps two --out D", "argument --steps: invalid int value: 'two'"),
    ("--layout tp1pp1dp1 --out FILE", "--out FILE: a file, not a directory"),
    ("--layout tp1pp1dp1 --out FILE --overwrite", "--out FILE: a file, not a directory"),
    ("--layout tp1pp1dp1 --out EXISTING", "--out EXISTING exists: regenerating golden values is deliberate, add --overwrite"),
    ("--config tiny --steps 3 --out D", "--steps: only with --layout"),
    ("--layout tp1pp1dp1", "the following arguments are required: --out"),
    ("--layout tp1pp1dp1 --out FILE/D", "--out FILE/D: cannot be written ("),
    ("check D", "give --grads FILE or --losses FILE"),
    ("check D --grads NOPE", "--grads NOPE: no such file"),
    ("check D --losses FILE", "D: not a golden directory: config.json, weights.safetensors"),
])
def test_bad_flags_are_refused_naming_the_flag_and_the_rule(flags, said, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("[1.0]")
    (tmp_path / "EXISTING").mkdir()
    assert _main("python3 -m megatron_scratch.golden " + flags) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "D").exists()  # nothing written


def test_safetensors_round_trips_every_dtype_and_a_damaged_file_is_refused(tmp_path):
    tensors = {"a": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(5).to(torch.bfloat16),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3)[:, 1:],  # not contiguous
               "d": torch.tensor(2.5, dtype=torch.float32), "e": torch.zeros(0, 3, dtype=torch.float16),
               "f": torch.tensor([True, False])}
    golden.write_safetensors(tmp_path / "t.safetensors", tensors, {"k": 1})
    back, meta = golden.read_safetensors(tmp_path / "t.safetensors")
    assert meta == {"k": "1"} and set(back) == set(tensors)
    assert all(back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t) for k, t in tensors.items())
    assert (8 + int.from_bytes((tmp_path / "t.safetensors").read_bytes()[:8], "little")) % 8 == 0  # header padded
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "short.safetensors").write_bytes(data[:-4])
    with pytest.raises(ValueError, match=r"short.safetensors: \w: dtype .* do not fit the file's"):
        golden.read_safetensors(tmp_path / "short.safetensors")
    with pytest.raises(ValueError, match=r"write_safetensors: x: a torch.complex64 where a tensor of"):
        golden.write_safetensors(tmp_path / "x.safetensors", {"x": torch.zeros(2, dtype=torch.complex64)})
