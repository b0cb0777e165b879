"""A build lock left by a killed compile of DeepSpeed's CPU op is refused before any rank
starts, with the file and the fix; a fresh lock (a build in progress) is left alone."""

from __future__ import annotations

import os
import time

import pytest

from verl_ppo.job.preflight import STALE_BUILD_S, PreflightError, check_build_lock


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    return folder


def test_no_lock_passes(ext_dir):
    (ext_dir / "build.ninja").write_text("")
    check_build_lock()


def test_fresh_lock_of_a_live_build_passes(ext_dir):
    (ext_dir / "lock").touch()
    check_build_lock()  # a build in progress: the ranks wait for it, as torch does


def test_stale_lock_is_refused_with_the_fix(ext_dir):
    lock = ext_dir / "lock"
    lock.touch()
    old = time.time() - STALE_BUILD_S - 60
    os.utime(lock, (old, old))
    with pytest.raises(
        PreflightError, match=r"deepspeed_shm_comm/lock .*\(rm .*TORCH_EXTENSIONS_DIR"
    ):
        check_build_lock()


def test_a_build_writing_files_keeps_an_old_lock_alive(ext_dir):
    lock = ext_dir / "lock"
    lock.touch()
    old = time.time() - STALE_BUILD_S - 60
    os.utime(lock, (old, old))
    (ext_dir / "shm.o").write_bytes(b"")  # written now: the build is alive
    check_build_lock()
