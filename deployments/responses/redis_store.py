"""The fleet backend: a Redis or Valkey server every replica reaches (redis-py asyncio).

One hash per record (``<prefix>:r:<owner>:<id>``: response, messages, status,
created) and one sorted set ``<prefix>:idx`` of every record by creation time, for
the bounds. Each write is one Lua script (atomic on the server): the conditional
"a stored cancel wins", the index, the key's expiry (``max_age_s``) and eviction
oldest first beyond ``max_count``. Socket and connect timeouts are the store's
deadline, so no call waits longer; a dead server is a ``StoreError`` at once.
"""

from __future__ import annotations

import math
from typing import Any

from deployments.responses.store import Record, StoreError, now

# KEYS: record, index. ARGV: field, value, status|'', keep_cancelled, now, max_age,
# max_count, member, prefix. Returns 0 when a stored cancel won.
_PUT = """
if ARGV[4] == '1' and redis.call('HGET', KEYS[1], 'status') == 'cancelled' then
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'created', ARGV[5])
  redis.call('ZADD', KEYS[2], ARGV[5], ARGV[8])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'status', ARGV[3]) end
redis.call('EXPIRE', KEYS[1], ARGV[6])
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[5]) - tonumber(ARGV[6]))
local extra = redis.call('ZCARD', KEYS[2]) - #old - tonumber(ARGV[7])
if extra > 0 then
  for _, m in ipairs(redis.call('ZRANGE', KEYS[2], #old, #old + extra - 1)) do
    table.insert(old, m)
  end
end
for _, m in ipairs(old) do
  redis.call('DEL', ARGV[9] .. ':r:' .. m)
  redis.call('ZREM', KEYS[2], m)
end
return 1
"""


class RedisStore:
    """``store.ResponsesStore`` on a Redis/Valkey server."""

    kind = "redis"

    def __init__(self, url: str, password: str | None, prefix: str, max_age_s: float,
                 max_count: int, timeout_s: float) -> None:
        import redis.asyncio as aioredis

        self.prefix, self.max_age_s, self.max_count = prefix, max_age_s, max_count
        self.timeout_s = timeout_s
        self._client = aioredis.Redis.from_url(
            url, password=password, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry_on_timeout=False,
            health_check_interval=30, decode_responses=True)
        self._put = self._client.register_script(_PUT)

    def _key(self, owner: str, response_id: str) -> str:
        return f"{self.prefix}:r:{owner}:{response_id}"

    async def _call(self, what: str, coro: Any) -> Any:
        import asyncio

        import redis.exceptions

        try:
            return await asyncio.wait_for(coro, self.timeout_s * 2)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise StoreError(f"the Redis Responses store did not {what} within "
                             f"{self.timeout_s}s (responses.timeout_s)") from exc
        except redis.exceptions.RedisError as exc:
            raise StoreError(f"the Redis Responses store could not {what}: "
                             f"{type(exc).__name__}") from exc
        except OSError as exc:
            raise StoreError(f"the Redis Responses store could not {what}: "
                             f"{type(exc).__name__}") from exc

    async def get(self, owner: str, response_id: str) -> Record | None:
        row = await self._call("read", self._client.hgetall(self._key(owner, response_id)))
        if not row or "created" not in row:
            return None
        created = float(row["created"])
        if created < now() - self.max_age_s:
            return None
        return Record(row.get("response"), row.get("messages"), row.get("status"), created)

    async def _write(self, owner: str, response_id: str, field: str, value: str,
                     status: str, keep_cancelled: bool) -> bool:
        args = [field, value, status, "1" if keep_cancelled else "0", repr(now()),
                max(1, math.ceil(self.max_age_s)), self.max_count,
                f"{owner}:{response_id}", self.prefix]
        done = await self._call("write", self._put(
            keys=[self._key(owner, response_id), f"{self.prefix}:idx"], args=args))
        return bool(done)

    async def put_response(self, owner: str, response_id: str, response: str,
                           status: str, keep_cancelled: bool = False) -> bool:
        return await self._write(owner, response_id, "response", response, status,
                                 keep_cancelled)

    async def put_messages(self, owner: str, response_id: str, messages: str) -> None:
        await self._write(owner, response_id, "messages", messages, "", False)

    async def statuses(self, keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
        if not keys:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for owner, response_id in keys:
            pipe.hget(self._key(owner, response_id), "status")
        found = await self._call("read", pipe.execute())
        return {key: status for key, status in zip(keys, found, strict=True) if status}

    async def size(self) -> int:
        return int(await self._call("count", self._client.zcard(f"{self.prefix}:idx")))

    async def close(self) -> None:
        await self._client.aclose()
