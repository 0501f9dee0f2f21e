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
//! [`idempotency_core::store::Record::validate`]. Anything else at the key (another type, another
//! encoding, a truncated string) is refused before anything is written.
//!
//! # Arguments and replies
//!
//! What Redis spends on a script call beyond the commands it runs is mostly per argument and
//! per reply element (each becomes a Lua string or a reply node), so each script takes its
//! numbers packed into one string (big-endian unsigned 64-bit integers, after the
//! fingerprint where there is one) and answers with one string: a kind byte, then its fields.
//!
//! | reply | kind | then |
//! |---|---|---|
//! | claimed a new or expired key | `c` | token, lease deadline |
//! | the record | `r` | the server's time, the record |
//! | the record, hit counted | `h` | the server's time, the new hit count, the record |
//! | no live record | `n` | |
//! | written | `a` | |
//! | fenced | `f` | |
//! | reclaimed | `R` | token, lease deadline |
//! | not reclaimed | `l` | |
//! | the key holds no well-formed record | `x` | the reason, as text |
//!
//! The load and its checks are written out at the top of each script rather than called as a
//! function: no closure is built per call, and a corrupt record returns from the script at
//! once.

/// Reads the clock and the record, and refuses anything but a well-formed record; prepended
/// to every script. Leaves `v` false when the key is absent, else the record's bytes in `v`
/// and its fields in the locals below.
///
/// Every number the scripts store or compare stays below 2^53, so Lua's doubles hold it
/// exactly: tokens derive from the clock in microseconds, durations are capped by the client.
const PRELUDE: &str = r#"
local key = KEYS[1]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local HEADER = '>c4BBI8I4I8I8I8I8I8c32I4'
local EXACT = 9007199254740992
local v = redis.pcall('GET', key)
local tag, st, fl, tok, att, hits, lease, ca, ua, exp, fp, fml
if v then
  if type(v) == 'table' then
    return 'xthe key holds a ' .. redis.call('TYPE', key)['ok'] .. ', not a record'
  end
  if #v < 94 then
    return 'xthe value is not a record of encoding idk1'
  end
  tag, st, fl, tok, att, hits, lease, ca, ua, exp, fp, fml = struct.unpack(HEADER, v)
  if tag ~= 'idk1' then
    return 'xthe value is not a record of encoding idk1'
  end
  if not ((st == 1 and fl % 2 == 1) or (st == 2 and fl >= 8) or (st == 3 and fl % 4 >= 2))
      or fl > 15 then
    return 'xstatus ' .. st .. ' with flags ' .. fl .. ' is not a record state'
  end
  if tok < 1 or att < 1 then
    return 'xa token or attempt count of 0'
  end
  if tok >= EXACT or hits >= EXACT or lease >= EXACT or ca >= EXACT or ua >= EXACT
      or exp >= EXACT then
    return 'xa token, count or time at or above 2^53'
  end
  if 94 + fml > #v then
    return 'xthe failure message runs past the end of the record'
  end
  -- Bytes only where the flags say: a message only with a failure (retryable only then
  -- too), outcome bytes only with an outcome.
  if (fl % 4 < 2 and (fml > 0 or fl % 8 >= 4)) or (fl < 8 and #v > 94 + fml) then
    return 'xflags ' .. fl .. ' do not match the failure and outcome bytes'
  end
end
"#;

/// Writes the whole record, with its physical expiry; for the scripts that write.
const SAVE: &str = r#"
local function save(st, fl, tok, att, hits, lease, ca, exp, fp, fm, out, retention)
  local rec = struct.pack(HEADER, 'idk1', st, fl, tok, att, hits, lease, ca, now, exp, fp, #fm)
  redis.call('SET', key, rec .. fm .. out, 'PXAT', string.format('%d', exp + retention))
end
"#;

/// ARGV[1]: fingerprint (32 bytes), lease ms, ttl ms, retention ms, then one byte: count the
/// hit (1) or not (0).
const CLAIM: &str = r#"
local a = ARGV[1]
if not v or exp <= now then
  -- Absent or expired: a new Pending record, with a token from the server clock in
  -- microseconds, above the token of an expired record Redis has not evicted yet.
  local afp, lease_ms, ttl, retention = struct.unpack('>c32I8I8I8', a)
  local ntok = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
  if v then
    ntok = math.max(ntok, tok + 1)
  end
  local lease_until = now + lease_ms
  save(1, 1, ntok, 1, 0, lease_until, now, now + math.max(lease_ms, ttl), afp, '', '',
    retention)
  return struct.pack('>c1I8I8', 'c', ntok, lease_until)
end
if string.byte(a, 57) == 0 then
  return 'r' .. struct.pack('>I8', now) .. v
end
redis.call('SETRANGE', key, 18, struct.pack('>I8', hits + 1))
return 'h' .. struct.pack('>I8I8', now, hits + 1) .. v
"#;

/// The CAS shared by complete, fail and extend: live, Pending, holding the token that starts
/// ARGV[1].
const CAS_PENDING: &str = r#"
if not v or exp <= now or st ~= 1 or tok ~= struct.unpack('>I8', ARGV[1]) then
  return 'f'
end
"#;

/// ARGV[1]: token, ttl ms, retention ms; ARGV[2]: the outcome.
const COMPLETE: &str = r#"
local _, ttl, retention = struct.unpack('>I8I8I8', ARGV[1])
save(2, 8, tok, att, hits, 0, ca, now + ttl, fp, '', ARGV[2], retention)
return 'a'
"#;

/// ARGV[1]: token, ttl ms, retention ms, then one byte: retryable (1) or not (0); ARGV[2]:
/// the message.
const FAIL: &str = r#"
local _, ttl, retention, retryable = struct.unpack('>I8I8I8B', ARGV[1])
local nfl = 2
if retryable == 1 then
  nfl = 6
end
save(3, nfl, tok, att, hits, 0, ca, now + ttl, fp, ARGV[2], '', retention)
return 'a'
"#;

/// ARGV[1]: token, lease ms, retention ms.
const EXTEND: &str = r#"
local _, lease_ms, retention = struct.unpack('>I8I8I8', ARGV[1])
local lease_until = now + lease_ms
local nfl = fl
if nfl % 2 == 0 then
  nfl = nfl + 1
end
save(1, nfl, tok, att, hits, lease_until, ca, math.max(exp, lease_until), fp,
  string.sub(v, 95, 94 + fml), string.sub(v, 95 + fml), retention)
return 'a'
"#;

/// ARGV[1]: fingerprint (32 bytes), expected token, lease ms, ttl ms, retention ms.
const RECLAIM: &str = r#"
local afp, expected, lease_ms, ttl, retention = struct.unpack('>c32I8I8I8I8', ARGV[1])
if not v or exp <= now or tok ~= expected then
  return 'l'
end
local leased = fl % 2 == 1
-- A permanent failure (flag 4 clear) is final for the request that failed: only another
-- fingerprint takes it over.
local takeable_failure = st == 3 and (math.floor(fl / 4) % 2 == 1 or fp ~= afp)
if not (takeable_failure or (st == 1 and (not leased or lease <= now))) then
  return 'l'
end
local ntok = tok + 1
local lease_until = now + lease_ms
save(1, 1, ntok, math.min(att + 1, 4294967295), hits, lease_until, ca,
  now + math.max(lease_ms, ttl), afp, '', '', retention)
return struct.pack('>c1I8I8', 'R', ntok, lease_until)
"#;

/// No ARGV. Reads without counting a hit.
const GET: &str = r#"
if not v or exp <= now then
  return 'n'
end
return 'r' .. struct.pack('>I8', now) .. v
"#;

/// The full source of each script.
pub(crate) fn claim() -> String {
    [PRELUDE, SAVE, CLAIM].concat()
}

pub(crate) fn complete() -> String {
    [PRELUDE, CAS_PENDING, SAVE, COMPLETE].concat()
}

pub(crate) fn fail() -> String {
    [PRELUDE, CAS_PENDING, SAVE, FAIL].concat()
}

pub(crate) fn extend() -> String {
    [PRELUDE, CAS_PENDING, SAVE, EXTEND].concat()
}

pub(crate) fn reclaim() -> String {
    [PRELUDE, SAVE, RECLAIM].concat()
}

pub(crate) fn get() -> String {
    [PRELUDE, GET].concat()
}
