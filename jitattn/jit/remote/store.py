"""The Redis side of the fleet tier: one client whose every command is bounded by the connect
and command timeouts, and whose every failure becomes a `RemoteFault` for the tier to log and
go on from. The only module that imports redis (the optional extra `jitattn[redis]`).
"""
from __future__ import annotations

from jitattn.errors import RemoteCacheError

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
    """A command that did not complete: server down, slow, restarted, full, or a value of the
    wrong type. `down`: the server cannot be reached at all (the tier stops asking for a while)."""

    def __init__(self, op: str, exc: BaseException, down: bool):
        self.op, self.exc, self.down = op, exc, down
        super().__init__(f"{op}: {type(exc).__name__}: {exc}")


class RedisStore:
    def __init__(self, url: str, connect_timeout: float, timeout: float):
        try:
            import redis
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
        try:
            # One retry, on connection errors only: a server that restarted leaves a pooled
            # connection that fails once. Timeouts are never retried, so a slow server costs
            # at most one command timeout.
            self._client = redis.Redis.from_url(
                url, socket_connect_timeout=connect_timeout, socket_timeout=timeout,
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
                retry_on_timeout=False, health_check_interval=0)
        except ValueError as exc:
            raise RemoteCacheError(f"JITATTN_REMOTE_CACHE is not a valid Redis URL: {exc}") from None
        self._renew = self._client.register_script(_RENEW)
        self._release = self._client.register_script(_RELEASE)
        self._replace = self._client.register_script(_REPLACE)

    def _run(self, op: str, fn, *args, **kwargs):
        errors = self._errors
        try:
            return fn(*args, **kwargs)
        except (errors.ConnectionError, errors.TimeoutError, OSError) as exc:
            raise RemoteFault(op, exc, down=True) from None
        except errors.RedisError as exc:  # OOM (full server), WRONGTYPE, READONLY, NOSCRIPT ...
            raise RemoteFault(op, exc, down=False) from None

    # ------------------------------------------------------------------ values

    def size(self, name: str) -> int | None:
        """Bytes of the string value at `name`: 0 if absent, None if it is not a string."""
        errors = self._errors
        try:
            return self._run("STRLEN", self._client.strlen, name)
        except RemoteFault as fault:
            if isinstance(fault.exc, errors.ResponseError) and "WRONGTYPE" in str(fault.exc):
                return None
            raise

    def kind(self, name: str) -> str:
        value = self._run("TYPE", self._client.type, name)
        return value.decode() if isinstance(value, bytes) else str(value)

    def get(self, name: str) -> bytes | None:
        return self._run("GET", self._client.get, name)

    def head(self, name: str, n: int) -> bytes:
        """The first `n` bytes of a value (b"" if absent)."""
        return self._run("GETRANGE", self._client.getrange, name, 0, n - 1)

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

    def members(self, name: str) -> list[str]:
        return sorted(m.decode(errors="replace") for m in self._run("SMEMBERS", self._client.smembers, name))

    # ------------------------------------------------------------------ locks

    def lock(self, name: str, token: str, ttl_ms: int) -> bool:
        return bool(self._run("SET NX PX", self._client.set, name, token, nx=True, px=ttl_ms))

    def holder(self, name: str) -> str | None:
        value = self._run("GET", self._client.get, name)
        return value.decode(errors="replace") if value is not None else None

    def renew(self, name: str, token: str, ttl_ms: int) -> bool:
        return bool(self._run("EVALSHA renew", self._renew, keys=[name], args=[token, ttl_ms]))

    def release(self, name: str, token: str) -> bool:
        return bool(self._run("EVALSHA release", self._release, keys=[name], args=[token]))

    # ------------------------------------------------------------------ doctor

    def server_version(self) -> str:
        info = self._run("INFO", self._client.info, "server")
        return str(info.get("redis_version", "?"))

    def scan(self, pattern: str, limit: int) -> tuple[list[str], bool]:
        """Up to `limit` key names matching `pattern`; (names, whether there were more)."""
        names: list[str] = []
        cursor = 0
        while True:
            cursor, batch = self._run("SCAN", self._client.scan, cursor, match=pattern, count=1000)
            names += [b.decode(errors="replace") for b in batch]
            if len(names) >= limit:
                return sorted(names)[:limit], True
            if cursor == 0:
                return sorted(names), False

    def heads(self, names: list[str], n: int) -> list[bytes]:
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.getrange(name, 0, n - 1)
        return self._run("GETRANGE", pipe.execute)
