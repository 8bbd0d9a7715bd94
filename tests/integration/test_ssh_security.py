"""Security of the SSH road, against the real sshd: a code snapshot is verified before it is reused (and,
when someone changed it, left to the jobs that use it while the code goes to a fresh folder), meshrun's folders are private, OpenSSH's marker lines in
known_hosts are understood, jump hosts are trusted hop by hop, refused host keys are distinguishable."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from meshrun.launcher.contract.spec.job import Code
from meshrun.submit import errors
from meshrun.submit.config.cluster import Ssh
from meshrun.submit.transport import snapshot, trust
from meshrun.submit.transport.ssh import STATS, SshTransport
from tests.helpers import sshbed
from tests.helpers.sshbed import meshrun
from tests.testbed import testbed as tb

PROBE = sshbed.command_spec("probe", ["true"])


def _fingerprint(pub: Path) -> str:
    return subprocess.run(["ssh-keygen", "-lf", str(pub)], capture_output=True, text=True, check=True).stdout.split()[1]


def _key_line(pub: Path) -> str:
    return " ".join(pub.read_text().split()[:2])


def _new_key(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return Path(f"{path}.pub")


def _ssh(known_hosts: Path, **kw: object) -> Ssh:
    info = tb.ssh_info()
    base = {"host": info["host"], "port": info["port"], "user": info["user"], "identity_file": info["identity_file"]}
    return Ssh(**{**base, **kw}, known_hosts=str(known_hosts))  # type: ignore[arg-type]


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("meshrun: error: "), done.stderr
    return done.stderr


# ------------------------------------------------------------------ code snapshots and private folders


def _project(tmp_path: Path) -> Path:
    return sshbed.project(tmp_path, {"probe.yaml": PROBE, "mypkg/__init__.py": f"NONCE = {time.time_ns()}\n"})


def test_a_changed_snapshot_is_never_reused_and_folders_are_private(testbed: dict, tmp_path: Path) -> None:
    """Anyone who could write into a digest's folder must not get their files run: the probe verifies
    the sealed manifest (contents, modes, no extra file, owner, permissions) in its one round trip. The
    changed folder is never replaced (jobs may run from it): the code goes to the next free name."""
    root, work = _project(tmp_path), tmp_path / "work"
    snap = snapshot.collect(root, Code())
    transport = SshTransport(_ssh(Path(tb.ssh_info()["known_hosts"])), "sshbed")
    try:
        before = STATS.round_trips
        home, found = snapshot.probe(transport, str(work), snap)
        assert STATS.round_trips - before == 1 and home == os.path.expanduser("~")
        assert found == snapshot.Found(name=snap.digest, present=False)
        for folder in (work, work / "runs", work / "code"):  # created by meshrun: private
            assert folder.stat().st_mode & 0o777 == 0o700, folder
        assert snapshot.sync(transport, snap, snapshot.remote_dir(str(work), snap), present=False) is True
        assert snapshot.probe(transport, str(work), snap)[1] == snapshot.Found(name=snap.digest, present=True)

        def tampered(change: Callable[[Path], object], why: str) -> None:
            """The probe refuses the changed folder, says why, and names the next; that one is uploaded."""
            now = snapshot.probe(transport, str(work), snap)[1]
            assert now is not None
            target = Path(snapshot.remote_dir(str(work), snap, now.name))
            change(target)
            found = snapshot.probe(transport, str(work), snap)[1]
            assert found is not None and not found.present and found.name != now.name
            assert found.changed[-1] == (now.name, why.format(target=target))
            assert snapshot.sync(transport, snap, snapshot.remote_dir(str(work), snap, found.name)) is True
            again = snapshot.probe(transport, str(work), snap)[1]
            assert again is not None and again.present and target.exists()  # the changed one is left as it is

        tampered(lambda t: (t / "sitecustomize.py").write_text("import os\n"), "extra sitecustomize.py")
        tampered(lambda t: (t / "mypkg" / "__init__.py").write_text("NONCE = 0\n"), "content mypkg/__init__.py")
        tampered(lambda t: (t / "mypkg" / "__init__.py").chmod(0o755), "modes")
        tampered(lambda t: t.chmod(0o770), "private {target}")  # group-writable: anyone in the group could plant
        tampered(lambda t: (t / snapshot.MANIFEST).write_text(""), "seal")
        tampered(lambda t: os.symlink("/etc/passwd", t / "mypkg" / "link.py"), "private mypkg/link.py")
        assert not [p for p in work.joinpath("code").iterdir() if p.name.startswith(".")]  # nothing left behind
        (work / "code").chmod(0o777)  # anyone could swap snapshots under us: refuse, naming the fix
        with pytest.raises(errors.ClusterError, match=rf"{work}/code .*writable by others.*chmod 700"):
            snapshot.probe(transport, str(work), snap)
    finally:
        transport.close()


def test_resubmit_after_planting_uploads_a_fresh_snapshot(testbed: dict, tmp_path: Path) -> None:
    """The whole road: `code: unchanged` only for a snapshot that verifies; the planted folder is left as
    it is (a job may run from it; a batch script refuses to start from it) and never chosen again."""
    root = _project(tmp_path)
    profile = sshbed.profile(tmp_path, "sec")
    spec = str(root / "probe.yaml")
    first = meshrun(tmp_path, "submit", spec, "-c", str(profile), check=True)
    code_dir = Path(next(l.split(": ", 1)[1] for l in first.stdout.splitlines() if l.startswith("code: ")))
    (code_dir / "mypkg" / "evil.py").write_text("raise SystemExit('planted')\n")
    second = meshrun(tmp_path, "submit", spec, "-c", str(profile), check=True)
    assert "code: unchanged" not in second.stderr, second.stderr
    assert "it holds mypkg/evil.py, which was never uploaded" in second.stderr
    assert f"code: {code_dir}-1" in second.stdout.splitlines()
    third = meshrun(tmp_path, "submit", spec, "-c", str(profile), check=True)
    assert "code: unchanged" in third.stderr and f"code: {code_dir}-1" in third.stdout.splitlines()


# ------------------------------------------------------------------ known_hosts marker lines


def test_cert_authority_and_revoked_lines_do_not_crash_and_revoked_keys_are_refused(
    testbed: dict, tmp_path: Path
) -> None:
    host_pub, known = Path(f"{tb.SSH_HOST_KEY}.pub"), tmp_path / "known_hosts"
    plain = Path(tb.ssh_info()["known_hosts"]).read_text()
    ca = _key_line(_new_key(tmp_path / "ca"))
    known.write_text(f"@cert-authority *.example.org,[127.0.0.1]:* {ca}\n{plain}")
    profile = sshbed.profile(tmp_path, known_hosts=str(known))
    trusted = meshrun(tmp_path, "trust", str(profile), check=True)
    assert "already trusted" in trusted.stdout
    SshTransport(_ssh(known), "sshbed").close()  # every verb's connection reads the same file
    known.write_text(f"@revoked * {_key_line(host_pub)}\n{plain}")  # revoked, though a plain line lists it
    error = _one_line_error(meshrun(tmp_path, "trust", str(profile), "--fingerprint", _fingerprint(host_pub)))
    assert "@revoked" in error and _fingerprint(host_pub) in error and "nothing was sent" in error
    with pytest.raises(errors.HostKeyRevoked):
        SshTransport(_ssh(known), "sshbed")
    assert known.read_text().startswith("@revoked")  # trust recorded nothing


# ------------------------------------------------------------------ jump hosts


@pytest.fixture
def bastion(testbed: dict, tmp_path: Path) -> Iterator[dict[str, object]]:
    """A second sshd, with a host key of its own, to jump through to the testbed's login node."""
    folder = tmp_path / "bastion"
    folder.mkdir()
    host_pub = _new_key(folder / "host_key")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    lines = [
        l
        for l in (tb.ETC / "sshd_config").read_text().splitlines()
        if not l.startswith(("Port ", "HostKey ", "PidFile "))
    ]
    config = folder / "sshd_config"
    config.write_text(
        "\n".join([f"Port {port}", f"HostKey {folder / 'host_key'}", f"PidFile {folder / 'sshd.pid'}", *lines]) + "\n"
    )
    server = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", str(config), "-E", str(folder / "sshd.log")])
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                if conn.recv(4).startswith(b"SSH-"):
                    break
        except OSError:
            pass
        assert time.monotonic() < deadline and server.poll() is None, (folder / "sshd.log").read_text()
        time.sleep(0.05)
    info = tb.ssh_info()
    (tmp_path / ".ssh").mkdir(exist_ok=True)
    ssh_config = tmp_path / ".ssh" / "config"
    ssh_config.write_text(
        f"Host bastion\n  HostName 127.0.0.1\n  Port {port}\n  User {info['user']}\n"
        f"  IdentityFile {info['identity_file']}\n  IdentitiesOnly yes\n"
    )
    try:
        yield {"port": port, "pub": host_pub, "fingerprint": _fingerprint(host_pub), "config": ssh_config}
    finally:
        server.terminate()
        server.wait(10)


