"""The Redis side of the fleet tier: one client whose every operation ends by one deadline (the
connect timeout plus the command timeout, for the connect and every read and write together),
receives at most a byte bound, and whose every failure, malformed replies included, becomes a
`RemoteFault` for the tier to log and go on from. The only module that imports redis (the
optional extra `jitattn[redis]`).
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time

from jitattn.errors import RemoteCacheError

_CHUNK = 1 << 20  # a value is read in GETRANGE chunks of this many bytes
_REPLY_SLACK = 64 * 1024  # room for the protocol around the bytes an operation may receive

# Compare-and-renew / compare-and-delete of a lock: only the holder's token may touch it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Replace a value only if it still begins with the bytes we saw (and refused): a refused value
# under our key (corrupt, foreign, unsigned) does not block a good one forever.
_REPLACE = """
local head = redis.call('getrange', KEYS[1], 0, tonumber(ARGV[1]) - 1)
if head ~= ARGV[2] then return 0 end
if tonumber(ARGV[4]) > 0 then redis.call('set', KEYS[1], ARGV[3], 'EX', ARGV[4])
else redis.call('set', KEYS[1], ARGV[3]) end
return 1
"""


class RemoteFault(Exception):
    """A command that did not complete: server down, slow, restarted, full, a reply that is not
    what the command returns, or a value of the wrong type. `down`: the server cannot be reached
    or misbehaves at the protocol level (the tier stops asking for a while)."""

    def __init__(self, op: str, exc: BaseException, down: bool):
        self.op, self.exc, self.down = op, exc, down
        super().__init__(f"{op}: {type(exc).__name__}: {exc}")


class Oversized(RemoteFault):
    """A value longer than the bound on what may be received (whatever STRLEN said)."""


class Malformed(Exception):
    """A reply of the wrong shape (a string where a count belongs, an integer for a set)."""


class _Budget(threading.local):
    """This thread's bounds for the remote operation under way: when it must end (monotonic
    seconds) and how many more bytes it may receive. None: no operation (one command's bounds)."""

    deadline: float | None = None
    bytes_left: int = 0


_budget = _Budget()


class DeadlinePassed(socket.timeout):
    """The operation's deadline passed (redis-py reports it as a TimeoutError)."""


class TooManyBytes(OSError):
    """The operation received more bytes than it may (redis-py reports a ConnectionError)."""


class _BoundedSocket:
    """A socket whose every read and write is cut to the time the current operation has left,
    and whose reads count against the operation's byte bound. redis-py reads through it."""

    def __init__(self, sock):
        self._sock = sock
        self._timeout = sock.gettimeout()

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def settimeout(self, value):
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self):
        return self._timeout

    def _arm(self) -> None:
        deadline = _budget.deadline
        if deadline is None:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlinePassed("the remote operation ran past its deadline")
        self._sock.settimeout(left if self._timeout is None else min(self._timeout, left))

    def _count(self, n: int) -> None:
        if _budget.deadline is None:
            return
        _budget.bytes_left -= n
        if _budget.bytes_left < 0:
            raise TooManyBytes("the server sent more bytes than the operation may receive")

    def recv(self, size, *flags):
        self._arm()
        try:
            data = self._sock.recv(size, *flags)
        finally:
            self._restore()
        self._count(len(data))
        return data

    def recv_into(self, buffer, nbytes=0, *flags):
        self._arm()
        try:
            n = self._sock.recv_into(buffer, nbytes, *flags)
        finally:
            self._restore()
        self._count(n)
        return n

    def sendall(self, data, *flags):
        self._arm()
        try:
            return self._sock.sendall(data, *flags)
        finally:
            self._restore()

    def _restore(self) -> None:
        if _budget.deadline is not None:
            try:
                self._sock.settimeout(self._timeout)
            except OSError:
                pass


def _bounded_connection(base):
    """A redis-py connection class whose socket is a _BoundedSocket and whose connect waits no
    longer than the operation has left."""

    class Bounded(base):
        def _connect(self):
            saved = self.socket_connect_timeout
            if _budget.deadline is not None:
                left = _budget.deadline - time.monotonic()
                if left <= 0:
                    raise DeadlinePassed("the remote operation ran past its deadline")
                self.socket_connect_timeout = left if saved is None else min(saved, left)
            try:
                return _BoundedSocket(super()._connect())
            finally:
                self.socket_connect_timeout = saved

    Bounded.__name__ = f"Bounded{base.__name__}"
    return Bounded


