"""A key's limits held in Redis, shared by every gateway (gateway/limits.py): one Lua script per
decision, so a check and its update are one atomic step whatever the number of gateways.

Per API key name, three Redis keys (one hash slot: the name in braces, for Redis Cluster):
    pdserve:limits:{name}:bucket   hash {tokens, ts}: the token bucket of its request rate
    pdserve:limits:{name}:holds    sorted set: its requests in flight, scored by when their lease lapses
    pdserve:limits:{name}:tokens   hash: the token budget each of them holds
Time is Redis' own (TIME), so gateways' clocks never disagree. Lapsed holds are dropped by the
next decision for the key. A script's reply {0}: admitted; {1, ...}: refused, with what the 429 needs.
"""
from __future__ import annotations

from typing import Iterable

from gateway.limits import Hold, concurrency_error, rate_error, token_error

_LAPSE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do
  redis.call('ZREM', KEYS[2], m)
  redis.call('HDEL', KEYS[3], m)
end
"""
# KEYS: bucket, holds, tokens; ARGV: hold id, rate (0: none), bucket size, max concurrent (0: none), lease s
ADMIT = _LAPSE + """
local maxc, rate, lease = tonumber(ARGV[4]), tonumber(ARGV[2]), tonumber(ARGV[5])
if maxc > 0 and redis.call('ZCARD', KEYS[2]) >= maxc then return {1, 'concurrency'} end
if rate > 0 then
  local size = tonumber(ARGV[3])
  local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
  local tokens = math.min(size, (tonumber(b[1]) or size) + math.max(0, now - (tonumber(b[2]) or now)) * rate)
  if tokens < 1 then
    redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
    return {1, 'rate', tostring((1 - tokens) / rate)}
  end
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[1], math.ceil(size / rate) + 60)
end
redis.call('ZADD', KEYS[2], tostring(now + lease), ARGV[1])
redis.call('EXPIRE', KEYS[2], math.ceil(lease) + 60)
return {0}
"""
# KEYS: bucket, holds, tokens; ARGV: hold id, tokens, budget, lease s
CHARGE = _LAPSE + """
local held = 0
for _, v in ipairs(redis.call('HVALS', KEYS[3])) do held = held + tonumber(v) end
local want = tonumber(ARGV[2])
if held + want > tonumber(ARGV[3]) then return {1, 'tokens', tostring(held)} end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[3], math.ceil(tonumber(ARGV[4])) + 60)
return {0}
"""
# KEYS: holds, tokens; ARGV: hold id
RELEASE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return {0}
"""
# KEYS: holds; ARGV: lease s, hold ids...
RENEW = """
local t = redis.call('TIME')
local until = tostring(tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1]))
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', until, ARGV[i]) end
return {0}
"""


def _keys(name: str) -> list[str]:
    return [f"pdserve:limits:{{{name}}}:{part}" for part in ("bucket", "holds", "tokens")]


class SharedLimits:
    """The scripts over one `redis.asyncio.Redis` client (its timeouts short: a decision that waits
    falls back to the gateway's own limits; cluster/cli/serve.py `shared_limits` makes it for the
    cluster state's Redis, with its credentials and TLS)."""

    def __init__(self, client):
        self.client = client
        self._admit, self._charge = client.register_script(ADMIT), client.register_script(CHARGE)
        self._release, self._renew = client.register_script(RELEASE), client.register_script(RENEW)

    async def admit(self, hold: Hold, lease_s: float) -> None:
        key = hold.key
        reply = await self._admit(keys=_keys(key.name), args=[
            hold.id, key.requests_per_second or 0, key.bucket_size if key.requests_per_second else 0,
            key.max_concurrent or 0, lease_s])
        if int(reply[0]) == 0:
            return
        if _text(reply[1]) == "concurrency":
            raise concurrency_error(key)
        raise rate_error(key, float(_text(reply[2])))

    async def charge(self, hold: Hold, tokens: int, lease_s: float) -> None:
        key = hold.key
        if tokens > key.token_budget:
            raise token_error(key, tokens, 0)
        reply = await self._charge(keys=_keys(key.name), args=[hold.id, tokens, key.token_budget, lease_s])
        if int(reply[0]) != 0:
            raise token_error(key, tokens, int(float(_text(reply[2]))))

    async def release(self, hold: Hold) -> None:
        await self._release(keys=_keys(hold.key.name)[1:], args=[hold.id])

    async def renew(self, holds: Iterable[Hold], lease_s: float) -> None:
        by_key: dict[str, list[str]] = {}
        for hold in holds:
            by_key.setdefault(hold.key.name, []).append(hold.id)
        for name, ids in by_key.items():
            await self._renew(keys=[_keys(name)[1]], args=[lease_s, *ids])

    async def close(self) -> None:
        await self.client.aclose()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

