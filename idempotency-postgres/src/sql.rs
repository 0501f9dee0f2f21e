//! The statements, built once per table name.
//!
//! Every store operation is exactly one of these statements: one round trip, one implicit
//! transaction. They are sent as prepared statements, which sqlx caches per connection.
//!
//! Time: `now` is `statement_timestamp()` truncated to milliseconds (the unit of
//! [`idempotency_core::store::Timestamp`]), evaluated once per statement. It is the database's clock,
//! so app servers with skewed clocks agree; unlike `now()` it is not frozen at the start of a
//! caller's transaction, which matters for [`crate::PostgresStore::complete_in`]. `now_us` is
//! the same instant in whole microseconds since the Unix epoch, untruncated: the clock part of
//! a fresh record's fencing token.

use crate::TableName;

/// `(extract(epoch from col) * 1000)::int8`: a timestamptz as Unix milliseconds.
fn ms(col: &str) -> String {
    format!("(extract(epoch from {col}) * 1000)::int8")
}

/// The record's columns as the decoder reads them, from a row aliased `r`.
fn record_columns() -> String {
    [
        "r.fingerprint".to_owned(),
        "r.status".to_owned(),
        "r.token".to_owned(),
        format!("{} AS lease_until_ms", ms("r.lease_until")),
        "r.outcome".to_owned(),
        "r.attempts".to_owned(),
        "r.failure_retryable".to_owned(),
        "r.failure_message".to_owned(),
        "r.hits".to_owned(),
        format!("{} AS created_ms", ms("r.created_at")),
        format!("{} AS updated_ms", ms("r.updated_at")),
        format!("{} AS expires_ms", ms("r.expires_at")),
    ]
    .join(", ")
}

const NOW_CTE: &str =
    "WITH c AS (SELECT date_trunc('milliseconds', statement_timestamp()) AS now, \
                      (extract(epoch from statement_timestamp()) * 1000000)::int8 AS now_us)";

/// The statements of one store.
#[derive(Debug)]
pub(crate) struct Statements {
    pub claim: String,
    pub observe: String,
    pub complete: String,
    pub complete_locked: String,
    pub fail: String,
    pub extend: String,
    pub reclaim: String,
    pub get: String,
    pub purge: String,
    pub hold: String,
    /// `claim` over arrays, for a batch of distinct keys: parameters are arrays of scope,
    /// key, fingerprint, lease (ms) and retention (ms); each row also names its key
    /// (`b_scope`, `b_key`).
    pub claim_batch: String,
    /// `observe` over arrays, likewise.
    pub observe_batch: String,
    /// `complete` and `fail` over arrays, for a batch of distinct keys: scope, key, token,
    /// whether it completes, outcome, retryable, message, retention (ms); returns the keys it
    /// settled.
    pub settle_batch: String,
    /// The recovery point's advance inside the caller's transaction: $4 name, $5 phase,
    /// $6 origin, $7 state, $8 the phase it moves from (NULL: none); returns the token.
    pub advance: String,
    /// The recovery point of the live record, if it belongs to it.
    pub point: String,
    /// Up to $1 live operations whose holder is gone.
    pub abandoned: String,
}

