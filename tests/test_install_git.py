"""`pip install git+<url>` (issue 42, point 5): offline, from a `git+file://` URL of a temporary git
repository holding the package's sources (the files tests/test_testing_kit.py's wheel is built from, as
they are in this working tree, committed there), into a fresh venv outside the checkout, with
--no-build-isolation and --no-deps so that nothing is fetched: the build uses this environment's
setuptools, and the venv reuses this environment's torch (--system-site-packages, and a .pth naming
this interpreter's site-packages, for a torch that lives in a venv itself). Then the README's library
example runs there, from a directory outside the checkout, with no PYTHONPATH, and every module it
imports must come from the venv. Cost: about 15 s (git's clone, setuptools' build, a fresh interpreter
importing torch), so it runs under --full-grid; the wheel test, which builds the same way, holds CI.
"""
import json
import os
import shutil
import site
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from test_testing_kit import SOURCES


def _run(*cmd, cwd=None, env=None, timeout=180):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{(proc.stdout + proc.stderr)[-3000:]}"
    return proc


@pytest.mark.full_grid(covered_by=["test_the_wheel_holds_the_chapters_and_runs_the_readme_library_example"],
                       why="about 15 s: a git clone, a setuptools build and a fresh interpreter; the wheel test "
                           "builds the same package the same way")
def test_pip_install_git_url_gives_a_working_package_in_a_fresh_venv(tmp_path):
    t0 = time.monotonic()
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in SOURCES + sorted(p.name for p in ROOT.glob("0[1-9]_*.py")) + ["README.md"]:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, repo / name)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", "-c", "init.defaultBranch=main"]
    _run(*git, "init", "-q", cwd=repo)
    _run(*git, "add", "-A", cwd=repo)
    _run(*git, "commit", "-q", "-m", "the package's sources", cwd=repo)

    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv)
    python = venv / "bin" / "python"
    mine = _run(python, "-c", "import site; print(site.getsitepackages()[0])").stdout.strip()
    reuse = [p for p in site.getsitepackages() if os.path.isdir(p)]  # this environment's torch, setuptools
    (tmp_path / "venv" / mine.split(str(venv) + os.sep, 1)[1] / "_reuse_outer.pth").write_text("\n".join(reuse) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "PIP_REQUIRE_VIRTUALENV")}
    env.update(OMP_NUM_THREADS="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-build-isolation",
         f"git+file://{repo}", cwd=tmp_path, env=env)

    text = (ROOT / "README.md").read_text()
    code = text.split("## Use it as a correctness baseline")[1].split("```python\n")[1].split("```")[0]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "example.py").write_text(code + "\nimport megatron_scratch, plumbing, megatron_scratch.reference\n"
                                        "print('FROM', megatron_scratch.__file__, tensor_parallel.__file__, "
                                        "plumbing.__file__, megatron_scratch.reference.__file__)\n")
    proc = _run(python, "example.py", cwd=outside, env=env)
    where = proc.stdout.split("FROM ")[1].split()
    assert len(where) == 4 and all(p.startswith(mine) for p in where), (mine, where)
    direct = json.loads(next((venv / mine.split(str(venv) + os.sep, 1)[1]).glob("megatron_scratch-*.dist-info"))
                        .joinpath("direct_url.json").read_text())  # PEP 610: where pip installed it from
    assert direct["url"] == f"file://{repo}" and direct["vcs_info"]["vcs"] == "git", direct
    assert time.monotonic() - t0 < 120
