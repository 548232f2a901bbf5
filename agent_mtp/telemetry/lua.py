"""The Lua script that applies one flush batch atomically, at most once per flush id (Redis 7, no modules).

KEYS[1] flush-id marker, KEYS[2] health hash, KEYS[3] writers set, KEYS[4] recent-interventions list,
KEYS[5] the writer's epoch counter, KEYS[4 + 2i] / KEYS[5 + 2i] series hash / bucket index set of series i (1-based).
ARGV[1] marker TTL, ARGV[2] bucket TTL, ARGV[3] writer id, ARGV[4] intervention list size,
ARGV[5] JSON {"health": {field: "n"}, "notes": ["json", ...],
              "series": [{"m": member, "i": {field: "n"}, "f": {field: "x"}}]},
ARGV[6] steps this writer had acknowledged before this batch (``expected``), ARGV[7] the part of them old enough to
have expired anyway (``floor``), ARGV[8] steps in this batch, ARGV[9] epoch counter TTL.
Numbers travel as strings so Lua never reformats them (Lua 5.1 prints 1e15 as "1e+15": HINCRBY rejects it).

The marker is set first: if a later command failed (a foreign key of the wrong type), a retry is still a
no-op, so a batch is never applied twice.

Loss detection: the epoch counter holds the steps of this writer (one process, one random epoch) that Redis has
applied. Redis that restarts without persistence, from an older snapshot, or after a FLUSHALL holds less than the
writer knows it acknowledged: the difference (above ``floor``) is added to the health counter ``lost_requests``
(and ``lost_data_events`` once), in the same atomic step, and the counter is set right again.

Returns 0 when the flush id was seen before, else {1, steps found lost}.
"""

from __future__ import annotations

FLUSH_SCRIPT = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
local ttl = tonumber(ARGV[2])
local batch = cjson.decode(ARGV[5])
for name, value in pairs(batch.health) do
  redis.call('HINCRBY', KEYS[2], name, value)
end
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('SADD', KEYS[3], ARGV[3])
redis.call('EXPIRE', KEYS[3], ttl)
if #batch.notes > 0 then
  for _, note in ipairs(batch.notes) do
    redis.call('LPUSH', KEYS[4], note)
  end
  redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[4]) - 1)
  redis.call('EXPIRE', KEYS[4], ttl)
end
local stored = tonumber(redis.call('GET', KEYS[5]) or '-1')
local expected, floor = tonumber(ARGV[6]), tonumber(ARGV[7])
local lost = 0
if expected > math.max(stored, floor) then
  lost = expected - math.max(stored, floor)
  redis.call('HINCRBY', KEYS[2], 'lost_requests', lost)
  redis.call('HINCRBY', KEYS[2], 'lost_data_events', 1)
  redis.call('EXPIRE', KEYS[2], ttl)
end
redis.call('SET', KEYS[5], math.max(stored, expected) + tonumber(ARGV[8]), 'EX', ARGV[9])
for i, series in ipairs(batch.series) do
  local hash, index = KEYS[4 + 2 * i], KEYS[5 + 2 * i]
  for name, value in pairs(series.i) do
    redis.call('HINCRBY', hash, name, value)
  end
  for name, value in pairs(series.f) do
    redis.call('HINCRBYFLOAT', hash, name, value)
  end
  redis.call('EXPIRE', hash, ttl)
  redis.call('SADD', index, series.m)
  redis.call('EXPIRE', index, ttl)
end
return {1, lost}
"""
