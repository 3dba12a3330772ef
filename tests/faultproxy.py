"""A TCP proxy that can cut a service off: a database outage for one API process,
without touching the Postgres every other test shares."""

from __future__ import annotations

import contextlib
import socket
import threading


class FaultProxy:
    """Forward 127.0.0.1:<port> to ``upstream``. ``down()`` drops every open connection
    and refuses new ones (accepted and closed at once, as a database that is restarting
    does); ``hang()`` stops forwarding but keeps every connection open, so queries wait
    (a network partition); ``up()`` forwards again."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._down = threading.Event()
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="faultproxy", daemon=True).start()

    def down(self) -> None:
        self._down.set()
        with self._lock:
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._open.clear()

    def hang(self) -> None:
        self._flowing.clear()

    def up(self) -> None:
        self._down.clear()
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self.down()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._down.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._open.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                for s in (src, dst):
                    self._open.discard(s)
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
                    s.close()
