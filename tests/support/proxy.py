"""A TCP proxy a test can hold, cut and restore, in front of a service other tests share."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from tests.conftest import free_port


class Proxy:
    """A TCP proxy to Postgres that a test can hold (a silent server), cut and restore."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = free_port()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._open = True
        self._holding = False
        self._lose_reply_to: bytes | None = None
        self._losing: set[socket.socket] = set()  # upstreams whose replies go nowhere
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_reply_to(self, marker: bytes) -> None:
        """Pass the next message holding ``marker`` (a prepared statement's name) on to
        the server, then end its connection without its reply: the statement ran and
        committed, and its sender cannot know."""
        self._lose_reply_to = marker

    def restore(self) -> None:
        self._open = True
        self._holding = False

    def hold(self) -> None:
        """Pass nothing on, in either direction, until cut: a server gone silent."""
        self._holding = True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open:  # down: the connection is refused
                client.close()
                continue
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self._holding and self._open:
                    time.sleep(0.01)
                if src in self._losing:
                    break  # a reply that is lost
                dst.sendall(data)
                marker = self._lose_reply_to
                if marker is not None and marker in data:
                    self._lose_reply_to = None
                    self._losing.add(dst)
                    time.sleep(0.3)  # the server runs and commits it meanwhile
                    break
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self._open = False
        self._break_all()

    def drop(self) -> None:
        """Break the connections there are, refusing no new one (a blip): unlike a cut
        and a restore, a client that connects again at once is never refused."""
        self._break_all()
        self.restore()

    def _break_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.cut()
        self._listener.close()
