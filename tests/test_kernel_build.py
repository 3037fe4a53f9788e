"""Loading compiled kernels never wedges: a finished build loads without a lock, a killed build's lock is taken
over with a warning, and a live build elsewhere is waited for with a message (``radixkv.cpu.kernels.build``).

Each test builds a one-function extension (a few seconds) in its own ``TORCH_EXTENSIONS_DIR``, in child processes,
which is how the wedge happens: one process killed while building, the next one starting."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixkv.cpu.kernels.build import LOCK_NAME

pytestmark = pytest.mark.slow

SOURCE = """
#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
LOADER = """
import sys
from radixkv.cpu.kernels.build import load_extension
module = load_extension(sys.argv[1], [sys.argv[2]], ["-O0"], [], what="a test extension")
print("answer", module.answer(), flush=True)
"""
TIMEOUT = 240  # seconds any one child may take: a wedged load would wait forever


@pytest.fixture
def ext(tmp_path, request):
    """(name, source path, environment, its build directory) of a fresh extension."""
    if subprocess.run(["which", "c++"], capture_output=True).returncode:
        pytest.skip("no C++ compiler")
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    name = f"radixkv_test_{request.node.name.split('[')[0][-20:]}_{os.getpid()}"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    return name, str(source), env, tmp_path / "ext" / name


def start(name: str, source: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOADER, name, source], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the load waited more than {TIMEOUT} s (wedged): {err[-2000:]}")
    assert proc.returncode == 0, err[-2000:]
    return out, err


def wait_for(path: Path, seconds: float = TIMEOUT) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_a_build_killed_holding_the_lock_does_not_wedge_the_next_load(ext):
    name, source, env, directory = ext
    first = start(name, source, env)
    wait_for(directory / "lock")  # torch's build lock: the first process is compiling now
    os.killpg(first.pid, signal.SIGKILL)  # a Ctrl-C, a timeout or an out-of-memory kill, mid-build
    first.communicate()
    assert (directory / "lock").exists()  # what used to make every later load wait forever
    out, err = finish(start(name, source, env))
    assert "answer 42" in out
    assert "left by a build that was killed" in err and "building a test extension" in err


def test_a_finished_build_loads_without_taking_any_lock(ext):
    name, source, env, directory = ext
    out, err = finish(start(name, source, env))
    assert "answer 42" in out and "building" in err
    (directory / "lock").touch()  # torch's lock, as a killed build leaves it
    with open(directory / LOCK_NAME, "a+") as held:  # and radixkv's, held by a live process (this one)
        fcntl.flock(held, fcntl.LOCK_EX)
        out, err = finish(start(name, source, env))
    assert "answer 42" in out and "building" not in err and "waiting" not in err


def test_a_live_build_elsewhere_is_waited_for_with_a_message(ext, tmp_path):
    name, source, env, directory = ext
    directory.mkdir(parents=True)
    log = tmp_path / "stderr.txt"
    with open(directory / LOCK_NAME, "a+") as held:  # a live build: this process holds radixkv's lock
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(str(os.getpid()))
        held.flush()
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-c", LOADER, name, source], env=env, stdout=subprocess.PIPE,
                                    stderr=err, text=True, start_new_session=True)
        deadline = time.monotonic() + TIMEOUT
        while f"waiting for process {os.getpid()}" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        assert proc.poll() is None  # still waiting while the lock is held
    out, _ = finish(proc)
    assert "answer 42" in out and "building a test extension" in log.read_text()
