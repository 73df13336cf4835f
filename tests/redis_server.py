"""A real redis-server for tests: started on a free localhost port in a private directory,
stopped (and reaped) at the end; it can be killed, restarted on the same port, paused
(SIGSTOP: it accepts connections but answers nothing, a "slow" server) and resumed.

Tests that claim fleet behaviour talk to this server through the real client; nothing here
mocks Redis. Without redis-server (or the redis client) the tests skip, except under CI=true,
where they fail: CI installs both (.ci/run).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import in_ci


def require_redis() -> str:
    """The redis-server binary; skip (fail under CI=true) without it or without the client."""
    binary = os.environ.get("JITATTN_TEST_REDIS_SERVER") or shutil.which("redis-server")
    problem = None
    if binary is None:
        problem = "redis-server not found (apt-get install redis-server); fleet-tier tests need a real server"
    else:
        try:
            import redis  # noqa: F401
        except ImportError:
            problem = "the redis client is not installed (pip install 'jitattn[redis]')"
    if problem:
        if in_ci():
            pytest.fail(problem)
        pytest.skip(problem)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, binary: str, workdir: Path, *, password: str | None = None, maxmemory: str | None = None,
                 tls: bool = False):
        self.binary, self.workdir = binary, Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.password, self.maxmemory = password, maxmemory
        self.cert = self._make_certificate() if tls else None
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.paused = False

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.cert:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _make_certificate(self) -> Path:
        """A self-signed certificate for 127.0.0.1 (the server's, and the CA a client trusts)."""
        openssl = shutil.which("openssl")
        if openssl is None:
            if in_ci():
                pytest.fail("openssl not found: the TLS test needs it to make a certificate")
            pytest.skip("openssl not found")
        cert, key = self.workdir / "cert.pem", self.workdir / "key.pem"
        subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True, timeout=60)
        return cert

    def start(self, port: int | None = None) -> "RedisServer":
        """Start on `port` (a restart) or on a fresh free port; wait until it answers PING."""
        for attempt in range(5):
            self.port = port or free_port()
            listen = ["--port", str(self.port)]
            if self.cert:
                key = self.cert.with_name("key.pem")
                listen = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.cert),
                          "--tls-key-file", str(key), "--tls-ca-cert-file", str(self.cert), "--tls-auth-clients", "no"]
            args = [self.binary, *listen, "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no",
                    "--daemonize", "no", "--loglevel", "warning"]
            if self.password:
                args += ["--requirepass", self.password]
            if self.maxmemory:
                args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
            log = open(self.workdir / "server.log", "ab")
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            if self._wait_ready(10.0):
                return self
            self.kill()
            if port:  # a restart on the same port: the old one must be gone first
                time.sleep(0.2)
        raise RuntimeError(f"redis-server did not start: {(self.workdir / 'server.log').read_text()[-2000:]}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if self.client().ping():
                    return True
            except Exception:
                time.sleep(0.02)
        return False

    def client(self, **kw):
        import redis

        if self.cert:
            kw.update(ssl=True, ssl_ca_certs=str(self.cert))
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=kw.pop("socket_timeout", 5), **kw)

    def kill(self) -> None:
        """SIGKILL and reap (a crash: nothing saved)."""
        if self.proc is None:
            return
        if self.paused:
            self.resume()
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None

    def restart(self) -> None:
        """Kill and start an empty server on the same port (no persistence: a restart loses all)."""
        port = self.port
        self.kill()
        self.start(port)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.paused:
            self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def connections_received(self) -> int:
        return int(self.client().info("stats")["total_connections_received"])
