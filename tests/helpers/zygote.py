"""Ranks forked from one process that has already imported torch and the launcher.

Each rank the tests start (`python -m meshrun.launcher RUN_DIR`, tests/helpers/ranks.py) spent about 4 s of CPU
importing torch and the trainer before its first step: for a tiny job on 2 cores, most of its cost, and the
suite starts hundreds. Here a server process imports them once, and each rank is a fork of it that then runs
`launcher/__main__.py` exactly as `python -m meshrun.launcher` would, in the environment, folder and argv the test
gives: a real process with its own pid, signals and exit code (as torch's own DataLoader workers are forked
after torch is imported). What a rank imports beyond the preloaded modules it imports itself.

The server reads one JSON request per line on stdin ({"argv", "env", "cwd", "output"}), forks, and answers
{"pid"}. It reaps its children and writes each one's exit status (Popen's convention: -N for signal N) to
OUTPUT.exit, which the test's handle (`ForkedRank`, Popen's methods that the tests use) reads.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from meshrun.launcher.local.controller import TRAINER_PRELOAD as PRELOAD  # what every trainer rank imports first

REPO = Path(__file__).resolve().parents[2]

DISABLED_ENV = "MESHRUN_TEST_NO_FORK"
"""Set (to anything) to start every rank with its own `python -m meshrun.launcher`, as before."""


class ForkedRank:
    """The subprocess.Popen methods the rank tests use, for a rank forked by the server."""

    def __init__(self, pid: int, output: Path) -> None:
        self.pid, self.output, self.returncode = pid, output, None
        self.args = ["python", "-m", "meshrun.launcher"]

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                self.returncode = int(Path(f"{self.output}.exit").read_text())
            except (OSError, ValueError):
                return None
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.05)
        return code

    def communicate(self, timeout: Optional[float] = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.output.read_text(errors="replace"), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's side: starts the server once, asks it for ranks."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="meshrun-ranks-"))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
        self.server = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.zygote"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lock = threading.Lock()
        self.count = 0
        ready = self.server.stdout.readline() if self.server.stdout else ""
        if ready.strip() != "ready":
            raise RuntimeError(f"the rank server did not start: {ready!r}")
        atexit.register(self.close)

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: Optional[str] = None, script: bool = False
    ) -> ForkedRank:
        """A fork that runs `python -m meshrun.launcher ARGS...` (argv[0] is the module's file), or with `script`, the
        Python file argv[0] as `python SCRIPT ARGS...` would."""
        assert self.server.stdin is not None and self.server.stdout is not None
        with self.lock:
            self.count += 1
            output = self.folder / f"rank-{self.count}.out"
            request = {"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "output": str(output), "script": script}
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            answer = json.loads(self.server.stdout.readline())
        return ForkedRank(int(answer["pid"]), output)

    def close(self) -> None:
        if self.server.poll() is None:
            assert self.server.stdin is not None
            self.server.stdin.close()  # the server kills what is left of its ranks and exits
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


_ZYGOTE: Optional[Zygote] = None


def spawn(argv: list[str], env: dict[str, str], script: bool = False) -> Any:
    """A rank running `python -m meshrun.launcher ARGS...` (argv[0] is the module's file), or with `script` the test's
    own rank script argv[0] (`python SCRIPT ARGS...`), forked from the server."""
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.server.poll() is not None:
        _ZYGOTE = Zygote()
    return _ZYGOTE.spawn(argv, env, script=script)


def close() -> None:
    """Stop the server (and any rank it still has): the session is over."""
    global _ZYGOTE
    if _ZYGOTE is not None:
        _ZYGOTE.close()
        _ZYGOTE = None


# ------------------------------------------------------------------ the server


def _serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    exits: dict[int, str] = {}

    def reap(*_args: object) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            path = exits.pop(pid, None)
            if path is not None:
                tmp = f"{path}.tmp"
                Path(tmp).write_text(str(code))
                os.replace(tmp, path)  # whole, or not there: the handle never reads half a number

    signal.signal(signal.SIGCHLD, reap)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # the pid is recorded before it is reaped
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            _run_rank(request)
        exits[pid] = f"{request['output']}.exit"
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(json.dumps({"pid": pid}), flush=True)
    for pid in list(exits):  # the tests are over: nothing of theirs outlives them
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_rank(request: dict[str, Any]) -> None:
    """In the fork: become `python -m meshrun.launcher ...` (or `python SCRIPT ...`) in the test's environment; never
    returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, for its life
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        import runpy

        if request.get("script"):
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # as `python SCRIPT` sets it
            runpy.run_path(sys.argv[0], run_name="__main__")
        else:
            runpy.run_module("meshrun.launcher", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:  # what the interpreter does on its way out: non-daemon threads joined, atexit run, buffers flushed
            threading._shutdown()  # type: ignore[attr-defined]
            import atexit as _atexit

            _atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    _serve()
