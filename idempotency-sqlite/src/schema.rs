//! Table names, embedded migrations and the schema check.

use crate::SqliteError;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

/// The newest schema version this crate knows.
pub const SCHEMA_VERSION: i64 = 3;

/// The longest table name accepted.
pub const MAX_TABLE_NAME_LEN: usize = 48;

/// Checks a table name: 1 to [`MAX_TABLE_NAME_LEN`] ASCII letters, digits and underscores,
/// not starting with a digit, and not in SQLite's reserved `sqlite_` namespace. Names are
/// also quoted in every statement, so a valid name can never change a statement's meaning.
pub fn validate_table_name(name: &str) -> Result<(), SqliteError> {
    let bad = |reason| {
        Err(SqliteError::InvalidName {
            what: "table",
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.len() > MAX_TABLE_NAME_LEN {
        return bad("it is longer than 48 bytes");
    }
    if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return bad("only ASCII letters, digits and '_' are allowed");
    }
    if name.as_bytes()[0].is_ascii_digit() {
        return bad("it starts with a digit");
    }
    if name.to_ascii_lowercase().starts_with("sqlite_") {
        return bad("names starting with 'sqlite_' are reserved by SQLite");
    }
    Ok(())
}

/// The migrations, oldest first: `(version, SQL)` with `{table}` standing for the table name.
/// Each is applied once, inside the same `BEGIN IMMEDIATE` transaction as its bookkeeping.
const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        r#"
CREATE TABLE IF NOT EXISTS "{table}" (
    scope             TEXT    NOT NULL,
    key               TEXT    NOT NULL,
    fingerprint       BLOB    NOT NULL CHECK (length(fingerprint) = 32),
    status            TEXT    NOT NULL CHECK (status IN ('pending', 'completed', 'failed')),
    token             INTEGER NOT NULL CHECK (token >= 1),
    lease_until       INTEGER,
    outcome           BLOB,
    attempts          INTEGER NOT NULL CHECK (attempts >= 1),
    failure_retryable INTEGER,
    failure_message   TEXT,
    hits              INTEGER NOT NULL CHECK (hits >= 0),
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL,
    PRIMARY KEY (scope, key)
) STRICT;
CREATE INDEX IF NOT EXISTS "{table}_expires_at" ON "{table}" (expires_at);
"#,
    ),
    (
        // Recovery points of multi-step operations (`idempotency_core::phases`).
        2,
        r#"
ALTER TABLE "{table}" ADD COLUMN op_name   TEXT;
ALTER TABLE "{table}" ADD COLUMN op_phase  INTEGER CHECK (op_phase BETWEEN 0 AND 65535);
ALTER TABLE "{table}" ADD COLUMN op_origin INTEGER;
ALTER TABLE "{table}" ADD COLUMN op_state  BLOB;
"#,
    ),
    (
        // The completer's listing of abandoned operations reads this index, not the table:
        // only records of multi-step operations that have not completed are in it.
        3,
        r#"
CREATE INDEX IF NOT EXISTS "{table}_abandoned" ON "{table}" (updated_at)
    WHERE op_name IS NOT NULL AND status <> 'completed';
"#,
    ),
];

/// `(name, declared type, NOT NULL, position in the primary key)` of every column, in order.
const COLUMNS: &[(&str, &str, bool, i64)] = &[
    ("scope", "TEXT", true, 1),
    ("key", "TEXT", true, 2),
    ("fingerprint", "BLOB", true, 0),
    ("status", "TEXT", true, 0),
    ("token", "INTEGER", true, 0),
    ("lease_until", "INTEGER", false, 0),
    ("outcome", "BLOB", false, 0),
    ("attempts", "INTEGER", true, 0),
    ("failure_retryable", "INTEGER", false, 0),
    ("failure_message", "TEXT", false, 0),
    ("hits", "INTEGER", true, 0),
    ("created_at", "INTEGER", true, 0),
    ("updated_at", "INTEGER", true, 0),
    ("expires_at", "INTEGER", true, 0),
    ("op_name", "TEXT", false, 0),
    ("op_phase", "INTEGER", false, 0),
    ("op_origin", "INTEGER", false, 0),
    ("op_state", "BLOB", false, 0),
];

fn versions_table(table: &str) -> String {
    format!("{table}_migrations")
}

