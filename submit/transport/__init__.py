"""How meshrun reaches a cluster and ships code there: local and SSH transports, host keys, snapshots."""
