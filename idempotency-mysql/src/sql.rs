//! The statements, built once per table name.
//!
//! Every store operation is exactly one of these statements: one round trip, one implicit
//! transaction (autocommit). They are sent as prepared statements, which sqlx caches per
//! connection.
//!
//! Time: `now` is the server's `UTC_TIMESTAMP(6)`, which is fixed for the duration of a
//! statement, as microseconds since the Unix epoch (`TIMESTAMPDIFF` between two `DATETIME`
//! values: no session time zone takes part). Every timestamp is stored as `BIGINT`
//! milliseconds since the epoch, the unit of [`idempotency_core::store::Timestamp`].

use crate::TableName;

/// The server's clock in microseconds since the Unix epoch, the same value everywhere in
/// one statement.
pub(crate) const NOW_US: &str =
    "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) AS SIGNED)";

/// [`NOW_US`] in whole milliseconds.
pub(crate) fn now_ms() -> String {
    format!("CAST(({NOW_US}) DIV 1000 AS SIGNED)")
}

/// The record's columns as the decoder reads them.
pub(crate) const RECORD_COLUMNS: &str = "fingerprint, status, token, lease_until_ms, outcome, \
     attempts, failure_retryable, failure_message, hits, created_ms, updated_ms, expires_ms";

/// The statements of one store.
#[derive(Debug)]
pub(crate) struct Statements {
    pub claim: String,
    pub complete: String,
    pub fail: String,
    pub extend: String,
    pub reclaim: String,
    pub get: String,
    pub purge: String,
    /// The recovery point's advance inside the caller's transaction: name, phase, origin,
    /// state, then scope, key, token, then the phase it moves from (NULL: none).
    pub advance: String,
    /// The recovery point of the live record, if it belongs to it: scope, key.
    pub point: String,
    /// Up to ? live operations whose holder is gone.
    pub abandoned: String,
}