/// Applies the missing migrations and checks the result. Safe to run from several processes
/// at once: `BEGIN IMMEDIATE` serialises them and the second finds nothing to do.
pub(crate) fn migrate(conn: &mut Connection, table: &str) -> Result<(), SqliteError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let versions = versions_table(table);
    tx.execute_batch(&format!(
        r#"CREATE TABLE IF NOT EXISTS "{versions}" (
               version    INTEGER PRIMARY KEY,
               applied_at INTEGER NOT NULL
           ) STRICT;"#
    ))?;
    let found: i64 = tx.query_row(
        &format!(r#"SELECT coalesce(max(version), 0) FROM "{versions}""#),
        [],
        |r| r.get(0),
    )?;
    if found > SCHEMA_VERSION {
        return Err(SqliteError::SchemaTooNew {
            table: table.to_owned(),
            found,
            supported: SCHEMA_VERSION,
        });
    }
    if found == 0 && table_exists(&tx, table)? {
        // A table of that name that no migration of ours created: adopt it only if it is
        // exactly ours, and otherwise change nothing (the transaction rolls back).
        verify(&tx, table)?;
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > found) {
        tx.execute_batch(&sql.replace("{table}", table))?;
        tx.execute(
            &format!(r#"INSERT INTO "{versions}" (version, applied_at) VALUES (?1, unixepoch())"#),
            [version],
        )?;
    }
    verify(&tx, table)?;
    tx.commit()?;
    Ok(())
}

fn table_exists(conn: &Connection, table: &str) -> Result<bool, SqliteError> {
    Ok(conn
        .query_row(
            "SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = ?1",
            [table],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

/// Checks that `table` has exactly our columns, is STRICT and has the expiry index.
pub(crate) fn verify(conn: &Connection, table: &str) -> Result<(), SqliteError> {
    let mismatch = |detail: String| {
        Err(SqliteError::TableShape {
            table: table.to_owned(),
            detail,
        })
    };
    let mut stmt =
        conn.prepare(r#"SELECT name, type, "notnull", pk FROM pragma_table_info(?1)"#)?;
    let found = stmt
        .query_map([table], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, bool>(2)?,
                r.get::<_, i64>(3)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    if found.is_empty() {
        return Err(SqliteError::MissingTable {
            table: table.to_owned(),
        });
    }
    for (i, expected) in COLUMNS.iter().enumerate() {
        let Some((name, ty, notnull, pk)) = found.get(i) else {
            return mismatch(format!("column {:?} is missing", expected.0));
        };
        if name != expected.0 {
            return mismatch(format!(
                "column {} is {name:?}, expected {:?}",
                i + 1,
                expected.0
            ));
        }
        if !ty.eq_ignore_ascii_case(expected.1) || *notnull != expected.2 || *pk != expected.3 {
            return mismatch(format!(
                "column {name:?} is `{ty}{}` (primary key position {pk}), expected `{}{}` \
                 (primary key position {})",
                if *notnull { " NOT NULL" } else { "" },
                expected.1,
                if expected.2 { " NOT NULL" } else { "" },
                expected.3
            ));
        }
    }
    if let Some((name, ..)) = found.get(COLUMNS.len()) {
        return mismatch(format!("unexpected extra column {name:?}"));
    }
    let strict: bool = conn.query_row(
        r#"SELECT strict FROM pragma_table_list WHERE name = ?1 AND schema = 'main'"#,
        [table],
        |r| r.get(0),
    )?;
    if !strict {
        return mismatch("the table is not STRICT".into());
    }
    let index = format!("{table}_expires_at");
    let indexed: Option<String> = conn
        .query_row("SELECT name FROM pragma_index_info(?1)", [&index], |r| {
            r.get(0)
        })
        .optional()?;
    if indexed.as_deref() != Some("expires_at") {
        return mismatch(format!("index {index:?} on expires_at is missing"));
    }
    let index = format!("{table}_abandoned");
    let indexed: Option<String> = conn
        .query_row("SELECT name FROM pragma_index_info(?1)", [&index], |r| {
            r.get(0)
        })
        .optional()?;
    if indexed.as_deref() != Some("updated_at") {
        return mismatch(format!("index {index:?} on updated_at is missing"));
    }
    Ok(())
}
