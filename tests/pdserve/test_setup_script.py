"""scripts/setup.sh talks while it works: each step is numbered and timed. Run for real here, on a copy of the
script in a scratch repository whose .venv holds stubs (a python and a pip that record their arguments; the
python's `import torch` succeeds, so torch is kept) and a PATH with redis-server and chromium stubs, so it neither downloads nor installs."""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_setup_numbers_and_times_every_step(tmp_path: Path) -> None:
    fake = tmp_path / "repo"
    (fake / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", fake / "scripts" / "setup.sh")
    bin_dir = fake / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'python.log'}\n")  # `import torch` succeeds
    (bin_dir / "pip").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'pip.log'}\n")
    for tool in (bin_dir / "python", bin_dir / "pip"):
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    for name in ("redis-server", "chromium"):  # found: nothing to install
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    out = subprocess.run(["bash", str(fake / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    starts = [line for line in lines if line.startswith("[setup ") and line.endswith(" ...")]
    dones = [line for line in lines if " done in " in line]
    assert [line.split("]")[0] for line in starts] == [f"[setup {i}/5" for i in range(1, 6)], out.stderr
    assert len(dones) == 5 and lines[-1].startswith("[setup] .venv ready in "), out.stderr
    assert (tmp_path / "pip.log").read_text().split() == ["install", "-q", "-e", ".[dev]"]
    # every package's folder gets its bytecode (pyproject's package-dir, so a new package cannot be left out)
    [compile_args] = [line.split() for line in (tmp_path / "python.log").read_text().splitlines() if "compileall" in line]
    folders = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert folders <= set(compile_args), folders - set(compile_args)
