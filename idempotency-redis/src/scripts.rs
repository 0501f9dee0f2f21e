//! The Lua scripts, one per store operation.
//!
//! Every script touches exactly one key (`KEYS[1]`, the record), so it runs on one cluster
//! node, and each one reads the server clock with `TIME` (allowed in scripts under effects
//! replication, the default since Redis 5). Every script that writes the record writes it
//! whole with its physical expiry (`SET … PXAT expires_at + retention`), so no record ever
//! exists without a TTL; counting a hit overwrites the eight bytes of the count in place
//! (`SETRANGE`, which keeps the TTL).
//!
//! # Encoding, version 1
//!
//! A record is one string: a fixed 94-byte header, then the failure message, then the
//! outcome. Numbers are big-endian unsigned integers; times are Unix milliseconds.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | `idk1`, the encoding and its version |
//! | 4 | 1 | status: 1 pending, 2 completed, 3 failed |
//! | 5 | 1 | flags: 1 has a lease, 2 has a failure, 4 the failure is retryable, 8 has an outcome |
//! | 6 | 8 | fencing token |
//! | 14 | 4 | attempts |
//! | 18 | 8 | hits |
//! | 26 | 8 | lease deadline (0 without a lease) |
//! | 34 | 8 | created |
//! | 42 | 8 | updated |
//! | 50 | 8 | logical expiry |
//! | 58 | 32 | fingerprint (SHA-256) |
//! | 90 | 4 | length of the failure message |
//! | 94 | … | failure message, then the outcome (the rest) |
//!
//! A script checks the tag, the length and the status once, with one `struct.unpack`, rather
//! than a pattern per field; the client decodes the same bytes and checks every rule of
//! [`idempotency_core::Record::validate`]. Anything else at the key (another type, another
//! encoding, a truncated string) is refused before anything is written.
//!
//! Replies are arrays whose first element says what happened: `claimed`, `record`, `none`,
//! `applied`, `fenced`, `reclaimed`, `lost`, or `corrupt` followed by a reason. Numbers in
//! replies are integers.

