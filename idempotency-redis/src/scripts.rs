//! The Lua scripts, one per store operation.
//!
//! Every script touches exactly one key (`KEYS[1]`, the record), so it runs on one cluster
//! node, and each one reads the server clock with `TIME` (allowed in scripts under effects
//! replication, the default since Redis 5). Every script that writes the record sets its
//! physical expiry (`PEXPIREAT expires_at + retention`) in the same script, so no record ever
//! exists without a TTL.
//!
//! Field layout of a record hash (all numbers are decimal strings, times in Unix milliseconds):
//!
//! | field | meaning |
//! |---|---|
//! | `fp` | fingerprint, 64 hex digits |
//! | `st` | `pending`, `completed` or `failed` |
//! | `tok` | fencing token |
//! | `lease` | lease deadline (absent once completed or failed) |
//! | `out` | stored outcome bytes (absent unless completed) |
//! | `att` | attempts |
//! | `fr`, `fm` | failure: `1`/`0` retryable and message (absent unless a failure was recorded) |
//! | `hits` | observations by later claims |
//! | `ca`, `ua`, `exp` | created, updated, logical expiry |
//!
//! Replies are arrays whose first element says what happened: `claimed`, `record`, `none`,
//! `applied`, `fenced`, `reclaimed`, `lost`, or `corrupt` followed by a reason. A `corrupt`
//! reply is sent before anything was written: foreign or damaged data is never modified.

/// Shared helpers, prepended to every script.
///
/// Numbers are limited to 15 decimal digits (tokens to 16 digits below 2^53) so that Lua's
/// doubles hold them exactly; they are formatted with `%d` because `tostring` would switch to
/// exponent notation.
const PRELUDE: &str = r#"
local key = KEYS[1]
local clock = redis.call('TIME')
local function now_ms()
  return tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
-- The server clock in microseconds: the least token a fresh record gets, so that a key whose
-- record was evicted, expired away or lost with the dataset never reuses a token.
local function now_us()
  return tonumber(clock[1]) * 1000000 + tonumber(clock[2])
end
-- A fencing token: at most 16 digits and below 2^53 (exact in a double); nil otherwise, and a
-- token that cannot be stored is held by no record.
local function token(v)
  if type(v) ~= 'string' or #v == 0 or #v > 16 or not string.find(v, '^%d+$') then
    return nil
  end
  local n = tonumber(v)
  if n >= 9007199254740992 then
    return nil
  end
  return n
end
local function int(n)
  return string.format('%d', n)
end
local function uint(v)
  if type(v) ~= 'string' or #v == 0 or #v > 15 or not string.find(v, '^%d+$') then
    return nil
  end
  return tonumber(v)
end
-- Returns nil when the key is absent, false and a reason when it holds something that is not
-- a well-formed record, or the record.
local function load_record()
  local ty = redis.call('TYPE', key)['ok']
  if ty == 'none' then
    return nil
  end
  if ty ~= 'hash' then
    return false, 'the key holds a ' .. ty .. ', not a hash'
  end
  local flat = redis.call('HGETALL', key)
  local f = {}
  for i = 1, #flat, 2 do
    f[flat[i]] = flat[i + 1]
  end
  local r = { flat = flat, raw = f }
  r.tok = token(f['tok'])
  if r.tok == nil then
    return false, 'field tok is missing or not a non-negative integer below 2^53'
  end
  for _, name in ipairs({ 'att', 'hits', 'ca', 'ua', 'exp' }) do
    if f[name] == nil then
      return false, 'missing field ' .. name
    end
    r[name] = uint(f[name])
    if r[name] == nil then
      return false, 'field ' .. name .. ' is not a non-negative integer of at most 15 digits'
    end
  end
  if r.att > 4294967295 then
    return false, 'field att does not fit 32 bits'
  end
  if f['lease'] ~= nil then
    r.lease = uint(f['lease'])
    if r.lease == nil then
      return false, 'field lease is not a non-negative integer of at most 15 digits'
    end
  end
  local st = f['st']
  if st ~= 'pending' and st ~= 'completed' and st ~= 'failed' then
    return false, 'field st is missing or not pending, completed or failed'
  end
  r.st = st
  local fp = f['fp']
  if fp == nil or #fp ~= 64 or not string.find(fp, '^%x+$') then
    return false, 'field fp is missing or not 64 hex digits'
  end
  if f['fr'] ~= nil and f['fr'] ~= '0' and f['fr'] ~= '1' then
    return false, 'field fr is not 0 or 1'
  end
  return r
end
local function keep_until(exp, retention)
  redis.call('PEXPIREAT', key, int(exp + retention))
end
"#;

/// ARGV: fingerprint hex, lease ms, ttl ms, retention ms, count hit (`1`/`0`).
const CLAIM: &str = r#"
local fp, lease, ttl, retention = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local r, err = load_record()
if r == false then
  return { 'corrupt', err }
