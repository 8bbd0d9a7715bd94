#!/bin/sh
# Install the Debian packages the Slurm + sshd testbed needs (tests/testbed/testbed.py).
# Idempotent: when every binary is already present it exits at once without touching apt.
# Needs root (Debian 12; as another user it runs itself through sudo). Usage: sh tests/testbed/install.sh
set -eu

PACKAGES="slurmctld slurmd slurm-client munge mariadb-server slurmdbd openssh-server tmux"
# One binary per thing testbed.py runs; keep in step with testbed.REQUIRED_BINARIES.
BINARIES="slurmctld slurmd slurmdbd sinfo squeue sbatch srun scancel sacct sacctmgr scontrol
munged mungekey mariadbd mariadb-install-db mariadb sshd ssh-keygen mknod tmux"

# sbin is often missing from a non-login PATH; the daemons live there.
PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH"

missing=""
for b in $BINARIES; do
    command -v "$b" >/dev/null 2>&1 || missing="$missing $b"
done
if [ -z "$missing" ]; then
    echo "testbed packages already installed"
    exit 0
fi
echo "missing:$missing; installing: $PACKAGES"

if [ "$(id -u)" -ne 0 ]; then
    # Not root: apt through sudo when there is one (it asks for the password), else say what to do.
    if command -v sudo >/dev/null 2>&1; then
        exec sudo sh "$0" "$@"
    fi
    echo "install.sh installs Debian packages: run it as root (there is no sudo here)" >&2
    exit 1
fi

# Package maintainer scripts would otherwise start system-wide daemons on the default ports;
# the testbed runs its own, by hand. Exit status 101 means "action not allowed".
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update
# Without --no-install-recommends slurm-wlm pulls in ~43 more packages.
# shellcheck disable=SC2086  # word splitting of PACKAGES is intended
apt-get install -y --no-install-recommends $PACKAGES

for b in $BINARIES; do
    command -v "$b" >/dev/null 2>&1 || { echo "still missing after install: $b" >&2; exit 1; }
done
echo "testbed packages installed"