class RedisStore:
    """The fleet's Redis server. Every public method is one remote operation: it ends by its
    deadline (connect + every read and write), receives at most its byte bound, and any failure
    at all (client error, timeout, malformed reply) is a RemoteFault."""

    def __init__(self, url: str, connect_timeout: float, timeout: float, max_bytes: int = 64 * 2**20):
        try:
            import redis
            import redis.connection
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise RemoteCacheError(
                "JITATTN_REMOTE_CACHE is set but the redis client is not installed: "
                "pip install 'jitattn[redis]' (or unset JITATTN_REMOTE_CACHE)") from None
        if not url.startswith(("redis://", "rediss://")):
            raise RemoteCacheError(f"JITATTN_REMOTE_CACHE must be redis://[:password@]host:port/db or "
                                   f"rediss://..., got {url.split('://')[0]}://...")
        self._errors = redis.exceptions
        self.connect_timeout, self.timeout, self.max_bytes = connect_timeout, timeout, max_bytes
        base = redis.connection.SSLConnection if url.startswith("rediss://") else redis.connection.Connection
        try:
            # One retry, on connection errors only: a server that restarted leaves a pooled
            # connection that fails once. Timeouts are never retried. RESP2: no HELLO handshake.
            self._client = redis.Redis.from_url(
                url, socket_connect_timeout=connect_timeout, socket_timeout=timeout, protocol=2,
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
                retry_on_timeout=False, health_check_interval=0, connection_class=_bounded_connection(base))
        except (ValueError, TypeError) as exc:
            raise RemoteCacheError(f"JITATTN_REMOTE_CACHE is not a valid Redis URL: {exc}") from None
        self._renew = self._client.register_script(_RENEW)
        self._release = self._client.register_script(_RELEASE)
        self._replace = self._client.register_script(_REPLACE)

    @contextlib.contextmanager
    def operation(self, op: str, max_bytes: int | None = None):
        """Bound everything inside to one deadline (connect timeout + command timeout from now)
        and `max_bytes` received (default: JITATTN_REMOTE_CACHE_MAX_MB plus room for replies).
        Nested operations keep the outer, tighter bounds."""
        if _budget.deadline is not None:
            yield
            return
        _budget.deadline = time.monotonic() + self.connect_timeout + self.timeout
        _budget.bytes_left = (self.max_bytes if max_bytes is None else max_bytes) + _REPLY_SLACK
        try:
            yield
        except RemoteFault:
            raise
        except Exception as exc:  # anything a misbehaving server makes the client raise
            raise self._fault(op, exc) from None
        finally:
            _budget.deadline = None

    def _fault(self, op: str, exc: BaseException) -> RemoteFault:
        errors = self._errors
        if isinstance(exc, errors.RedisError) and not isinstance(
                exc, (errors.ConnectionError, errors.TimeoutError)) and not isinstance(exc, errors.InvalidResponse):
            return RemoteFault(op, exc, down=False)  # OOM (full server), WRONGTYPE, READONLY, NOSCRIPT ...
        if isinstance(exc, RecursionError):
            exc = Malformed("reply nested too deep")
        try:  # a connection left mid-reply must not serve the next command
            self._client.connection_pool.disconnect()
        except Exception:
            pass
        return RemoteFault(op, exc, down=True)

    def _run(self, op: str, fn, *args, **kwargs):
        with self.operation(op):
            try:
                return fn(*args, **kwargs)
            except RemoteFault:
                raise
            except Exception as exc:
                raise self._fault(op, exc) from None

    # ------------------------------------------------------------------ values

    def size(self, name: str) -> int | None:
        """Bytes of the string value at `name`: 0 if absent, None if it is not a string."""
        errors = self._errors
        try:
            return _integer(self._run("STRLEN", self._client.strlen, name), "STRLEN")
        except RemoteFault as fault:
            if isinstance(fault.exc, errors.ResponseError) and "WRONGTYPE" in str(fault.exc):
                return None
            raise

    def kind(self, name: str) -> str:
        value = self._run("TYPE", self._client.type, name)
        if not isinstance(value, (bytes, str)):
            raise RemoteFault("TYPE", Malformed(f"TYPE answered {type(value).__name__}"), down=True)
        return value.decode(errors="replace") if isinstance(value, bytes) else value

    def get(self, name: str, limit: int | None = None) -> bytes | None:
        """The value at `name` (None if absent), read in GETRANGE chunks so that no more than
        `limit` bytes (default JITATTN_REMOTE_CACHE_MAX_MB) are ever received, whatever STRLEN
        said; a longer value is a RemoteFault."""
        limit = self.max_bytes if limit is None else limit
        with self.operation("GET", limit):
            if not self._run("EXISTS", self._client.exists, name):
                return None
            parts, received = [], 0
            while True:
                want = min(_CHUNK, limit + 1 - received)
                chunk = _bytes(self._run("GETRANGE", self._client.getrange, name, received, received + want - 1),
                               "GETRANGE")
                if len(chunk) > want:
                    raise RemoteFault("GETRANGE", Malformed(f"{len(chunk)} bytes for a range of {want}"), down=True)
                parts.append(chunk)
                received += len(chunk)
                if received > limit:
                    raise Oversized("GET", Malformed(f"value longer than the bound of {limit} bytes"), down=False)
                if len(chunk) < want:
                    return b"".join(parts)

    def head(self, name: str, n: int) -> bytes:
        """The first `n` bytes of a value (b"" if absent)."""
        with self.operation("GETRANGE", n):
            head = _bytes(self._run("GETRANGE", self._client.getrange, name, 0, n - 1), "GETRANGE")
        if len(head) > n:
            raise RemoteFault("GETRANGE", Malformed(f"{len(head)} bytes for a range of {n}"), down=True)
        return head

    def put_new(self, name: str, value: bytes, ttl: int) -> bool:
        """SET NX (first writer wins); False if a value is there already."""
        return bool(self._run("SET NX", self._client.set, name, value, nx=True, ex=ttl or None))

    def replace_if_head(self, name: str, head: bytes, value: bytes, ttl: int) -> bool:
        return bool(self._run("EVALSHA replace", self._replace, keys=[name], args=[len(head), head, value, ttl]))

    def add_member(self, name: str, member: str, ttl: int) -> None:
        pipe = self._client.pipeline(transaction=False)
        pipe.sadd(name, member)
        if ttl:
            pipe.expire(name, ttl)
        self._run("SADD", pipe.execute)

    def delete(self, name: str) -> None:
        self._run("DEL", self._client.delete, name)

    def remove_members(self, name: str, members: list[str]) -> int:
        return _integer(self._run("SREM", self._client.srem, name, *members), "SREM") if members else 0

    def members(self, name: str, limit: int = 4096) -> list[str]:
        """The members of a set, sorted; at most `limit` (a longer set is a RemoteFault)."""
        with self.operation("SMEMBERS", limit * 80):
            count = _integer(self._run("SCARD", self._client.scard, name), "SCARD")
            if count > limit:
                raise RemoteFault("SMEMBERS", Malformed(f"{count} members, over the bound of {limit}"), down=False)
            found = self._run("SMEMBERS", self._client.smembers, name)
        if not isinstance(found, (set, list)) or not all(isinstance(m, bytes) for m in found):
            raise RemoteFault("SMEMBERS", Malformed(f"SMEMBERS answered {type(found).__name__}"), down=True)
        return sorted(m.decode(errors="replace") for m in found)

    # ------------------------------------------------------------------ locks

    def lock(self, name: str, token: str, ttl_ms: int) -> bool:
        """SET NX PX: a fleet lock always carries a TTL."""
        return bool(self._run("SET NX PX", self._client.set, name, token, nx=True, px=max(1, int(ttl_ms))))

    def holder(self, name: str) -> str | None:
        with self.operation("GET", 4096):
            value = self._run("GET", self._client.get, name)
        if value is not None and not isinstance(value, bytes):
            raise RemoteFault("GET", Malformed(f"GET answered {type(value).__name__}"), down=True)
        return value.decode(errors="replace") if value is not None else None

    def ttl_ms(self, name: str) -> int:
        """PTTL: milliseconds left, -1 for a key without a TTL, -2 for no key."""
        return _integer(self._run("PTTL", self._client.pttl, name), "PTTL")

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        return bool(self._run("EVALSHA renew", self._renew, keys=[name], args=[token, ttl_ms]))

    def release(self, name: str, token: str) -> bool:
        return bool(self._run("EVALSHA release", self._release, keys=[name], args=[token]))

    # ------------------------------------------------------------------ doctor

    def server_version(self) -> str:
        info = self._run("INFO", self._client.info, "server")
        if not isinstance(info, dict):
            raise RemoteFault("INFO", Malformed(f"INFO answered {type(info).__name__}"), down=True)
        return str(info.get("redis_version", "?"))

    def scan(self, pattern: str, limit: int) -> tuple[list[str], bool]:
        """Up to `limit` key names matching `pattern`; (names, whether there were more)."""
        names: list[str] = []
        cursor = 0
        while True:
            reply = self._run("SCAN", self._client.scan, cursor, match=pattern, count=1000)
            if (not isinstance(reply, (tuple, list)) or len(reply) != 2 or not isinstance(reply[1], list)
                    or not all(isinstance(b, bytes) for b in reply[1])):
                raise RemoteFault("SCAN", Malformed(f"SCAN answered {type(reply).__name__}"), down=True)
            cursor, batch = _integer(reply[0], "SCAN"), reply[1]
            names += [b.decode(errors="replace") for b in batch]
            if len(names) >= limit:
                return sorted(names)[:limit], True
            if cursor == 0:
                return sorted(names), False

    def heads(self, names: list[str], n: int) -> list[bytes]:
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, n - 1)
        with self.operation("GETRANGE", n * len(names)):
            found = self._run("GETRANGE", pipe.execute)
        if not isinstance(found, list) or not all(isinstance(h, bytes) and len(h) <= n for h in found):
            raise RemoteFault("GETRANGE", Malformed("a pipeline of GETRANGE answered something else"), down=True)
        return found


def _integer(value, op: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RemoteFault(op, Malformed(f"{op} answered {type(value).__name__}, not an integer"), down=True)
    return value


def _bytes(value, op: str) -> bytes:
    if not isinstance(value, bytes):
        raise RemoteFault(op, Malformed(f"{op} answered {type(value).__name__}, not a string"), down=True)
    return value
