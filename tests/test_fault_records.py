"""scripts/fault_records.py: week 4's fault-diagnosis records, a fresh instance per seed. The same seed
gives the same bytes, another seed another instance; the students' file holds no part of the key; the
key is what plumbing/health.py says of the file's own records; and every instance's records say what
was planted (the script refuses to write one whose diagnosis differs, shown below by planting a bug)."""
import importlib
import importlib.util
import json

import pytest

from conftest import ROOT
from plumbing import health


@pytest.fixture(scope="module")
def faults():
    spec = importlib.util.spec_from_file_location("fault_records", ROOT / "scripts" / "fault_records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(faults, tmp_path, *argv):
    path = tmp_path / "out.txt"
    assert faults.main([*argv, "--out", str(path)], out=lambda _: None) == 0
    return path.read_bytes()


def test_the_same_seed_gives_the_same_bytes_and_other_seeds_other_instances(faults, tmp_path):
    assert run(faults, tmp_path, "--seed", "7") == run(faults, tmp_path, "--seed", "7")
    assert run(faults, tmp_path, "--seed", "7", "--key") == run(faults, tmp_path, "--seed", "7", "--key")
    files = {run(faults, tmp_path, "--seed", str(s)) for s in range(6)}
    assert len(files) == 6  # six cohorts, six instances
    keys = [faults.instance(s)[1]["diagnosis"] for s in range(40)]
    assert len({(tuple(k["culprits"]), k["kind"]) for k in keys}) > 10  # not one answer under other numbers


def test_the_students_file_holds_the_records_and_not_the_key(faults, tmp_path):
    text = run(faults, tmp_path, "--seed", "3").decode()
    data = json.loads(text)
    assert list(data) == ["what", "layout", "groups", "load", "records", "busy_ms", "questions"]
    key = faults.key_text(faults.instance(3)[1])
    assert "answer key" in key and "answer key" not in text and "seed" not in text
    for line in key.splitlines()[3:]:  # the key's answers: none of them in the students' file
        answer = line.split(": ", 1)[-1].strip()
        assert answer and answer not in text, answer


@pytest.mark.parametrize("seed", [0, 7, 11])
def test_the_key_is_what_plumbing_health_says_of_the_files_own_records(faults, tmp_path, seed):
    data = json.loads(run(faults, tmp_path, "--seed", str(seed)))
    records = {int(r): rec for r, rec in data["records"].items()}  # as the file's "load" says
    busy = {int(r): ms for r, ms in data["busy_ms"].items()}
    stage = {r: p for chain in data["groups"]["pp"] for p, r in enumerate(chain)}
    key = faults.instance(seed)[1]
    found = health.diagnose(records, 8)
    assert (found.culprits, found.kind, found.why) == (key["diagnosis"]["culprits"], key["diagnosis"]["kind"],
                                                        key["diagnosis"]["why"])
    assert health.stragglers(busy, stage) == key["stragglers"] and len(key["stragglers"]) == 1
    assert len(health.stragglers(busy, {r: 0 for r in busy})) > 1  # question 4: the world's median names more
    assert f"(2) diagnose(): {found.kind} at {found.culprits}" in faults.key_text(key)


def test_every_kind_of_fault_and_every_layout_comes_up_and_each_change_changes_the_kind(faults):
    seen = set()
    for seed in range(120):  # each instance() checks its records' diagnosis against what it planted
        _, key = faults.instance(seed)
        seen.add((key["diagnosis"]["kind"], key["layout"]))
        changed = key["changed_diagnosis"].split(" at ")[0]
        assert (changed == "cycle") == (key["diagnosis"]["kind"] != "cycle"), (seed, key["change"])
    assert {k for k, _ in seen} == set(faults.KINDS)
    assert {lay for _, lay in seen} == {"tp {} x pp {} x dp {}".format(*lay) for lay in faults.LAYOUTS}


@pytest.mark.parametrize("seed,kind", [(1, "outside communication"), (5, "silent")])
def test_records_that_do_not_say_what_was_planted_are_refused(faults, monkeypatch, seed, kind):
    honest = faults._records

    def receives_unsaid(rng, g, waits, step, culprit, kind_):  # a planted bug: a receive's peer not written
        out = honest(rng, g, waits, step, culprit, kind_)
        for rec in out.values():
            rec["waiting_for"] = []
        return out
    assert faults.instance(seed)[1]["diagnosis"]["kind"] == kind
    monkeypatch.setattr(faults, "_records", receives_unsaid)
    with pytest.raises(AssertionError, match=f"seed {seed}: planted {kind} at .*, diagnose\\(\\) says"):
        faults.instance(seed)


def test_the_grid_is_05s_rank_grid_and_a_negative_seed_is_refused(faults, capsys):
    rank_grid = importlib.import_module("05_3d_gpt").rank_grid
    for tp, pp, dp in faults.LAYOUTS:
        want = rank_grid(8, tp, dp, pp)
        assert faults.grid(tp, pp, dp) == {k: want[k] for k in ("tp", "dp", "pp")}
    with pytest.raises(SystemExit):
        faults.main(["--seed", "-1"])
    assert "--seed -1: must be 0 or more" in capsys.readouterr().err
