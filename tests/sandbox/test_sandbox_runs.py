"""What a program gets in and gives back: stdin, stdout, stderr, exit code, tracebacks, each
status, and a fresh sandbox for every run."""

import hashlib

import pytest
from sandbox_host_view import BOUND_SECONDS, serves_correctly

from rl_tpu.sandbox import Execution, Limits


def test_stdin_reaches_the_program_and_its_outputs_and_exit_code_come_back(sandbox):
    program = ("import sys\na, b = map(int, sys.stdin.readline().split())\nprint(a + b)\n"
               "print('to stderr', file=sys.stderr)\nsys.exit(3)\n")
    execution = sandbox.run(program, stdin="19 23\n")
    assert (execution.stdout, execution.stderr) == ("42\n", "to stderr\n")
    assert (execution.status, execution.exit_code, execution.ok) == ("error", 3, False)
    assert 0 < execution.seconds < BOUND_SECONDS


def test_a_clean_program_is_ok_with_exit_code_zero_and_runs_as_main(sandbox):
    program = "if __name__ == '__main__':\n    print('é', 2 ** 10)\n"
    execution = sandbox.run(program)
    assert (execution.status, execution.exit_code, execution.ok) == ("ok", 0, True)
    assert (execution.stdout, execution.stderr) == ("é 1024\n", "")


def test_a_megabyte_of_stdin_arrives_whole(sandbox):
    data = "".join(f"{i}\n" for i in range(150_000))  # 1,038,890 bytes
    program = ("import hashlib, sys\nblob = sys.stdin.buffer.read()\n"
               "print(len(blob), hashlib.sha256(blob).hexdigest())\n")
    execution = sandbox.run(program, stdin=data)
    assert execution.ok
    assert execution.stdout.split() == [str(len(data)), hashlib.sha256(data.encode()).hexdigest()]


def test_a_syntax_error_is_an_error_with_the_traceback_in_stderr(sandbox):
    execution = sandbox.run("print('fine')\ndef broken(:\n    pass\n")
    assert (execution.status, execution.exit_code, execution.stdout) == ("error", 1, "")
    assert 'File "main.py", line 2' in execution.stderr
    assert execution.stderr.rstrip().endswith("SyntaxError: invalid syntax")
    serves_correctly(sandbox)


def test_an_exception_traceback_reads_like_the_programs_own(sandbox):
    execution = sandbox.run("def divide(x):\n    return x / 0\n\ndivide(1)\n")
    assert (execution.status, execution.exit_code) == ("error", 1)
    # The program's frames with their source lines, and none of the launcher's.
    assert execution.stderr.splitlines()[0] == "Traceback (most recent call last):"
    assert 'File "main.py", line 4, in <module>' in execution.stderr
    assert 'File "main.py", line 2, in divide' in execution.stderr
    assert "    return x / 0" in execution.stderr
    assert "<string>" not in execution.stderr and "launcher" not in execution.stderr
    assert execution.stderr.rstrip().endswith("ZeroDivisionError: division by zero")


def test_exit_codes_of_sys_exit_and_os_exit(sandbox):
    assert sandbox.run("import sys\nprint('x')\nsys.exit(0)\n").status == "ok"
    execution = sandbox.run("import os\nos._exit(5)\n")
    assert (execution.status, execution.exit_code) == ("error", 5)
    execution = sandbox.run("raise SystemExit('a message')\n")
    assert (execution.status, execution.exit_code, execution.stderr) == ("error", 1, "a message\n")


def test_death_by_a_signal_is_killed(sandbox):
    execution = sandbox.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert (execution.status, execution.exit_code) == ("killed", None)
    serves_correctly(sandbox)


def test_cpu_time_counts_from_the_programs_start(sandbox):
    # 0.6 s of the program's own CPU under a 1 s limit: the interpreter's start (and import) is
    # not charged. (Past the limit: test_sandbox_containment's infinite loop.)
    burn = ("import time\nstart = time.process_time()\nwhile time.process_time() - start < %s:\n"
            "    pass\nprint('done')\n")
    limits = Limits(cpu_seconds=1, wall_seconds=BOUND_SECONDS)
    execution = sandbox.run(burn % 0.6, limits=limits)
    assert (execution.status, execution.stdout) == ("ok", "done\n")


def test_memory_under_the_limit_is_fine(sandbox):
    execution = sandbox.run("blob = bytearray(100 * 2**20)\nprint(len(blob) // 2**20)\n")
    assert (execution.status, execution.stdout) == ("ok", "100\n")


def test_each_run_gets_a_fresh_sandbox(sandbox):
    leave = ("import os\nprint(sorted(os.listdir('.')), sorted(os.listdir('/dev/shm')))\n"
             "open('left_behind', 'w').write('x')\nopen('/dev/shm/left_behind', 'w').write('x')\n")
    for _ in range(3):  # never sees what an earlier run wrote
        assert sandbox.run(leave).stdout == "[] []\n"


def test_a_run_with_another_tmpfs_size_gets_that_size(sandbox):
    program = "import os\nstat = os.statvfs('.')\nprint(stat.f_blocks * stat.f_frsize)\n"
    assert sandbox.run(program).stdout == f"{64 * 2**20}\n"  # the pool's, Limits' default
    execution = sandbox.run(program, limits=Limits(tmpfs_bytes=8 * 2**20))
    assert execution.stdout == f"{8 * 2**20}\n"


def test_the_environment_is_cleared(sandbox):
    execution = sandbox.run("import os\nprint(sorted(os.environ))\nprint(os.getcwd())\n")
    assert execution.stdout == ("['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', "
                                "'OPENBLAS_NUM_THREADS', 'PATH', 'PWD', "
                                "'PYTHONDONTWRITEBYTECODE']\n/tmp\n")


@pytest.mark.parametrize("bad", [dict(wall_seconds=0), dict(cpu_seconds=-1),
                                 dict(memory_bytes=1.5e9), dict(memory_bytes=2**20),
                                 dict(processes=1), dict(output_bytes=True)])
def test_bad_limits_are_refused(bad):
    with pytest.raises(ValueError, match="Limits"):
        Limits(**bad)


def test_a_bad_status_is_refused():
    with pytest.raises(ValueError, match="status"):
        Execution(stdout="", stderr="", status="fine", exit_code=0, seconds=0.1)


def test_bad_arguments_to_run_are_refused(sandbox):
    with pytest.raises(TypeError, match="code"):
        sandbox.run(b"print(1)")
    with pytest.raises(TypeError, match="stdin"):
        sandbox.run("print(1)", stdin=b"")
    with pytest.raises(TypeError, match="limits"):
        sandbox.run("print(1)", limits={"wall_seconds": 1})


def test_text_no_program_could_be_is_an_error_or_replaced_not_a_crash(sandbox):
    execution = sandbox.run("print('nul\x00byte')\n")
    assert (execution.status, execution.exit_code) == ("error", 1)
    assert "null bytes" in execution.stderr
    # A lone surrogate (possible in decoded model output) cannot be UTF-8: it arrives as "?".
    execution = sandbox.run("print('a\ud800b')\nprint(input())\n", stdin="c\udfffd\n")
    assert (execution.status, execution.stdout) == ("ok", "a?b\nc?d\n")