end
if r == nil or r.exp <= now then
  -- Absent or expired: a new Pending record, with a token from the server clock, above the
  -- token of an expired record Redis has not evicted yet.
  local tok = now_us()
  if r then
    tok = math.max(tok, r.tok + 1)
    redis.call('DEL', key)
  end
  local lease_until = now + lease
  local exp = now + math.max(lease, ttl)
  redis.call('HSET', key, 'fp', fp, 'st', 'pending', 'tok', int(tok), 'lease', int(lease_until),
    'att', '1', 'hits', '0', 'ca', int(now), 'ua', int(now), 'exp', int(exp))
  keep_until(exp, retention)
  return { 'claimed', int(tok), int(lease_until), int(now) }
end
if ARGV[5] == '0' then
  return { 'record', int(now), r.flat }
end
local hits = redis.call('HINCRBY', key, 'hits', 1)
for i = 1, #r.flat, 2 do
  if r.flat[i] == 'hits' then
    r.flat[i + 1] = int(hits)
  end
end
keep_until(r.exp, retention)
return { 'record', int(now), r.flat }
"#;

/// The CAS shared by complete, fail and extend: live, Pending, holding ARGV[1].
const CAS_PENDING: &str = r#"
local now = now_ms()
local r, err = load_record()
if r == false then
  return { 'corrupt', err }
end
if r == nil or r.exp <= now or r.st ~= 'pending' or r.tok ~= token(ARGV[1]) then
  return { 'fenced' }
end
"#;

/// ARGV: token, outcome bytes, ttl ms, retention ms.
const COMPLETE: &str = r#"
local ttl, retention = tonumber(ARGV[3]), tonumber(ARGV[4])
local exp = now + ttl
redis.call('HDEL', key, 'lease', 'fr', 'fm')
redis.call('HSET', key, 'st', 'completed', 'out', ARGV[2], 'ua', int(now), 'exp', int(exp))
keep_until(exp, retention)
return { 'applied' }
"#;

/// ARGV: token, retryable (`0`/`1`), message, ttl ms, retention ms.
const FAIL: &str = r#"
local ttl, retention = tonumber(ARGV[4]), tonumber(ARGV[5])
local exp = now + ttl
redis.call('HDEL', key, 'lease')
redis.call('HSET', key, 'st', 'failed', 'fr', ARGV[2], 'fm', ARGV[3], 'ua', int(now), 'exp', int(exp))
keep_until(exp, retention)
return { 'applied' }
"#;

/// ARGV: token, lease ms, retention ms.
const EXTEND: &str = r#"
local lease, retention = tonumber(ARGV[2]), tonumber(ARGV[3])
local lease_until = now + lease
local exp = math.max(r.exp, lease_until)
redis.call('HSET', key, 'lease', int(lease_until), 'ua', int(now), 'exp', int(exp))
keep_until(exp, retention)
return { 'applied' }
"#;

/// ARGV: expected token, fingerprint hex, lease ms, ttl ms, retention ms.
const RECLAIM: &str = r#"
local fp, lease, ttl, retention = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local r, err = load_record()
if r == false then
  return { 'corrupt', err }
end
if r == nil or r.exp <= now or r.tok ~= token(ARGV[1]) then
  return { 'lost' }
end
local takeable = r.st == 'failed' or (r.st == 'pending' and (r.lease == nil or r.lease <= now))
if not takeable then
  return { 'lost' }
end
local tok = r.tok + 1
local lease_until = now + lease
local exp = now + math.max(lease, ttl)
redis.call('HDEL', key, 'out', 'fr', 'fm')
redis.call('HSET', key, 'st', 'pending', 'tok', int(tok), 'fp', fp, 'att', int(r.att + 1),
  'lease', int(lease_until), 'ua', int(now), 'exp', int(exp))
keep_until(exp, retention)
return { 'reclaimed', int(tok), int(lease_until) }
"#;

/// No ARGV. Reads without counting a hit.
const GET: &str = r#"
local now = now_ms()
local r, err = load_record()
if r == false then
  return { 'corrupt', err }
end
if r == nil or r.exp <= now then
  return { 'none' }
end
return { 'record', int(now), r.flat }
"#;

/// The full source of each script.
pub(crate) fn claim() -> String {
    [PRELUDE, CLAIM].concat()
}

pub(crate) fn complete() -> String {
    [PRELUDE, CAS_PENDING, COMPLETE].concat()
}

pub(crate) fn fail() -> String {
    [PRELUDE, CAS_PENDING, FAIL].concat()
}

pub(crate) fn extend() -> String {
    [PRELUDE, CAS_PENDING, EXTEND].concat()
}

pub(crate) fn reclaim() -> String {
    [PRELUDE, RECLAIM].concat()
}

pub(crate) fn get() -> String {
    [PRELUDE, GET].concat()
}