impl Statements {
    pub(crate) fn new(name: &TableName) -> Self {
        let t = name.qualified();
        let cols = record_columns();
        // Claim-or-observe. One INSERT … ON CONFLICT DO UPDATE:
        // - no row: inserts a Pending record whose token is the clock, `now_us`;
        // - an expired row (expires_at <= now): replaces every field, token
        //   greatest(token + 1, now_us), hits 0;
        // - a live row: only hits + 1 (every other column is set to itself).
        // Fencing tokens grow over the key's whole history, not only over one row's life. Once
        // a purge has deleted the row nothing remembers its token, but that token was the
        // clock (µs) at the row's claim plus one per reclaim since, each reclaim a write of its
        // own taking far more than a microsecond; and a fresh claim reads the same clock later
        // (the row had to expire first, at least a millisecond after its last write). So the
        // stalled holder of a purged record is fenced from the new one. Only a database clock
        // stepping back past the purged row's claim could reuse a token; while a row exists,
        // greatest(token + 1, …) keeps tokens growing whatever the clock does.
        // A claim leaves hits = 0 and created_at = now, an observation adds one to hits, which
        // tells the decoder which happened.
        //
        // Hit accounting without a WAL flush per replay: when the statement only counted a hit,
        // `set_config('synchronous_commit', 'off', true)` makes its implicit transaction commit
        // asynchronously. The increment is visible at once; a server crash may lose the last
        // few hundred milliseconds of hit counts, never a claim (a claim keeps the session's
        // synchronous_commit). The store's statements always run in their own implicit
        // transaction, so the setting never reaches a caller's transaction.
        let expired = "r.expires_at <= excluded.created_at";
        // The upsert itself, `guard` limiting when it inserts at all.
        // `v` names the values (scope, key, fingerprint, lease ms, retention ms) and `from`
        // where they come from; `returning`, extra columns to return.
        let upsert = |v: [&str; 5], from: &str, guard: &str, returning: &str| {
            let [scope, key, fingerprint, lease, hold] = v;
            format!(
                "INSERT INTO {t} AS r (scope, key, fingerprint, status, token, lease_until, outcome,
                          attempts, failure_retryable, failure_message, hits,
                          created_at, updated_at, expires_at)
    SELECT {scope}, {key}, {fingerprint}, 'pending', greatest(1, c.now_us),
           c.now + {lease} * interval '1 millisecond', NULL, 1, NULL, NULL, 0,
           c.now, c.now, c.now + {hold} * interval '1 millisecond'
    FROM {from} {guard}
    ON CONFLICT (scope, key) DO UPDATE SET
        fingerprint = CASE WHEN {expired} THEN excluded.fingerprint ELSE r.fingerprint END,
        status = CASE WHEN {expired} THEN excluded.status ELSE r.status END,
        token = CASE WHEN {expired} THEN greatest(r.token + 1, excluded.token) ELSE r.token END,
        lease_until = CASE WHEN {expired} THEN excluded.lease_until ELSE r.lease_until END,
        outcome = CASE WHEN {expired} THEN NULL ELSE r.outcome END,
        attempts = CASE WHEN {expired} THEN 1 ELSE r.attempts END,
        failure_retryable = CASE WHEN {expired} THEN NULL ELSE r.failure_retryable END,
        failure_message = CASE WHEN {expired} THEN NULL ELSE r.failure_message END,
        hits = CASE WHEN {expired} THEN 0 ELSE r.hits + 1 END,
        created_at = CASE WHEN {expired} THEN excluded.created_at ELSE r.created_at END,
        updated_at = CASE WHEN {expired} THEN excluded.updated_at ELSE r.updated_at END,
        expires_at = CASE WHEN {expired} THEN excluded.expires_at ELSE r.expires_at END
    RETURNING {cols}{returning}"
            )
        };
        let single = ["$1", "$2", "$3", "$4", "$5"];
        let now_ms = ms("c.now");
        let written = format!(
            "SELECT up.*, {now_ms} AS now_ms, true AS written,
       set_config('synchronous_commit',
                  CASE WHEN up.hits = 0 THEN current_setting('synchronous_commit')
                       ELSE 'off' END,
                  true) AS commit_mode
FROM up, c"
        );
        // The claim never waits for a holder's row lock. `PostgresIdempotency`'s transaction
        // at REPEATABLE READ or SERIALIZABLE locks the record `FOR UPDATE` until its commit
        // (`hold`) and keeps the lease in its process, and a duplicate must be answered at
        // once, not when the holder commits. Of the locks the store takes, that one and the
        // purge's (on expired rows only) are those that conflict with `FOR KEY SHARE`: the
        // store's other statements (a claim counting a hit, a completion) take
        // `FOR NO KEY UPDATE`, for a moment, and are still waited for, so no hit is lost.
        // `free` takes that weak lock on a live row, skipping a row a holder has locked; such
        // a row is then only read, as committed (`held`, `written` false: no hit counted),
        // and the upsert does not run. A holder's row that has expired (work outliving a
        // short TTL) is still waited for, as is a READ COMMITTED transaction between its
        // `complete_in` and its commit.
        let claim = format!(
            "{NOW_CTE},
free AS MATERIALIZED (
    SELECT 1 FROM {t} AS l, c WHERE l.scope = $1 AND l.key = $2 AND l.expires_at > c.now
    FOR KEY SHARE OF l SKIP LOCKED
),
held AS (
    SELECT {cols} FROM {t} AS r, c
    WHERE r.scope = $1 AND r.key = $2 AND r.expires_at > c.now AND NOT EXISTS (SELECT 1 FROM free)
),
up AS (
    {}
)
SELECT held.*, {now_ms} AS now_ms, false AS written, NULL::text AS commit_mode FROM held, c
UNION ALL
{written}",
            upsert(single, "c", "WHERE NOT EXISTS (SELECT 1 FROM held)", "")
        );
        // The claim that counts no hit: a live record is only read (`written` false), and
        // the upsert inserts nothing, so the statement writes nothing and its commit costs
        // no WAL. When the read finds no live record the upsert runs as in `claim`; if a
        // concurrent claim inserted the row meanwhile, its conflict branch observes that row
        // and counts the hit, the one observation this mode still counts.
        let observe = format!(
            "{NOW_CTE},
live AS (
    SELECT {cols} FROM {t} AS r, c
    WHERE r.scope = $1 AND r.key = $2 AND r.expires_at > c.now
),
up AS (
    {}
)
SELECT live.*, {now_ms} AS now_ms, false AS written, NULL::text AS commit_mode FROM live, c
UNION ALL
{written}",
            upsert(single, "c", "WHERE NOT EXISTS (SELECT 1 FROM live)", "")
        );
        // The batch forms: the same statements over arrays of distinct keys (a key twice in
        // one statement would make ON CONFLICT DO UPDATE touch its row twice, an error; the
        // store sends a key named again in a later statement). Rows are inserted in key order,
        // so two batches that share keys lock them in the same order. The commit is
        // asynchronous only when every row only counted a hit.
        let input = "i AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int8[], $5::int8[])
        AS i(scope, key, fingerprint, lease_ms, hold_ms)
)";
        let batch = [
            "i.scope",
            "i.key",
            "i.fingerprint",
            "i.lease_ms",
            "i.hold_ms",
        ];
        let named = ", r.scope AS b_scope, r.key AS b_key";
        let written_batch = format!(
            "SELECT up.*, {now_ms} AS now_ms, true AS written,
       (SELECT set_config('synchronous_commit',
                          CASE WHEN bool_and(u.hits > 0) THEN 'off'
                               ELSE current_setting('synchronous_commit') END,
                          true)
        FROM up AS u) AS commit_mode
FROM up, c"
        );
        // As `claim`, a live row another transaction holds is only read.
        let claim_batch = format!(
            "{NOW_CTE},
{input},
free AS MATERIALIZED (
    SELECT l.scope, l.key FROM {t} AS l JOIN i ON l.scope = i.scope AND l.key = i.key, c
    WHERE l.expires_at > c.now
    FOR KEY SHARE OF l SKIP LOCKED
),
held AS (
    SELECT {cols}{named} FROM {t} AS r JOIN i ON r.scope = i.scope AND r.key = i.key, c
    WHERE r.expires_at > c.now
      AND NOT EXISTS (SELECT 1 FROM free WHERE free.scope = r.scope AND free.key = r.key)
),
up AS (
    {}
)
SELECT held.*, {now_ms} AS now_ms, false AS written, NULL::text AS commit_mode FROM held, c
UNION ALL
{written_batch}",
            upsert(
                batch,
                "c, i",
                "WHERE NOT EXISTS (
        SELECT 1 FROM held WHERE held.b_scope = i.scope AND held.b_key = i.key)
    ORDER BY i.scope, i.key",
                named
            )
        );
        let observe_batch = format!(
            "{NOW_CTE},
{input},
live AS (
    SELECT {cols}{named} FROM {t} AS r JOIN i ON r.scope = i.scope AND r.key = i.key, c
    WHERE r.expires_at > c.now
),
up AS (
    {}
)
SELECT live.*, {now_ms} AS now_ms, false AS written, NULL::text AS commit_mode FROM live, c
UNION ALL
{written_batch}",
            upsert(
                batch,
                "c, i",
                "WHERE NOT EXISTS (
        SELECT 1 FROM live WHERE live.b_scope = i.scope AND live.b_key = i.key)
    ORDER BY i.scope, i.key",
                named
            )
        );
        // The CAS on a live Pending record holding the token; shared by complete, fail, extend.
        let held = "r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.status = 'pending' \
                    AND r.expires_at > c.now";
        // The isolation level tells `PostgresIdempotency` how the caller's sessions run (the
        // completion also runs inside the caller's transaction, `complete_in`).
        let complete = format!(
            "{NOW_CTE}
UPDATE {t} AS r SET status = 'completed', outcome = $4, lease_until = NULL,
    failure_retryable = NULL, failure_message = NULL, updated_at = c.now,
    expires_at = c.now + $5 * interval '1 millisecond'
FROM c WHERE {held}
RETURNING r.token, current_setting('transaction_isolation') AS isolation"
        );
        // The completion inside `PostgresIdempotency`'s transaction at REPEATABLE READ or
        // SERIALIZABLE, where the transaction's first statement (`hold`) found the record live,
        // Pending and held by the token, and locked it until the commit: nobody else can have
        // changed it since. The lease was kept in the process meanwhile, and nothing moved
        // the record's own expiry, which a work longer than the retention (short TTLs are
        // normal for queue deduplication) outlives: so it is not checked again here. Status
        // and token still are.
        let complete_locked = format!(
            "{NOW_CTE}
UPDATE {t} AS r SET status = 'completed', outcome = $4, lease_until = NULL,
    failure_retryable = NULL, failure_message = NULL, updated_at = c.now,
    expires_at = c.now + $5 * interval '1 millisecond'
FROM c WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.status = 'pending'
RETURNING r.token, current_setting('transaction_isolation') AS isolation"
        );
        let fail = format!(
            "{NOW_CTE}
UPDATE {t} AS r SET status = 'failed', failure_retryable = $4, failure_message = $5,
    lease_until = NULL, updated_at = c.now,
    expires_at = c.now + $6 * interval '1 millisecond'
FROM c WHERE {held}
RETURNING r.token"
        );
        let settle_batch = format!(
            "{NOW_CTE},
i AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::bool[], $5::bytea[],
                         $6::bool[], $7::text[], $8::int8[])
        AS i(scope, key, token, completes, outcome, retryable, message, ttl_ms)
)
UPDATE {t} AS r SET
    status = CASE WHEN i.completes THEN 'completed' ELSE 'failed' END,
    outcome = CASE WHEN i.completes THEN i.outcome ELSE r.outcome END,
    failure_retryable = CASE WHEN i.completes THEN NULL ELSE i.retryable END,
    failure_message = CASE WHEN i.completes THEN NULL ELSE i.message END,
    lease_until = NULL, updated_at = c.now,
    expires_at = c.now + i.ttl_ms * interval '1 millisecond'
