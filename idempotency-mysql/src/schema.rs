//! Creating the table (`migrate`) and checking its shape (`verify`).

use crate::{MySqlError, TableName};
use sqlx::{MySqlConnection, Row};

/// Every column the store reads or writes, with the `DATA_TYPE` `information_schema` reports
/// for it.
const COLUMNS: &[(&str, &str)] = &[
    ("scope", "varbinary"),
    ("idem_key", "varbinary"),
    ("fingerprint", "varbinary"),
    ("status", "varchar"),
    ("token", "bigint"),
    ("claim_nonce", "bigint"),
    ("revision", "bigint"),
    ("lease_until_ms", "bigint"),
    ("outcome", "longblob"),
    ("attempts", "int"),
    ("failure_retryable", "tinyint"),
    ("failure_message", "text"),
    ("hits", "bigint"),
    ("created_ms", "bigint"),
    ("updated_ms", "bigint"),
    ("expires_ms", "bigint"),
    ("op_name", "text"),
    ("op_phase", "int"),
    ("op_origin", "bigint"),
    ("op_state", "longblob"),
];

/// The recovery point columns (multi-step operations), added to a table created before them.
const RECOVERY_POINT_COLUMNS: &[(&str, &str)] = &[
    (
        "op_name",
        "TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL",
    ),
    ("op_phase", "INT NULL"),
    ("op_origin", "BIGINT NULL"),
    ("op_state", "LONGBLOB NULL"),
];

/// The table. Keys and scopes are byte strings (compared byte for byte, never by a
/// collation that would fold case) sized to the core's limits; timestamps are milliseconds
/// since the Unix epoch on the server's clock; `expires_ms` is indexed for the purge. CHECK
/// constraints (enforced by MariaDB) refuse what no correct store writes; the decoder checks
/// every value again.
fn create_table(name: &TableName) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {t} (
    scope VARBINARY(1024) NOT NULL,
    idem_key VARBINARY(255) NOT NULL,
    fingerprint VARBINARY(64) NOT NULL,
    status VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    token BIGINT NOT NULL,
    claim_nonce BIGINT NOT NULL,
    revision BIGINT NOT NULL DEFAULT 0,
    lease_until_ms BIGINT NULL,
    outcome LONGBLOB NULL,
    attempts INT NOT NULL,
    failure_retryable TINYINT NULL,
    failure_message TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    hits BIGINT NOT NULL,
    created_ms BIGINT NOT NULL,
    updated_ms BIGINT NOT NULL,
    expires_ms BIGINT NOT NULL,
    op_name TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    op_phase INT NULL,
    op_origin BIGINT NULL,
    op_state LONGBLOB NULL,
    PRIMARY KEY (scope, idem_key),
    KEY expires_ms_idx (expires_ms),
    KEY op_name_idx (op_name(64)),
    CONSTRAINT status_valid CHECK (status IN ('pending', 'completed', 'failed')),
    CONSTRAINT token_positive CHECK (token > 0),
    CONSTRAINT fingerprint_length CHECK (LENGTH(fingerprint) = 32),
    CONSTRAINT attempts_positive CHECK (attempts > 0),
    CONSTRAINT hits_non_negative CHECK (hits >= 0)
) ENGINE = InnoDB",
        t = name.quoted()
    )
}

pub(crate) async fn migrate(
    conn: &mut MySqlConnection,
    name: &TableName,
) -> Result<(), MySqlError> {
    sqlx::query(&create_table(name))
        .execute(&mut *conn)
        .await
        .map_err(
            |source| match source.as_database_error().and_then(|d| d.code()) {
                // No database selected.
                Some(c) if c == "3D000" => MySqlError::MissingTable {
                    table: name.table().to_owned(),
                },
                _ => MySqlError::Database { source },
            },
        )?;
    add_recovery_point_columns(conn, name).await?;
    add_operations_index(conn, name).await?;
    verify(conn, name).await
}

/// Adds the index of multi-step operations (`op_name_idx`), which the completer's listing
/// reads instead of the table, to a table created before it. Writes that leave `op_name` as it
/// is (every write of a one-step record) do not touch it. Another process adding it at the
/// same moment is fine.
async fn add_operations_index(
    conn: &mut MySqlConnection,
    name: &TableName,
) -> Result<(), MySqlError> {
    let indexed: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.STATISTICS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = 'op_name'
           AND SEQ_IN_INDEX = 1",
    )
    .bind(name.table())
    .fetch_one(&mut *conn)
    .await
    .map_err(|source| MySqlError::Database { source })?;
    if indexed > 0 {
        return Ok(());
    }
    let added = sqlx::query(&format!(
        "ALTER TABLE {} ADD INDEX op_name_idx (op_name(64))",
        name.quoted()
    ))
    .execute(&mut *conn)
    .await;
    match added {
        Ok(_) => Ok(()),
        // 1061: duplicate key name, added meanwhile by another process.
        Err(source)
            if source
                .as_database_error()
                .and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
                .is_some_and(|d| d.number() == 1061) =>
        {
            Ok(())
        }
        Err(source) => Err(MySqlError::Database { source }),
    }
}

