"""A local port forwarded to a port on the cluster, like `ssh -L`, over an open connection.

Listens on 127.0.0.1 only (never on other interfaces: the forwarded service has no
authentication of its own). Each accepted connection gets its own channel,
opened by the caller's function, and a thread that copies bytes both ways.
"""

from __future__ import annotations

import select
import socket
import threading
from typing import Any, Callable

from meshrun.submit.errors import ClusterError

OpenChannel = Callable[[tuple[str, int]], Any]
"""peer address -> a socket-like channel to the remote port (send, recv, close, fileno)."""


class PortForward:
    """127.0.0.1:local_port -> the remote port; close() stops listening and drops every connection."""

    def __init__(self, open_channel: OpenChannel, local_port: int = 0) -> None:
        self._open = open_channel
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._server.bind(("127.0.0.1", local_port))
            self._server.listen(16)
        except (OSError, OverflowError) as exc:  # in use, privileged, or not a port number at all
            self._server.close()
            reason = getattr(exc, "strerror", None) or str(exc)
            raise ClusterError(
                f"cannot listen on 127.0.0.1:{local_port} ({reason}); give --port a free port "
                f"in 1024-65535, or 0 for any free one"
            ) from None
        self.local_port: int = self._server.getsockname()[1]
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open_pairs: list[tuple[socket.socket, Any]] = []
        threading.Thread(target=self._accept, daemon=True, name="meshrun-forward").start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, peer = self._server.accept()
            except OSError:
                return  # closed
            try:
                channel = self._open(peer)
            except Exception:
                client.close()  # the remote side refused; the browser sees a reset
                continue
            with self._lock:
                self._open_pairs.append((client, channel))
            threading.Thread(target=self._pump, args=(client, channel), daemon=True).start()

    def _pump(self, client: socket.socket, channel: Any) -> None:
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select([client, channel], [], [], 1.0)
                if client in ready:
                    data = client.recv(32768)
                    if not data:
                        break
                    channel.sendall(data)
                if channel in ready:
                    data = channel.recv(32768)
                    if not data:
                        break
                    client.sendall(data)
        except (OSError, EOFError):
            pass
        finally:
            self._drop(client, channel)

    def _drop(self, client: socket.socket, channel: Any) -> None:
        with self._lock:
            if (client, channel) in self._open_pairs:
                self._open_pairs.remove((client, channel))
        for end in (channel, client):
            try:
                end.close()
            except Exception:
                pass

    def close(self) -> None:
        self._closed.set()
        self._server.close()
        with self._lock:
            pairs = list(self._open_pairs)
        for client, channel in pairs:
            self._drop(client, channel)
