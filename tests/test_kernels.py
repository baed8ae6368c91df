"""Tests for building the native kernels: what the build needs from the environment."""

import os
import stat
import subprocess
import sys

from kvbank.kernels import path_with_ninja


def test_build_path_gains_the_pip_ninja_when_path_has_none(tmp_path):
    bare = str(tmp_path)  # no ninja here, unlike /usr/bin on many machines
    path = path_with_ninja(bare)
    ninja_dir = path.split(os.pathsep)[0]
    assert path.endswith(bare) and ninja_dir != bare
    ninja = os.path.join(ninja_dir, "ninja")
    assert os.stat(ninja).st_mode & stat.S_IXUSR, ninja


def test_build_path_is_unchanged_when_it_has_ninja_already(tmp_path):
    (tmp_path / "ninja").write_text("#!/bin/sh\n")
    (tmp_path / "ninja").chmod(0o755)
    assert path_with_ninja(str(tmp_path)) == str(tmp_path)


def test_torch_finds_ninja_on_the_build_path_of_a_process_without_one(tmp_path, kvbank_env):
    # What `.venv/bin/python` sees when run directly by make on a machine without ninja-build.
    script = (
        "import os\n"
        "from torch.utils.cpp_extension import is_ninja_available\n"
        "from kvbank.kernels import path_with_ninja\n"
        "assert not is_ninja_available(), os.environ['PATH']\n"
        "os.environ['PATH'] = path_with_ninja(os.environ['PATH'])\n"
        "assert is_ninja_available(), os.environ['PATH']\n"
    )
    env = dict(kvbank_env, PATH=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