/// Adds the recovery point columns a table created before them lacks (nullable, no default:
/// statements of an older crate, which never name them, keep working), once the table is
/// found to be ours otherwise. Another process adding them at the same moment is fine.
async fn add_recovery_point_columns(
    conn: &mut MySqlConnection,
    name: &TableName,
) -> Result<(), MySqlError> {
    let present: Vec<String> = sqlx::query_scalar(
        "SELECT LOWER(CAST(COLUMN_NAME AS CHAR)) FROM information_schema.COLUMNS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?
           AND COLUMN_NAME IN ('op_name', 'op_phase', 'op_origin', 'op_state')",
    )
    .bind(name.table())
    .fetch_all(&mut *conn)
    .await
    .map_err(|source| MySqlError::Database { source })?;
    if present.len() == RECOVERY_POINT_COLUMNS.len() {
        return Ok(());
    }
    // Only a table that is otherwise ours is changed: another table by that name is refused
    // as it is.
    verify_with(conn, name, false).await?;
    for (column, definition) in RECOVERY_POINT_COLUMNS {
        if present.iter().any(|p| p == column) {
            continue;
        }
        let added = sqlx::query(&format!(
            "ALTER TABLE {} ADD COLUMN {column} {definition}",
            name.quoted()
        ))
        .execute(&mut *conn)
        .await;
        match added {
            Ok(_) => {}
            // 1060: duplicate column name, added meanwhile by another process.
            Err(source)
                if source
                    .as_database_error()
                    .and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
                    .is_some_and(|d| d.number() == 1060) => {}
            Err(source) => return Err(MySqlError::Database { source }),
        }
    }
    Ok(())
}

pub(crate) async fn verify(conn: &mut MySqlConnection, name: &TableName) -> Result<(), MySqlError> {
    verify_with(conn, name, true).await
}

/// [`verify`], with or without the recovery point columns (a table created before them is
/// ours if it passes without them).
async fn verify_with(
    conn: &mut MySqlConnection,
    name: &TableName,
    recovery_points: bool,
) -> Result<(), MySqlError> {
    let table = name.table().to_owned();
    let shape = |detail: String| MySqlError::TableShape {
        table: table.clone(),
        detail,
    };
    let rows = sqlx::query(
        "SELECT CAST(COLUMN_NAME AS CHAR) AS name, CAST(DATA_TYPE AS CHAR) AS type,
                CAST(COLUMN_KEY AS CHAR) AS k, CAST(TABLE_TYPE AS CHAR) AS kind,
                CAST(ENGINE AS CHAR) AS engine
         FROM information_schema.COLUMNS c
         JOIN information_schema.TABLES t USING (TABLE_SCHEMA, TABLE_NAME)
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
    )
    .bind(name.table())
    .fetch_all(&mut *conn)
    .await
    .map_err(|source| MySqlError::Database { source })?;
    if rows.is_empty() {
        return Err(MySqlError::MissingTable { table });
    }
    let text = |row: &sqlx::mysql::MySqlRow, col: &str| -> Result<String, MySqlError> {
        row.try_get::<Option<String>, _>(col)
            .map(Option::unwrap_or_default)
            .map_err(|source| MySqlError::Database { source })
    };
    let mut found = Vec::new();
    for row in &rows {
        let kind = text(row, "kind")?;
        if kind != "BASE TABLE" {
            return Err(shape(format!("it is a {kind}, not a table")));
        }
        let engine = text(row, "engine")?;
        if !engine.eq_ignore_ascii_case("innodb") {
            return Err(shape(format!(
                "its engine is {engine}; the store needs InnoDB's transactions and row locks"
            )));
        }
        found.push((
            text(row, "name")?.to_ascii_lowercase(),
            text(row, "type")?.to_ascii_lowercase(),
        ));
    }
    let expected = COLUMNS.iter().filter(|(col, _)| {
        recovery_points || !RECOVERY_POINT_COLUMNS.iter().any(|(c, _)| c == col)
    });
    for (col, ty) in expected {
        match found.iter().find(|(name, _)| name == col) {
            None => return Err(shape(format!("column {col} is missing"))),
            Some((_, found)) if found != ty => {
                return Err(shape(format!("column {col} is {found}, expected {ty}")))
            }
            Some(_) => {}
        }
    }
    let key: Vec<String> = sqlx::query(
        "SELECT CAST(COLUMN_NAME AS CHAR) AS name FROM information_schema.STATISTICS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND INDEX_NAME = 'PRIMARY'
         ORDER BY SEQ_IN_INDEX",
    )
    .bind(name.table())
    .fetch_all(&mut *conn)
    .await
    .map_err(|source| MySqlError::Database { source })?
    .iter()
    .map(|row| text(row, "name").map(|n| n.to_ascii_lowercase()))
    .collect::<Result<_, _>>()?;
    if key != ["scope", "idem_key"] {
        return Err(shape(format!(
            "its primary key is ({}), expected (scope, idem_key)",
            key.join(", ")
        )));
    }
    let indexed: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.STATISTICS
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = 'expires_ms'
           AND SEQ_IN_INDEX = 1",
    )
    .bind(name.table())
    .fetch_one(&mut *conn)
    .await
    .map_err(|source| MySqlError::Database { source })?;
    if indexed == 0 {
        return Err(shape(
            "no index starts with expires_ms (the purge needs one)".to_owned(),
        ));
    }
    Ok(())
}
