"""A fake Redis server for protocol faults: it speaks RESP on a localhost port and answers each
command as a test's `reply(command) -> bytes | callable` says, so a test can send what a real
server never would (a string for STRLEN, an integer for SMEMBERS, a reply trickled one byte at
a time, a bulk string far longer than asked for). A callable reply is given the socket and
writes what it likes; the server counts the bytes it managed to send.
"""
from __future__ import annotations

import socket
import threading


def default_reply(command: list[bytes]) -> bytes:
    """+OK to everything (HELLO, CLIENT SETINFO, SET ...), +PONG to PING."""
    return b"+PONG\r\n" if command[:1] == [b"PING"] else b"+OK\r\n"


class FakeRedis:
    def __init__(self, reply=default_reply):
        self.reply = reply
        self.commands: list[list[bytes]] = []
        self.sent = 0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def names(self) -> list[bytes]:
        return [c[0].upper() for c in self.commands if c]

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                command = _read_command(stream)
                if command is None:
                    return
                self.commands.append(command)
                answer = self.reply([command[0].upper(), *command[1:]])
                if callable(answer):
                    answer(self, conn)
                else:
                    conn.sendall(answer)
                    self.sent += len(answer)
        except OSError:
            return
        finally:
            conn.close()

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _read_command(stream) -> list[bytes] | None:
    line = stream.readline()
    if not line:
        return None
    if not line.startswith(b"*"):
        return line.strip().split()
    args = []
    for _ in range(int(line[1:])):
        size = int(stream.readline()[1:])
        args.append(stream.read(size + 2)[:-2])
    return args


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)
