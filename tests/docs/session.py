"""One page's session: a sandbox user (own HOME, XDG dirs) in a copy of the repository, running its blocks in order.

A `console` command or a `bash` block runs in bash with the session's working directory and environment,
and what it changes there (`cd`, `export`) carries to the next one, as in one terminal. `meshrun` is the
worktree's (tests/helpers/cli.py's environment, a `meshrun` on PATH that imports this checkout). `python`
blocks share one interpreter (tests/docs/pydriver.py). `yaml` blocks are loaded by meshrun's own loaders.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

from tests.docs import console, yamlcheck
from tests.docs.blocks import REPO, Block
from tests.docs.interpreter import Interpreter
from tests.helpers.cli import CLUSTER_ONLY, env_for, meshrun, repo_pythonpath

DEFAULT_TIMEOUT_S = 120
"""A command's (or a block's) limit unless `<!-- example: timeout S -->` says otherwise."""
SHIM = """#!{python}
# The docs runner's `meshrun`: this checkout's CLI (PYTHONPATH), whatever the working directory.
import sys
from meshrun.submit.cli.main import main
sys.exit(main())
"""
_WRAPPER = 'set -o pipefail; {strict}source "$1"; __rc=$?; pwd >"$2/cwd"; env -0 >"$2/env"; exit $__rc'


class ExampleFailed(AssertionError):
    """An example that did not do what its page says."""


class Session:
    def __init__(self, root: Path, corpus: Optional[Path] = None) -> None:
        self.root = root
        self.home = root / "home"
        self.repo = root / "repo"
        self.state = root / ".state"
        for folder in (self.home, self.state, root / "bin"):
            folder.mkdir(parents=True, exist_ok=True)
        _copy_checkout(self.repo)
        if (Path(sys.prefix) / "bin" / "activate").is_file():  # as after `bash scripts/setup.sh`: this environment
            (self.repo / ".venv").symlink_to(sys.prefix)
        if corpus is not None:  # a user who has run `meshrun data`: the default token file, a copy of the suite's
            data = self.home / ".cache" / "meshrun" / "data"
            data.mkdir(parents=True)
            for part in corpus.parent.glob(f"{corpus.name.split('.')[0]}.*"):
                shutil.copy(part, data / part.name)
        shim = root / "bin" / "meshrun"
        shim.write_text(SHIM.format(python=sys.executable))
        shim.chmod(0o755)
        # The XDG defaults a user without XDG variables has, so that the pages' ~/.config/meshrun/... and
        # ~/.local/state/meshrun/... are where meshrun looks.
        self.xdg = {
            "XDG_STATE_HOME": str(self.home / ".local" / "state"),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
        }
        env = {**env_for(self.home), **self.xdg}
        env["PATH"] = f"{shim.parent}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = repo_pythonpath()  # the worktree's code, for every process the examples start
        self.env = env
        self.cwd = self.repo
        self.job: Optional[str] = None
        self.run_dir: Optional[str] = None
        self._python: Optional[Interpreter] = None

    # ------------------------------------------------------------------ blocks

    def run(self, block: Block) -> None:
        """Run (or validate, or write) one block; ExampleFailed says what went wrong."""
        timeout = float(_arg(block, "timeout", str(DEFAULT_TIMEOUT_S)))
        exit_code = int(_arg(block, "exit", "0"))
        target = block.marker("file")
        if block.place != "local":
            self.enter(block.place)
        if block.lang == "yaml":
            path = self.resolve(target.arg) if target else None
            self.check_yaml(block, path)
        elif target:
            path = self.resolve(target.arg)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.body)
            path.chmod(0o755)
        elif block.lang == "bash":
            self.shell(self.substitute(block.body, block), block.place, timeout, exit_code, True, block.where)
        elif block.lang == "console":
            self.console(block, timeout, exit_code)
        elif block.lang == "python":
            self.python(block, timeout, exit_code)

    def console(self, block: Block, timeout: float, exit_code: int) -> None:
        try:
            commands = console.parse_console(block.body)
        except console.ConsoleError as exc:
            raise ExampleFailed(f"{block.where}: {exc}") from None
        for n, command in enumerate(commands):
            where = f"{block.page}:{block.line + command.line}"  # the command's own line
            text = self.substitute(command.text, block)
            want = exit_code if n == len(commands) - 1 else 0
            printed = self.shell(text, block.place, timeout, want, False, where)
            values = {k: v for k, v in (("JOB", self.job), ("RUN_DIR", self.run_dir)) if v}
            values = {k: console.normalize(v, str(self.home)).strip() for k, v in values.items()}
            if not console.matches(command.shown, printed, values, str(self.home)):
                shown = "\n".join(command.shown)
                raise ExampleFailed(
                    f"{where}: `$ {command.text}` printed what the page does not show.\n"
                    f"shown:\n{_indent(shown)}\nprinted (~ is the sandbox's HOME):\n"
                    f"{_indent(_tail(console.normalize(printed, str(self.home))))}"
                )

    def shell(self, text: str, place: str, timeout: float, want: int, strict: bool, where: str) -> str:
        """Run `text` in bash as the session's user at `place` (`strict`: a bash block, under `set -e`, so
        every line must succeed); what it printed, stdout and stderr together."""
        what = "the bash block" if strict else f"`$ {_first(text)}`"
        script = self.state / "command.sh"
        script.write_text(text + "\n")
        argv = [
            "bash",
            "-c",
            _WRAPPER.format(strict="set -e; " if strict else ""),
            "bash",
            str(script),
            str(self.state),
        ]
        env = self.env_for(place)
        proc = subprocess.Popen(
            argv,
            cwd=self.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a timeout ends the command and everything it started
        )
        try:
            printed, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            printed, _ = proc.communicate()
            raise ExampleFailed(f"{where}: {what} ran past {timeout:.0f} s\n{_indent(_tail(printed))}") from None
        self._carry(place)
        self._note_job(printed)
        if proc.returncode != want:
            raise ExampleFailed(
                f"{where}: {what} exited {proc.returncode}, the page expects {want}\n{_indent(_tail(printed))}"
            )
        return printed

    def python(self, block: Block, timeout: float, exit_code: int) -> None:
        if self._python is None or not self._python.alive:
            self._python = Interpreter(self.cwd, self.env_for("local"), self.root / "python.log")
        outcome = self._python.run(block.body, block.where, timeout)
        self._note_job(outcome.printed)
        if outcome.exit is None:
            self._python = None
            raise ExampleFailed(
                f"{block.where}: the python block ran past {timeout:.0f} s\n{_indent(_tail(outcome.printed))}"
            )
        if outcome.exit != exit_code:
            raise ExampleFailed(
                f"{block.where}: the python block ended with {outcome.exit}, the page expects {exit_code}\n"
                f"{_indent(_tail(outcome.printed))}\n{_indent(outcome.error)}"
            )

    def check_yaml(self, block: Block, path: Optional[Path]) -> None:
        """Load the block with meshrun's own loader (tests/docs/yamlcheck.py); with a `file` marker it is
        also written there, as the page shows it."""
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.body)
        found = yamlcheck.problem(block, self.root / "yaml-check", path.stem if path is not None else None)
        if found:
            raise ExampleFailed(f"{block.where}: {found}")

    # ------------------------------------------------------------------ the session's state

    def resolve(self, path: str) -> Path:
        """A path a marker names: `~/...` in the sandbox HOME, anything else from the session's folder."""
        if path.startswith("~/"):
            return self.home / path[2:]
        return self.cwd / path

    def env_for(self, place: str) -> dict[str, str]:
        """The session's environment; on a laptop (ssh) without what only the cluster's login node has."""
        if place == "ssh":
            return {k: v for k, v in self.env.items() if k not in CLUSTER_ONLY}
        return dict(self.env)

    def enter(self, place: str) -> None:
        """Before a block at `place`: the profile `mycluster` names that cluster (tests/docs/README.md)."""
        clusters = Path(self.xdg["XDG_CONFIG_HOME"]) / "meshrun" / "clusters"
        clusters.mkdir(parents=True, exist_ok=True)
        if place == "testbed":
            from tests.testbed import testbed as tb

            shutil.copy(tb.profile_file(), clusters / "mycluster.yaml")  # this worker's own testbed
        elif place == "ssh":
            from tests.helpers import sshbed

            sshbed.profile(clusters, name="mycluster")

    def substitute(self, text: str, block: Block) -> str:
        """JOB and RUN_DIR (whole words) -> the page's newest job and its run dir."""
        values = {"JOB": self.job, "RUN_DIR": self.run_dir}

        def value(match: re.Match[str]) -> str:
            found = values[match[0]]
            if found is None:
                raise ExampleFailed(f"{block.where}: {match[0]} is used before the page submitted a job")
            return found

        return re.sub(r"(?<![$\w{])\b(?:JOB|RUN_DIR)\b", value, text)

    def _carry(self, place: str) -> None:
        """What the command left: its working directory, its environment (with what its place hid)."""
        cwd, env = self.state / "cwd", self.state / "env"
        if cwd.is_file() and env.is_file():
            self.cwd = Path(cwd.read_text().strip())
            hidden = {k: v for k, v in self.env.items() if k not in self.env_for(place)}
            pairs = (item.split("=", 1) for item in env.read_text().split("\0") if "=" in item)
            left = {k: v for k, v in pairs if k not in ("PWD", "OLDPWD", "SHLVL", "_")}
            self.env = {**left, **hidden}
        for stale in (cwd, env):
            stale.unlink(missing_ok=True)

    def _note_job(self, printed: str) -> None:
        """The newest job this page started, from meshrun's own lines ('submitted job ID on ...', 'resumed job
        OLD as job ID on ...', 'run dir: ...')."""
        for line in printed.splitlines():
            found = re.match(r"(?:submitted job (?:array )?|resumed job \S+ as job )(\S+) ", line)
            if found:
                self.job = self.env["JOB"] = found[1]
            found = re.match(r"run dir: (\S.*)$", line)
            if found:
                self.run_dir = self.env["RUN_DIR"] = found[1].strip()

    def close(self) -> None:
        """Stop the page's interpreter and every job of the page that still runs, waiting for them to end
        (the ranks save before they stop), then remove the sandbox."""
        if self._python is not None:
            self._python.stop()
        registry = Path(self.xdg["XDG_STATE_HOME"]) / "meshrun"  # no registry, no job to stop
        live = [] if not registry.exists() else [job_id for job_id, done in self._jobs() if not done]
        for job_id in live:
            meshrun(self.home, "cancel", job_id, timeout=120, env=self.xdg)
        deadline = time.monotonic() + 60
        while live and time.monotonic() < deadline and not all(done for _, done in self._jobs()):
            time.sleep(1)
        shutil.rmtree(self.root, ignore_errors=True)

    def _jobs(self) -> list[tuple[str, bool]]:
        """(job id, whether it has ended) of every job the page's user submitted."""
        out = meshrun(self.home, "status", "--json", "--limit", "1000", timeout=120, env=self.xdg)
        try:
            return [(row["job_id"], bool(row.get("done"))) for row in json.loads(out.stdout or "[]")]
        except (json.JSONDecodeError, KeyError, TypeError):
            return []


def _arg(block: Block, directive: str, default: str) -> str:
    marker = block.marker(directive)
    return marker.arg if marker is not None else default


def _copy_checkout(dest: Path) -> None:
    """The checkout's files (those git does not ignore) in `dest`, itself a fresh git work tree: examples
    that write files write them there, and the local cluster runs jobs in it as in a user's project."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        source = REPO / rel
        if source.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)
    subprocess.run(["git", "init", "-q", str(dest)], check=True)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _first(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) < 100 else line[:97] + "..."


def _tail(text: str, lines: int = 40) -> str:
    kept = text.rstrip("\n").splitlines()
    return "\n".join((["..."] if len(kept) > lines else []) + kept[-lines:])


def _indent(text: str) -> str:
    return textwrap.indent(text, "    ")