impl Statements {
    pub(crate) fn new(name: &TableName) -> Self {
        let t = name.quoted();
        let now = now_ms();
        let cols = RECORD_COLUMNS;
        // Claim-or-observe, one statement: INSERT … ON DUPLICATE KEY UPDATE … RETURNING
        // (MariaDB 10.5 and later return the row as the statement left it, inserted, updated
        // or untouched). The primary key's row lock makes it atomic:
        // - no row: inserts a Pending record whose token is the clock in µs;
        // - an expired row: replaces every field, token greatest(token + 1, now in µs);
        // - a live row: only hits + ? (1 to count the hit, 0 for a pure read, which changes
        //   nothing and so writes nothing).
        // `claim_nonce` is set to the caller's random nonce only when the statement inserted
        // or replaced the record: the returned nonce says whether this claim won, whatever
        // the connection's CLIENT_FOUND_ROWS setting makes of the affected-row count. A
        // claim sent again (its first send's answer was lost) finds its own nonce: no hit.
        // Every other write that changes the holder (a reclaim) sets the nonce to 0, which no
        // claim draws, so a resent claim recognises only its own claim, untouched since.
        //
        // MySQL evaluates ON DUPLICATE KEY UPDATE assignments left to right, each seeing the
        // columns assigned before it: every condition reads `expires_ms`, so it is assigned
        // last.
        let expired = format!("expires_ms <= {now}");
        let claim = format!(
            "INSERT INTO {t} (scope, idem_key, fingerprint, status, token, claim_nonce, revision,
                  lease_until_ms, outcome, attempts, failure_retryable, failure_message, hits,
                  created_ms, updated_ms, expires_ms)
VALUES (?, ?, ?, 'pending', GREATEST(1, {NOW_US}), ?, 0,
        {now} + ?, NULL, 1, NULL, NULL, 0,
        {now}, {now}, {now} + ?)
ON DUPLICATE KEY UPDATE
    fingerprint = IF({expired}, VALUES(fingerprint), fingerprint),
    status = IF({expired}, 'pending', status),
    token = IF({expired}, GREATEST(token + 1, VALUES(token)), token),
    claim_nonce = IF({expired}, VALUES(claim_nonce), claim_nonce),
    revision = IF({expired}, revision + 1, revision),
    lease_until_ms = IF({expired}, VALUES(lease_until_ms), lease_until_ms),
    outcome = IF({expired}, NULL, outcome),
    attempts = IF({expired}, 1, attempts),
    failure_retryable = IF({expired}, NULL, failure_retryable),
    failure_message = IF({expired}, NULL, failure_message),
    hits = IF({expired}, 0, hits + IF(claim_nonce = VALUES(claim_nonce), 0, ?)),
    created_ms = IF({expired}, VALUES(created_ms), created_ms),
    updated_ms = IF({expired}, VALUES(updated_ms), updated_ms),
    expires_ms = IF({expired}, VALUES(expires_ms), expires_ms)
RETURNING {cols}, claim_nonce, {now} AS now_ms"
        );
        // The compare-and-swap on a live Pending record holding the token, shared by
        // complete, fail and extend. Its answer is the affected-row count: sqlx connects with
        // CLIENT_FOUND_ROWS (matched rows), and every CAS also adds one to `revision`, so the
        // row always changes and the count is the same without that flag (an extend that
        // rewrites the same lease in the same millisecond is still reported applied).
        let held =
            format!("scope = ? AND idem_key = ? AND token = ? AND status = 'pending' AND expires_ms > {now}");
        let complete = format!(
            "UPDATE {t} SET status = 'completed', outcome = ?, lease_until_ms = NULL,
    failure_retryable = NULL, failure_message = NULL, updated_ms = {now},
    expires_ms = {now} + ?, revision = revision + 1
WHERE {held}"
        );
        let fail = format!(
            "UPDATE {t} SET status = 'failed', failure_retryable = ?, failure_message = ?,
    lease_until_ms = NULL, updated_ms = {now}, expires_ms = {now} + ?,
    revision = revision + 1
WHERE {held}"
        );
        // The lease is bound twice: no assignment reads another's new value, so the statement
        // means the same under MariaDB's SIMULTANEOUS_ASSIGNMENT mode.
        let extend = format!(
            "UPDATE {t} SET lease_until_ms = {now} + ?,
    expires_ms = GREATEST(expires_ms, {now} + ?), updated_ms = {now},
    revision = revision + 1
WHERE {held}"
        );
        // The reclaim's new lease comes back in the OK packet: `LAST_INSERT_ID(expr)` sets
        // the value the server reports as the statement's last insert id, so the caller
        // learns the lease on the server's clock without a second round trip. (The new token
        // is the expected one plus one.)
        let reclaim = format!(
            "UPDATE {t} SET status = 'pending', token = token + 1, claim_nonce = 0, fingerprint = ?,
    attempts = attempts + 1, lease_until_ms = LAST_INSERT_ID({now} + ?),
    outcome = NULL, failure_retryable = NULL, failure_message = NULL, updated_ms = {now},
    expires_ms = {now} + ?, revision = revision + 1
WHERE scope = ? AND idem_key = ? AND token = ? AND expires_ms > {now}
  AND ((status = 'failed' AND (failure_retryable IS NULL OR failure_retryable <> 0
                               OR fingerprint <> ?))
       OR (status = 'pending' AND (lease_until_ms IS NULL OR lease_until_ms <= {now})))"
        );
        let get = format!(
            "SELECT {cols} FROM {t} WHERE scope = ? AND idem_key = ? AND expires_ms > {now}"
        );
        // Bounded: at most ? expired rows, oldest first, found on the expiry index.
        let purge =
            format!("DELETE FROM {t} WHERE expires_ms <= {now} ORDER BY expires_ms LIMIT ?");
        // A recovery point belongs to the record, not to one before it under the same key:
        // written by a holder whose token is at least the record's creation token (a reclaim
        // adds one to the token and to the attempts). A fresh claim over an expired row leaves
        // the old point in its columns; this makes it count as none.
        let current = "op_origin >= token - attempts + 1";
        let advance = format!(
            "UPDATE {t} SET op_name = ?, op_phase = ?, op_origin = ?, op_state = ?,
    updated_ms = {now}, revision = revision + 1
WHERE {held} AND (CASE WHEN {current} THEN op_phase END) <=> ?"
        );
        let point = format!(
            "SELECT op_name, op_phase, op_origin, op_state FROM {t}
WHERE scope = ? AND idem_key = ? AND expires_ms > {now} AND {current}"
        );
        let abandoned = format!(
            "SELECT scope, idem_key, fingerprint, op_name, op_phase FROM {t}
WHERE expires_ms > {now} AND {current}
  AND op_name IN ({{names}}) AND attempts < ?
  AND ((status = 'pending' AND (lease_until_ms IS NULL OR lease_until_ms <= {now}))
       OR (status = 'failed' AND failure_retryable = 1 AND updated_ms <= {now} - ?))
ORDER BY updated_ms LIMIT ?"
        );
        Self {
            advance,
            point,
            abandoned,
            claim,
            complete,
            fail,
            extend,
            reclaim,
            get,
            purge,
        }
    }
}

