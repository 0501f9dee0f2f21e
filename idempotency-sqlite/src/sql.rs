//! Every SQL statement of the store, with the table name baked in.

pub(crate) const COLUMNS: &str = "scope, key, fingerprint, status, token, lease_until, outcome, attempts, \
                       failure_retryable, failure_message, hits, created_at, updated_at, expires_at";

/// Every statement, with the (validated, quoted) table name baked in.
#[derive(Debug)]
pub(crate) struct Sql {
    pub(crate) claim: String,
    pub(crate) complete: String,
    pub(crate) fail: String,
    pub(crate) extend: String,
    pub(crate) reclaim: String,
    pub(crate) get: String,
    pub(crate) purge: String,
    pub(crate) live: String,
    pub(crate) hit: String,
    pub(crate) advance: String,
    pub(crate) point: String,
    pub(crate) abandoned: String,
}

impl Sql {
    pub(crate) fn new(table: &str) -> Self {
        // Shared CAS guard: ?1 scope, ?2 key, ?3 token, ?4 now.
        let held = "scope = ?1 AND key = ?2 AND token = ?3 AND expires_at > ?4";
        // In the upsert, bare column names are the existing row and `excluded` is the new
        // one; every SET expression reads the existing row, and `expires_at` is set last.
        let fresh = "expires_at <= ?5";
        // The recovery point belongs to this record, not to one before it under the same key:
        // written by a holder whose token is at least the one the record was created with
        // (a reclaim adds one to the token and to the attempts, so `token - attempts + 1` is
        // the creation token). A fresh claim clears it too; this also holds against a
        // process of an older crate, whose claim does not.
        let current = "op_origin >= token - attempts + 1";
        Self {
            claim: format!(
                r#"INSERT INTO "{table}" ({COLUMNS})
                   VALUES (?1, ?2, ?3, 'pending', ?7, ?4, NULL, 1, NULL, NULL, 0, ?5, ?5, ?6)
                   ON CONFLICT (scope, key) DO UPDATE SET
                     fingerprint       = CASE WHEN {fresh} THEN excluded.fingerprint ELSE fingerprint END,
                     status            = CASE WHEN {fresh} THEN 'pending' ELSE status END,
                     token             = CASE WHEN {fresh} THEN max(token + 1, ?7) ELSE token END,
                     lease_until       = CASE WHEN {fresh} THEN excluded.lease_until ELSE lease_until END,
                     outcome           = CASE WHEN {fresh} THEN NULL ELSE outcome END,
                     attempts          = CASE WHEN {fresh} THEN 1 ELSE attempts END,
                     failure_retryable = CASE WHEN {fresh} THEN NULL ELSE failure_retryable END,
                     failure_message   = CASE WHEN {fresh} THEN NULL ELSE failure_message END,
                     hits              = CASE WHEN {fresh} THEN 0 WHEN hits >= 0 THEN hits + 1 END,
                     created_at        = CASE WHEN {fresh} THEN excluded.created_at ELSE created_at END,
                     updated_at        = CASE WHEN {fresh} THEN excluded.updated_at ELSE updated_at END,
                     expires_at        = CASE WHEN {fresh} THEN excluded.expires_at ELSE expires_at END,
                     op_name           = CASE WHEN {fresh} THEN NULL ELSE op_name END,
                     op_phase          = CASE WHEN {fresh} THEN NULL ELSE op_phase END,
                     op_origin         = CASE WHEN {fresh} THEN NULL ELSE op_origin END,
                     op_state          = CASE WHEN {fresh} THEN NULL ELSE op_state END
                   RETURNING {COLUMNS}"#
            ),
            // ?5 outcome, ?6 expires_at
            complete: format!(
                r#"UPDATE "{table}" SET status = 'completed', outcome = ?5, lease_until = NULL,
                     failure_retryable = NULL, failure_message = NULL,
                     updated_at = ?4, expires_at = ?6
                   WHERE {held} AND status = 'pending'"#
            ),
            // ?5 retryable, ?6 message, ?7 expires_at
            fail: format!(
                r#"UPDATE "{table}" SET status = 'failed', failure_retryable = ?5,
                     failure_message = ?6, lease_until = NULL, updated_at = ?4, expires_at = ?7
                   WHERE {held} AND status = 'pending'"#
            ),
            // ?5 lease_until
            extend: format!(
                r#"UPDATE "{table}" SET lease_until = ?5, expires_at = max(expires_at, ?5),
                     updated_at = ?4
                   WHERE {held} AND status = 'pending'"#
            ),
            // ?5 fingerprint, ?6 lease_until, ?7 expires_at
            reclaim: format!(
                r#"UPDATE "{table}" SET status = 'pending', token = token + 1, fingerprint = ?5,
                     attempts = attempts + 1, lease_until = ?6, outcome = NULL,
                     failure_retryable = NULL, failure_message = NULL,
                     updated_at = ?4, expires_at = ?7
                   WHERE {held}
                     AND ((status = 'failed'
                           AND (failure_retryable IS NOT 0 OR fingerprint IS NOT ?5))
                          OR (status = 'pending' AND (lease_until IS NULL OR lease_until <= ?4)))"#
            ),
            get: format!(
                r#"SELECT {COLUMNS} FROM "{table}" WHERE scope = ?1 AND key = ?2 AND expires_at > ?3"#
            ),
            purge: format!(
                r#"DELETE FROM "{table}" WHERE rowid IN (
                     SELECT rowid FROM "{table}" WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)"#
            ),
            // ?3 now
            live: format!(
                r#"SELECT 1 FROM "{table}" WHERE scope = ?1 AND key = ?2 AND expires_at > ?3"#
            ),
            // The observation half of the claim: only hits change (a corrupt negative count
            // becomes NULL, which the NOT NULL constraint refuses, as in the claim).
            // ?5 op_name, ?6 op_phase, ?7 op_origin, ?8 op_state, ?9 the phase it moves from
            // (NULL: none yet). Moved only by its holder, from where it was. A recovery point
            // older than the record ({current}) counts as none.
            advance: format!(
                r#"UPDATE "{table}" SET op_name = ?5, op_phase = ?6, op_origin = ?7,
                     op_state = ?8, updated_at = ?4
                   WHERE {held} AND status = 'pending'
                     AND (CASE WHEN {current} THEN op_phase END) IS ?9"#
            ),
            // ?3 now
            point: format!(
                r#"SELECT op_name, op_phase, op_origin, op_state FROM "{table}"
                   WHERE scope = ?1 AND key = ?2 AND expires_at > ?3 AND {current}"#
            ),
            // ?1 now, ?2 limit, ?3 the operations (a JSON array of names), ?4 attempts below
            // which, ?5 the failures recorded before which: live operations whose holder is
            // gone. The first two terms are the partial index's (`{table}_abandoned`), so
            // that SQLite reads it in `updated_at` order instead of scanning the table.
            abandoned: format!(
                r#"SELECT scope, key, fingerprint, op_name, op_phase FROM "{table}"
                   WHERE op_name IS NOT NULL AND status <> 'completed'
                     AND expires_at > ?1 AND {current}
                     AND op_name IN (SELECT value FROM json_each(?3)) AND attempts < ?4
                     AND ((status = 'pending' AND (lease_until IS NULL OR lease_until <= ?1))
                          OR (status = 'failed' AND failure_retryable = 1
                              AND updated_at <= ?5))
                   ORDER BY updated_at LIMIT ?2"#
            ),
            hit: format!(
                r#"UPDATE "{table}" SET hits = CASE WHEN hits >= 0 THEN hits + 1 END
                   WHERE scope = ?1 AND key = ?2 AND expires_at > ?3
                   RETURNING {COLUMNS}"#
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Sql;
    use rusqlite::{params, Connection};

    /// The completer's listing reads the partial index of open operations, in its order, and
    /// never scans the table (which holds every key of one-step work too).
    #[test]
    fn the_abandoned_listing_reads_its_index() {
        let mut conn = Connection::open_in_memory().expect("open");
        crate::schema::migrate(&mut conn, "records").expect("migrate");
        let sql = Sql::new("records");
        let mut stmt = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {}", sql.abandoned))
            .expect("prepare");
        let plan: Vec<String> = stmt
            .query_map(params![0_i64, 10_i64, r#"["op"]"#, 10_i64, 0_i64], |r| {
                r.get::<_, String>(3)
            })
            .expect("explain")
            .collect::<Result<_, _>>()
            .expect("rows");
        let main: Vec<&String> = plan.iter().filter(|l| l.contains("records")).collect();
        assert!(
            main.iter()
                .all(|l| l.contains("USING INDEX records_abandoned")),
            "{plan:?}"
        );
        assert!(!plan.iter().any(|l| l.contains("TEMP B-TREE")), "{plan:?}");
    }
}