FROM c, i
WHERE r.scope = i.scope AND r.key = i.key AND r.token = i.token AND r.status = 'pending'
  AND r.expires_at > c.now
RETURNING r.scope AS b_scope, r.key AS b_key"
        );
        let extend = format!(
            "{NOW_CTE}
UPDATE {t} AS r SET lease_until = c.now + $4 * interval '1 millisecond',
    expires_at = greatest(r.expires_at, c.now + $4 * interval '1 millisecond'),
    updated_at = c.now
FROM c WHERE {held}
RETURNING r.token"
        );
        // A row a holder's transaction has locked (see `claim`) is not reclaimed, and not
        // waited for: the reclaim is lost at once. Its holder's transaction is open (it holds
        // the lock), whatever the lease column says.
        let reclaim = format!(
            "{NOW_CTE},
free AS MATERIALIZED (
    SELECT l.scope, l.key FROM {t} AS l, c
    WHERE l.scope = $1 AND l.key = $2 AND l.token = $3 AND l.expires_at > c.now
    FOR KEY SHARE OF l SKIP LOCKED
)
UPDATE {t} AS r SET status = 'pending', token = r.token + 1, fingerprint = $4,
    attempts = r.attempts + 1, lease_until = c.now + $5 * interval '1 millisecond',
    outcome = NULL, failure_retryable = NULL, failure_message = NULL, updated_at = c.now,
    expires_at = c.now + $6 * interval '1 millisecond'
FROM c, free
WHERE r.scope = $1 AND r.key = $2 AND r.scope = free.scope AND r.key = free.key
  AND r.token = $3 AND r.expires_at > c.now
  AND ((r.status = 'failed'
        AND (r.failure_retryable IS NOT FALSE OR r.fingerprint IS DISTINCT FROM $4))
       OR (r.status = 'pending' AND (r.lease_until IS NULL OR r.lease_until <= c.now)))
RETURNING r.token, {lease} AS lease_until_ms",
            lease = ms("r.lease_until"),
        );
        let get = format!(
            "{NOW_CTE}
SELECT {cols} FROM {t} AS r, c
WHERE r.scope = $1 AND r.key = $2 AND r.expires_at > c.now"
        );
        // Batched purge: lock at most $1 expired rows, skipping rows another session holds
        // (a claim replacing one, a concurrent purge), and delete them. The expires_at index
        // finds them in order; each batch is one short transaction, so no long locks.
        let purge = format!(
            "{NOW_CTE},
doomed AS (
    SELECT r.scope, r.key FROM {t} AS r, c
    WHERE r.expires_at <= c.now
    ORDER BY r.expires_at
    LIMIT $1
    FOR UPDATE OF r SKIP LOCKED
)
DELETE FROM {t} AS r USING doomed, c
WHERE r.scope = doomed.scope AND r.key = doomed.key AND r.expires_at <= c.now"
        );
        // The first statement of `PostgresIdempotency`'s transaction. It reports the transaction's
        // isolation level and, at REPEATABLE READ or SERIALIZABLE, locks the record row if it
        // is still a live Pending record held by $3, returning how much of its lease is left.
        // Holding that lock until the commit is what lets long work complete at those levels:
        // nobody else can write the row meanwhile (a heartbeat's extend on another connection
        // would make the completion fail to serialize); a reclaimer or a duplicate claim skips
        // the row (see `claim`), another completion waits for the transaction to end. At
        // READ COMMITTED it locks nothing (the heartbeat extends the lease from another
        // connection, as for the plain engine).
        let hold = format!(
            "{NOW_CTE},
held AS (
    SELECT r.lease_until FROM {t} AS r, c
    WHERE {held}
      AND current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted')
    FOR UPDATE OF r
)
SELECT current_setting('transaction_isolation') AS isolation,
       (SELECT {lease} - {now} FROM held) AS lease_left_ms
FROM c",
            lease = ms("held.lease_until"),
            now = ms("c.now"),
        );
        // The recovery point belongs to this record, not to one before it under the same key:
        // written by a holder whose token is at least the record's creation token (a reclaim
        // adds one to the token and to the attempts). A fresh claim over an expired row leaves
        // the old point in its columns; this is what makes it count as none.
        let current = "r.op_origin >= r.token - r.attempts + 1";
        // A recovery point also renews the holder's lease, in the phase's own transaction:
        // at REPEATABLE READ and SERIALIZABLE the lease was kept in the process while the
        // phase held the row, so the record's own may have passed, and a reclaimer would
        // otherwise take the operation over the moment the phase commits.
        let advance_set = "SET op_name = $4, op_phase = $5, op_origin = $6, op_state = $7, \
                           lease_until = c.now + $9 * interval '1 millisecond', \
                           expires_at = greatest(r.expires_at, \
                                                 c.now + $9 * interval '1 millisecond'), \
                           updated_at = c.now";
        let from =
            format!("(CASE WHEN {current} THEN r.op_phase END) IS NOT DISTINCT FROM $8::int4");
        let advance = format!(
            "{NOW_CTE}
UPDATE {t} AS r {advance_set}
FROM c WHERE {held} AND {from}
RETURNING r.token"
        );
        let point = format!(
            "{NOW_CTE}
SELECT r.op_name, r.op_phase, r.op_origin, r.op_state FROM {t} AS r, c
WHERE r.scope = $1 AND r.key = $2 AND r.expires_at > c.now AND {current}"
        );
        let abandoned = format!(
            "{NOW_CTE}
SELECT r.scope, r.key, r.fingerprint, r.op_name, r.op_phase FROM {t} AS r, c
WHERE r.op_name IS NOT NULL
  AND r.expires_at > c.now AND {current}
  AND r.op_name = ANY($2) AND r.attempts < $3
  AND ((r.status = 'pending' AND (r.lease_until IS NULL OR r.lease_until <= c.now))
       OR (r.status = 'failed' AND r.failure_retryable
           AND r.updated_at <= c.now - make_interval(secs => $4)))
ORDER BY r.updated_at LIMIT $1"
        );
        Self {
            advance,
            point,
            abandoned,
            claim,
            observe,
            complete,
            complete_locked,
            fail,
            extend,
            reclaim,
            get,
            purge,
            hold,
            claim_batch,
            observe_batch,
            settle_batch,
        }
    }
}

