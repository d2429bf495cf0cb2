"""Client sessions: a credential handshake and a liveness signal on one plain Unix socket.

A client connects to ``<socket>.session``; the daemon reads the peer's credentials with
SO_PEERCRED (which gRPC does not expose), refuses uids outside the allowlist, and answers one JSON
line with a fresh session: a public ``session_id`` (it appears in handles as the owner) and a secret
``token`` that every gRPC call must carry as metadata. The client keeps the connection open and
never writes again; when its process dies the kernel closes the socket and the daemon reclaims
everything the session held, at once and whatever the state of its gRPC calls.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Callable

_log = logging.getLogger("shmtransport.daemon")

_UCRED = struct.Struct("3i")  # pid, uid, gid
_ACCEPT_BACKOFF_S = 0.05


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    return _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


class SessionServer:
    """Accepts handshakes and watches open sessions on a selector thread."""

    def __init__(
        self,
        path: str,
        allowed_uids: frozenset[int],
        hello: dict,
        on_open: Callable[[str, int, int], None],
        on_close: Callable[[str], None],
        socket_mode: int,
    ):
        self.path = path
        self._allowed_uids = allowed_uids
        self._hello = hello
        self._on_open = on_open
        self._on_close = on_close
        self._tokens: dict[str, str] = {}  # token -> session_id
        self._tokens_lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(path):
            os.unlink(path)
        self._listener.bind(path)
        os.chmod(path, socket_mode)
        self._listener.listen(256)
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="shmt-sessions", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def session_for_token(self, token: str) -> str | None:
        with self._tokens_lock:
            return self._tokens.get(token)

    def live_sessions(self) -> int:
        with self._tokens_lock:
            return len(self._tokens)

    def stop(self) -> None:
        self._stopping = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                self._drop(key.fileobj, key.data)
        self._selector.close()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _loop(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select(timeout=1.0):
                if self._stopping:
                    break
                if key.fileobj is self._listener:
                    self._accept()
                elif key.data is not None:
                    self._drop(key.fileobj, key.data)  # a session socket is readable: EOF or junk
        # leaving the loop: stop() drops the remaining sessions

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # e.g. EMFILE: keep serving the sessions we have, retry shortly
            _log.warning("cannot accept a session (%s); retrying", exc)
            time.sleep(_ACCEPT_BACKOFF_S)
            return
        try:
            pid, uid, _gid = peer_credentials(conn)
            if uid not in self._allowed_uids:
                _log.warning("refused session from pid %d uid %d (not in the allowlist)", pid, uid)
                conn.sendall(b'{"error": "permission_denied", "message": "uid %d is not allowed"}\n' % uid)
                conn.close()
                return
        except OSError as exc:
            _log.info("session handshake failed: %s", exc)
            conn.close()
            return
        # Registered before the reply, so the client's first RPC finds its token; undone if the
        # client is already gone.
        session_id, token = secrets.token_hex(8), secrets.token_hex(16)
        self._on_open(session_id, pid, uid)
        with self._tokens_lock:
            self._tokens[token] = session_id
        try:
            hello = dict(self._hello, session_id=session_id, token=token, pid=pid)
            conn.sendall(json.dumps(hello).encode() + b"\n")
        except OSError as exc:
            _log.info("session handshake with pid %d failed: %s", pid, exc)
            self._drop(conn, (session_id, token))
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ, (session_id, token))

    def _drop(self, conn: socket.socket, data: tuple[str, str]) -> None:
        session_id, token = data
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        with self._tokens_lock:
            self._tokens.pop(token, None)
        self._on_close(session_id)