/// Shared helpers, prepended to every script.
///
/// Every number the scripts store or compare stays below 2^53, so Lua's doubles hold it
/// exactly: tokens derive from the clock in microseconds, durations are capped by the client.
const PRELUDE: &str = r#"
local key = KEYS[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local HEADER = '>c4BBI8I4I8I8I8I8I8c32I4'
local TAG = 'idk1'
local EXACT = 9007199254740992
-- nil when the key is absent; false and a reason when it holds anything but a well-formed
-- record; otherwise the record's fields, with its bytes in `v`.
local function load()
  local v = redis.pcall('GET', key)
  if not v then
    return nil
  end
  if type(v) == 'table' then
    return false, 'the key holds a ' .. redis.call('TYPE', key)['ok'] .. ', not a record'
  end
  if #v < 94 or string.sub(v, 1, 4) ~= TAG then
    return false, 'the value is not a record of encoding idk1'
  end
  local _, st, fl, tok, att, hits, lease, ca, ua, exp, fp, fml = struct.unpack(HEADER, v)
  if not ((st == 1 and fl % 2 == 1) or (st == 2 and fl >= 8) or (st == 3 and fl % 4 >= 2))
      or fl > 15 then
    return false, 'status ' .. st .. ' with flags ' .. fl .. ' is not a record state'
  end
  if tok < 1 or att < 1 then
    return false, 'a token or attempt count of 0'
  end
  if tok >= EXACT or hits >= EXACT or lease >= EXACT or ca >= EXACT or ua >= EXACT
      or exp >= EXACT then
    return false, 'a token, count or time at or above 2^53'
  end
  if 94 + fml > #v then
    return false, 'the failure message runs past the end of the record'
  end
  -- Bytes only where the flags say: a message only with a failure (retryable only then
  -- too), outcome bytes only with an outcome.
  if (fl % 4 < 2 and (fml > 0 or fl % 8 >= 4)) or (fl < 8 and #v > 94 + fml) then
    return false, 'flags ' .. fl .. ' do not match the failure and outcome bytes'
  end
  return { v = v, st = st, fl = fl, tok = tok, att = att, hits = hits, lease = lease,
           ca = ca, exp = exp, fp = fp, fml = fml }
end
-- Writes the whole record, with its physical expiry.
local function save(st, fl, tok, att, hits, lease, ca, exp, fp, fm, out, retention)
  local v = struct.pack(HEADER, TAG, st, fl, tok, att, hits, lease, ca, now, exp, fp, #fm)
  redis.call('SET', key, v .. fm .. out, 'PXAT', string.format('%d', exp + retention))
end
"#;

/// ARGV: fingerprint (32 bytes), lease ms, ttl ms, retention ms, count the hit (`1`/`0`).
const CLAIM: &str = r#"
local lease, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local r, err = load()
if r == false then
  return { 'corrupt', err }
end
if r == nil or r.exp <= now then
  -- Absent or expired: a new Pending record, with a token from the server clock in
  -- microseconds, above the token of an expired record Redis has not evicted yet.
  local tok = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  if r then
    tok = math.max(tok, r.tok + 1)
  end
  local lease_until = now + lease
  save(1, 1, tok, 1, 0, lease_until, now, now + math.max(lease, ttl), ARGV[1], '', '',
    tonumber(ARGV[4]))
  return { 'claimed', tok, lease_until }
end
if ARGV[5] == '0' then
  return { 'record', now, r.v }
end
redis.call('SETRANGE', key, 18, struct.pack('>I8', r.hits + 1))
return { 'record', now, r.v, r.hits + 1 }
"#;

/// The CAS shared by complete, fail and extend: live, Pending, holding ARGV[1].
const CAS_PENDING: &str = r#"
local r, err = load()
if r == false then
  return { 'corrupt', err }
end
if r == nil or r.exp <= now or r.st ~= 1 or r.tok ~= tonumber(ARGV[1]) then
  return { 'fenced' }
end
"#;

/// ARGV: token, outcome bytes, ttl ms, retention ms.
const COMPLETE: &str = r#"
save(2, 8, r.tok, r.att, r.hits, 0, r.ca, now + tonumber(ARGV[3]), r.fp, '', ARGV[2],
  tonumber(ARGV[4]))
return { 'applied' }
"#;

/// ARGV: token, retryable (`0`/`1`), message, ttl ms, retention ms.
const FAIL: &str = r#"
local fl = 2
if ARGV[2] == '1' then
  fl = 6
end
save(3, fl, r.tok, r.att, r.hits, 0, r.ca, now + tonumber(ARGV[4]), r.fp, ARGV[3], '',
  tonumber(ARGV[5]))
return { 'applied' }
"#;

/// ARGV: token, lease ms, retention ms.
const EXTEND: &str = r#"
local lease_until = now + tonumber(ARGV[2])
local fl = r.fl
if fl % 2 == 0 then
  fl = fl + 1
end
save(1, fl, r.tok, r.att, r.hits, lease_until, r.ca, math.max(r.exp, lease_until), r.fp,
  string.sub(r.v, 95, 94 + r.fml), string.sub(r.v, 95 + r.fml), tonumber(ARGV[3]))
return { 'applied' }
"#;

/// ARGV: expected token, fingerprint (32 bytes), lease ms, ttl ms, retention ms.
const RECLAIM: &str = r#"
local lease, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local r, err = load()
if r == false then
  return { 'corrupt', err }
end
if r == nil or r.exp <= now or r.tok ~= tonumber(ARGV[1]) then
  return { 'lost' }
end
local leased = r.fl % 2 == 1
if not (r.st == 3 or (r.st == 1 and (not leased or r.lease <= now))) then
  return { 'lost' }
end
local tok = r.tok + 1
local lease_until = now + lease
save(1, 1, tok, math.min(r.att + 1, 4294967295), r.hits, lease_until, r.ca,
  now + math.max(lease, ttl), ARGV[2], '', '', tonumber(ARGV[5]))
return { 'reclaimed', tok, lease_until }
"#;

/// No ARGV. Reads without counting a hit.
const GET: &str = r#"
local r, err = load()
if r == false then
  return { 'corrupt', err }
end
if r == nil or r.exp <= now then
  return { 'none' }
end
return { 'record', now, r.v }
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