#[cfg(test)]
mod plan_tests {
    use crate::PostgresStore;
    use idempotency_testing::postgres::{pool, Isolation, SchemaGuard};

    /// The completer's listing of abandoned operations reads the partial index of
    /// multi-step operations, not the table, which holds every key of one-step work too.
    #[tokio::test]
    async fn the_abandoned_listing_reads_its_index() {
        let guard = SchemaGuard::new();
        let pool = pool(Isolation::ReadCommitted, 2).await;
        let store = PostgresStore::builder()
            .schema(&guard.schema)
            .table("records")
            .build(pool.clone())
            .expect("names");
        store.migrate().await.expect("migrate");
        let t = format!(r#""{}".records"#, guard.schema);
        // 50,000 keys of one-step work and 20 open operations.
        sqlx::raw_sql(&format!(
            "INSERT INTO {t} (scope, key, fingerprint, status, token, attempts, hits, \
                              created_at, updated_at, expires_at, outcome)
             SELECT 's', 'k' || g, decode(repeat('00', 32), 'hex'), 'completed', g, 1, 0,
                    now(), now(), now() + interval '1 day', '\\x00'::bytea
             FROM generate_series(1, 50000) g;
             INSERT INTO {t} (scope, key, fingerprint, status, token, attempts, hits,
                              created_at, updated_at, expires_at, lease_until,
                              op_name, op_phase, op_origin, op_state)
             SELECT 'o', 'op' || g, decode(repeat('00', 32), 'hex'), 'pending', g, 1, 0,
                    now(), now(), now() + interval '1 day', now(), 'op', 1, g, '{{}}'::bytea
             FROM generate_series(1, 20) g;
             ANALYZE {t}"
        ))
        .execute(&pool)
        .await
        .expect("fill");
        let plan: Vec<String> = sqlx::query_scalar(&format!("EXPLAIN {}", store.sql.abandoned))
            .bind(10_i64)
            .bind(vec!["op".to_owned()])
            .bind(10_i32)
            .bind(0.0_f64)
            .fetch_all(&pool)
            .await
            .expect("explain");
        let plan = plan.join("\n");
        assert!(plan.contains("records_abandoned_idx"), "{plan}");
        assert!(!plan.contains("Seq Scan on records"), "{plan}");
    }
}
