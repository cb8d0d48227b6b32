"""A proc's entry point skips the interpreter's teardown but keeps its exit code, its
threads' and atexit callbacks' work and its buffered output."""

import os
import subprocess
import sys

import pytest

MAIN = """
import atexit, sys, threading, time
class Cycle:
    def __del__(self):
        print("teardown ran")  # only the teardown's garbage collection finds it
cycle = Cycle()
cycle.me = cycle
atexit.register(lambda: print("atexit ran"))
def late():
    time.sleep(0.2)
    print("thread ended")
threading.Thread(target=late).start()  # not a daemon: joined before the exit
print("buffered")  # stdout is a pipe: block-buffered
{end}
"""


@pytest.mark.parametrize(("end", "code", "said"), [
    ("", 0, ""), ("sys.exit(3)", 3, ""), ("sys.exit('bad input')", 1, "bad input"),
    ("raise ValueError('boom')", 1, "ValueError: boom")])
def test_a_proc_exits_with_its_code_after_its_threads_and_atexit_callbacks(
        tmp_path, end, code, said):
    (tmp_path / "proc_module.py").write_text(MAIN.format(end=end))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    done = subprocess.run(
        [sys.executable, "-c", "from colocate.resources.proc_main import run; "
         "run('proc_module')"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stdout.splitlines() == ["buffered", "thread ended", "atexit ran"]
    assert said in done.stderr
