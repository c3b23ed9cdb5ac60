"""The recipe ships in the package: the built wheel holds the Hydra configs, and its `lit-rlvr-train` console
entry runs 2 steps from a directory that is not a clone.

The fresh venv gets only the wheel (`pip install --no-deps`); its dependencies (torch, lightning, ...) come from
this interpreter's site-packages through a .pth file written after the install, so nothing is downloaded or
reinstalled. A .pth file's lines only add paths: the editable install of this clone (itself a .pth hook) is
not activated there, so the import of `lit_rlvr` resolves to the wheel's copy, which the test checks.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"  # a copy: setuptools builds in the tree, and a stale build/ would ship removed files
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".cache", "build", "dist", "outputs", "runs",
                                                               "*.egg-info", "__pycache__", "wandb", "lightning_logs",
                                                               ".venv*", "venv"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                   check=True, capture_output=True, text=True, timeout=600)
    return next(out.glob("lit_rlvr-*.whl"))


def test_wheel_holds_configs_and_entry(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for conf in ("config.yaml", "algorithm/c3po.yaml", "algorithm/callbacks/value_prior.yaml", "cli/tiny_grpo.yaml",
                 "data/jsonl.yaml", "logger/csv.yaml"):
        assert f"lit_rlvr/conf/{conf}" in names, conf
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "lit-rlvr-train = lit_rlvr.app.entry:console" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_trains_from_another_directory(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (Path(purelib) / "deps_from_test.pth").write_text("\n".join(deps) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import lit_rlvr; print(lit_rlvr.__file__)"], cwd=elsewhere, env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    assert where.startswith(str(venv)), where  # the wheel's copy, not the clone's

    cmd = [str(venv / "bin" / "lit-rlvr-train"), "trainer.max_steps=2", "eval_before=false", "data.batch_size=4",
           "data.num_test=8", "callbacks.progress=null", "hydra.run.dir=run"]
    done = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (elsewhere / "run" / "summary.json").exists()
    assert (elsewhere / "run" / "checkpoints" / "last.ckpt").exists()


def test_the_wheel_holds_every_package_of_the_source(wheel):
    """A package missing from setup.cfg's list fails only where it is imported; check them all at once."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for init in sorted((REPO / "lit_rlvr").rglob("__init__.py")):
        inside = init.relative_to(REPO).as_posix()
        assert inside in names, f"{inside} is not in the wheel: add its package to setup.cfg's packages"
