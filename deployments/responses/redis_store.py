"""The fleet backend: a Redis or Valkey server every replica reaches (redis-py asyncio).

A key's (owner's) records live in two keys that share one hash tag, so they sit in one
Redis Cluster slot: ``<prefix>:{<owner>}:data`` (a hash: ``r:<id>`` response,
``m:<id>`` messages, ``s:<id>`` status, ``c:<id>`` created, ``b:<id>`` bytes, ``total``
the key's bytes) and ``<prefix>:{<owner>}:idx`` (a sorted set of ids by creation time).
Each write is one Lua script (atomic on the server, ``#!lua``: refused whole when the
server is at its ``maxmemory``) that touches only the two keys it declares: the
conditional "a stored cancel wins", the record's size against ``max_record_bytes``,
eviction by the server's clock (``TIME``) of the key's records past ``max_age_s``, then
of the key's own oldest beyond its records or bytes, and the keys' expiry. No key's
write touches another key's records, so the fleet holds at most (keys x
``max_bytes_per_key``). Socket and connect timeouts are the store's deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.responses.store import Quota, Record, RecordWrites, StoreError

_DROP = """
local function drop(m)
  local b = tonumber(redis.call('HGET', KEYS[1], 'b:' .. m) or '0')
  redis.call('HDEL', KEYS[1], 'r:' .. m, 'm:' .. m, 's:' .. m, 'c:' .. m, 'b:' .. m)
  redis.call('ZREM', KEYS[2], m)
  redis.call('HINCRBY', KEYS[1], 'total', -b)
  return b
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""
# KEYS: data, idx. ARGV: id, response, has_response, messages, has_messages, status|'',
# keep_cancelled, max_age_s, max_records, max_bytes, max_record_bytes.
# Returns {1} written, {0} a stored cancel won, {-1, size} the record is too large.
_PUT = "#!lua\n" + _DROP + """
local id = ARGV[1]
if ARGV[7] == '1' and redis.call('HGET', KEYS[1], 's:' .. id) == 'cancelled' then
  return {0}
end
local max_age = tonumber(ARGV[8])
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - max_age))) do
  drop(m)
end
local response = ARGV[2]
if ARGV[3] ~= '1' then response = redis.call('HGET', KEYS[1], 'r:' .. id) end
local messages = ARGV[4]
if ARGV[5] ~= '1' then messages = redis.call('HGET', KEYS[1], 'm:' .. id) end
local size = (response and #response or 0) + (messages and #messages or 0)
if size > tonumber(ARGV[11]) then return {-1, size} end
local before = tonumber(redis.call('HGET', KEYS[1], 'b:' .. id) or '0')
if redis.call('HEXISTS', KEYS[1], 'c:' .. id) == 0 then
  redis.call('HSET', KEYS[1], 'c:' .. id, tostring(now))
  redis.call('ZADD', KEYS[2], now, id)
end
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'r:' .. id, response) end
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'm:' .. id, messages) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 's:' .. id, ARGV[6]) end
redis.call('HSET', KEYS[1], 'b:' .. id, size)
local total = redis.call('HINCRBY', KEYS[1], 'total', size - before)
local count = redis.call('ZCARD', KEYS[2])
local max_records, max_bytes = tonumber(ARGV[9]), tonumber(ARGV[10])
local start = 0
while count > max_records or total > max_bytes do
  local batch = redis.call('ZRANGE', KEYS[2], start, start + 63)
  if #batch == 0 then break end
  for _, m in ipairs(batch) do
    if count <= max_records and total <= max_bytes then break end
    if m == id then start = 1 else total = total - drop(m); count = count - 1 end
  end
end
local ttl = math.ceil(max_age * 1000)
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return {1}
"""
# KEYS: data. ARGV: id, max_age_s. Returns {response, messages, status, created} or {}.
_GET = "#!lua flags=no-writes\n" + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local id = ARGV[1]
local row = redis.call('HMGET', KEYS[1], 'r:' .. id, 'm:' .. id, 's:' .. id, 'c:' .. id)
if not row[4] or tonumber(row[4]) < now - tonumber(ARGV[2]) then return {} end
return row
"""


class RedisStore(RecordWrites):
    """``store.ResponsesStore`` on a Redis/Valkey server."""

    kind = "redis"

    def __init__(self, url: str, password: str | None, prefix: str, quota: Quota,
                 timeout_s: float) -> None:
        import redis.asyncio as aioredis

        self.prefix, self.quota, self.timeout_s = prefix, quota, timeout_s
        self._client = aioredis.Redis.from_url(
            url, password=password, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry_on_timeout=False,
            health_check_interval=30, decode_responses=True)
        self._put = self._client.register_script(_PUT)
        self._get = self._client.register_script(_GET)

    def _keys(self, owner: str) -> list[str]:
        """The owner's two keys, one hash tag (one Cluster slot)."""
        return [f"{self.prefix}:{{{owner}}}:data", f"{self.prefix}:{{{owner}}}:idx"]

    async def _call(self, what: str, coro: Any) -> Any:
        import redis.exceptions

        try:
            return await asyncio.wait_for(coro, self.timeout_s * 2)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise StoreError(f"the Redis Responses store did not {what} within "
                             f"{self.timeout_s}s (responses.timeout_s)") from exc
        except redis.exceptions.RedisError as exc:
            if isinstance(exc, redis.exceptions.OutOfMemoryError) or "OOM" in str(exc):
                raise StoreError(f"the Redis Responses store could not {what}: the server "
                                 "is at its memory limit (maxmemory). Fix (operator): raise "
                                 "maxmemory above the number of keys x "
                                 "responses.max_bytes_per_key") from exc
            raise StoreError(f"the Redis Responses store could not {what}: "
                             f"{type(exc).__name__}") from exc
        except OSError as exc:
            raise StoreError(f"the Redis Responses store could not {what}: "
                             f"{type(exc).__name__}") from exc

    async def get(self, owner: str, response_id: str) -> Record | None:
        row = await self._call("read", self._get(
            keys=self._keys(owner)[:1], args=[response_id, self.quota.max_age_s]))
        if not row:
            return None
        return Record(row[0], row[1], row[2], float(row[3]))

    async def put_record(self, owner: str, response_id: str, messages: str | None,
                         response: str | None, status: str | None,
                         keep_cancelled: bool = False) -> bool:
        q = self.quota
        args = [response_id, response or "", "1" if response is not None else "0",
                messages or "", "1" if messages is not None else "0", status or "",
                "1" if keep_cancelled else "0", max(0.001, q.max_age_s),
                q.max_records_per_key, q.max_bytes_per_key, q.max_record_bytes]
        done = await self._call("write", self._put(keys=self._keys(owner), args=args))
        if int(done[0]) < 0:
            raise q.too_large(int(done[1]))
        return bool(int(done[0]))

    async def statuses(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        if not keys:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for owner, response_id in keys:
            pipe.hget(self._keys(owner)[0], f"s:{response_id}")
        found = await self._call("read", pipe.execute())
        return {key: status for key, status in zip(keys, found, strict=True) if status}

    async def size(self) -> int:
        """Records of every key (a SCAN of the index keys: the size metric, every 10 s)."""
        async def count() -> int:
            total = 0
            async for key in self._client.scan_iter(match=f"{self.prefix}:{{*}}:idx",
                                                     count=1000):
                total += int(await self._client.zcard(key))
            return total
        return int(await self._call("count", count()))

    async def close(self) -> None:
        await self._client.aclose()



