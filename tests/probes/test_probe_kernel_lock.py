"""Issue 43's hang: a run killed while building the C++ kernel leaves torch's build lock, and the next step
waited on it up to 600 s, or for ever, in silence. Now a young lock is waited for, said, and an old one
(`STALE_LOCK_S`) is removed, said; a lock another build removes ends the wait at once."""

import os
import threading
import time

import pytest

from workbench.optim import cpu_kernel


def test_a_stale_lock_is_removed_and_said(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 2 * cpu_kernel.STALE_LOCK_S
    os.utime(lock, (old, old))
    start = time.perf_counter()
    with pytest.warns(UserWarning, match=r"removed .*lock, a build lock \d+ s old"):
        cpu_kernel.wait_for_build_lock(lock)
    assert not lock.exists() and time.perf_counter() - start < 1.0


def test_a_young_lock_is_waited_for_said_then_taken_as_abandoned(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    start = time.perf_counter()
    with pytest.warns(UserWarning) as said:
        cpu_kernel.wait_for_build_lock(lock, stale_after=0.5)
    assert "waiting for" in str(said[0].message) and "delete it yourself" in str(said[0].message)
    assert "removed" in str(said[-1].message)
    assert not lock.exists() and 0.4 < time.perf_counter() - start < 3.0


def test_a_lock_another_build_removes_ends_the_wait(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()
    start = time.perf_counter()
    with pytest.warns(UserWarning, match="waiting for"):
        cpu_kernel.wait_for_build_lock(lock, stale_after=60)
    assert time.perf_counter() - start < 2.0


def test_no_lock_no_wait(tmp_path, recwarn):
    cpu_kernel.wait_for_build_lock(tmp_path / "lock")
    assert not recwarn.list