def _through(known: Path) -> Ssh:
    return _ssh(known, proxy_jump="bastion")


def test_trust_fingerprints_cover_every_hop(bastion: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHRUN_SSH_CONFIG", str(bastion["config"]))
    known, said = tmp_path / "kh", []
    target_fp = _fingerprint(Path(f"{tb.SSH_HOST_KEY}.pub"))

    def no_prompt(question: str) -> str:
        raise AssertionError(f"prompted: {question}")

    with pytest.raises(errors.ClusterError, match=rf"\[127.0.0.1\]:{bastion['port']} presents .*--fingerprint"):
        trust.trust(_through(known), "c", [target_fp], ask=no_prompt, say=said.append)
    assert not known.exists()  # nothing recorded: not even the hop that matched
    trust.trust(_through(known), "c", [target_fp, bastion["fingerprint"]], ask=no_prompt, say=said.append)
    names = sorted(line.split()[0] for line in known.read_text().splitlines())
    assert names == sorted([f"[127.0.0.1]:{bastion['port']}", f"[127.0.0.1]:{tb.PORTS['sshd']}"])
    SshTransport(_through(known), "c").close()  # both hops now verify


def test_replace_works_for_a_changed_bastion_key(
    bastion: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHRUN_SSH_CONFIG", str(bastion["config"]))
    known = tmp_path / "kh"
    other = _key_line(_new_key(tmp_path / "other"))
    plain = Path(tb.ssh_info()["known_hosts"]).read_text()
    known.write_text(f"[127.0.0.1]:{bastion['port']} {other}\n{plain}")
    profile = sshbed.profile(tmp_path, proxy_jump="bastion", known_hosts=str(known))
    env = {"MESHRUN_SSH_CONFIG": str(bastion["config"])}
    error = _one_line_error(meshrun(tmp_path, "trust", str(profile), env=env))
    assert "CHANGED" in error and "--replace" in error and bastion["fingerprint"] in error
    with pytest.raises(errors.HostKeyChanged, match="man-in-the-middle"):
        SshTransport(_through(known), "c")
    wrong = meshrun(tmp_path, "trust", str(profile), "--replace", "--fingerprint", "SHA256:" + "A" * 43, env=env)
    assert wrong.returncode == 1 and "nothing recorded" in wrong.stderr and other in known.read_text()
    done = meshrun(
        tmp_path, "trust", str(profile), "--replace", "--fingerprint", bastion["fingerprint"], env=env, check=True
    )
    assert f"recorded [127.0.0.1]:{bastion['port']}" in done.stdout and other not in known.read_text()
    assert plain in known.read_text()  # the login node's line is untouched
    SshTransport(_through(known), "c").close()


def test_remote_home_is_the_real_one_in_one_round_trip(testbed: dict) -> None:
    """What `doctor` needs for `~` over SSH (the cluster user's home is not always /home/USER)."""
    transport = SshTransport(_ssh(Path(tb.ssh_info()["known_hosts"])), "sshbed")
    try:
        before = STATS.round_trips
        assert snapshot.remote_home(transport) == os.path.expanduser("~")
        assert STATS.round_trips - before == 1
    finally:
        transport.close()