#[cfg(test)]
mod plan_tests {
    use crate::MySqlStore;
    use idempotency_testing::mysql::{pool, Isolation, TableGuard};
    use sqlx::Row;

    /// The completer's listing of abandoned operations reads the index of multi-step
    /// operations, not the table, which holds every key of one-step work too.
    #[tokio::test]
    async fn the_abandoned_listing_reads_its_index() {
        let guard = TableGuard::new();
        let pool = pool(Isolation::ReadCommitted, 2).await;
        let store = MySqlStore::builder()
            .table(&guard.table)
            .build(pool.clone())
            .expect("name");
        store.migrate().await.expect("migrate");
        let t = format!("`{}`", guard.table);
        // 50,000 keys of one-step work and 20 open operations.
        for sql in [
            format!(
                "INSERT INTO {t} (scope, idem_key, fingerprint, status, token, claim_nonce,
                                  attempts, hits, created_ms, updated_ms, expires_ms, outcome)
                 SELECT 's', CONCAT('k', seq), REPEAT(x'00', 32), 'completed', seq, 1, 1, 0,
                        1, 1, 9000000000000, x'00'
                 FROM seq_1_to_50000"
            ),
            format!(
                "INSERT INTO {t} (scope, idem_key, fingerprint, status, token, claim_nonce,
                                  attempts, hits, created_ms, updated_ms, expires_ms,
                                  lease_until_ms, op_name, op_phase, op_origin, op_state)
                 SELECT 'o', CONCAT('op', seq), REPEAT(x'00', 32), 'pending', seq, 1, 1, 0,
                        1, 1, 9000000000000, 1, 'op', 1, seq, '{{}}'
                 FROM seq_1_to_20"
            ),
            format!("ANALYZE TABLE {t}"),
        ] {
            sqlx::query(&sql).execute(&pool).await.expect("fill");
        }
        let statement = store.sql.abandoned.replace("{names}", "?");
        let rows = sqlx::query(&format!("EXPLAIN {statement}"))
            .bind("op")
            .bind(10_u32)
            .bind(0_i64)
            .bind(10_u64)
            .fetch_all(&pool)
            .await
            .expect("explain");
        let keys: Vec<Option<String>> = rows
            .iter()
            .map(|r| {
                r.try_get::<Option<Vec<u8>>, _>("key")
                    .ok()
                    .flatten()
                    .map(|k| String::from_utf8_lossy(&k).into_owned())
                    .or_else(|| r.try_get::<Option<String>, _>("key").ok().flatten())
            })
            .collect();
        assert_eq!(keys, [Some("op_name_idx".to_owned())], "{keys:?}");
    }
}
