//! Migrations shipped with the crate, and the table shape check.
//!
//! sqlx's own migrator keeps one `_sqlx_migrations` table per database and cannot template
//! names, so a store with a configurable schema and table tracks its own migrations in
//! `<schema>.<table>_migrations`. `migrate()` runs them in one transaction under an advisory
//! lock, so several app instances starting at once apply each migration exactly once.

use crate::error::is_serialization_failure;
use crate::{PostgresError, TableName};
use sqlx::{Executor, PgConnection, Row};

/// One migration: a version, a description and SQL with `{records}`/`{expires_index}`
/// placeholders.
struct Migration {
    version: i32,
    description: &'static str,
    sql: &'static str,
}

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        description: "create records table and expiry index",
        sql: include_str!("../migrations/0001_create_records.sql"),
    },
    Migration {
        version: 2,
        description: "check constraints on fingerprint, attempts and hits",
        sql: include_str!("../migrations/0002_check_constraints.sql"),
    },
    Migration {
        version: 3,
        description: "recovery points of multi-step operations",
        sql: include_str!("../migrations/0003_recovery_points.sql"),
    },
    Migration {
        version: 4,
        description: "index of open multi-step operations",
        sql: include_str!("../migrations/0004_abandoned_index.sql"),
    },
];

/// The newest migration this crate knows.
pub(crate) const LATEST_VERSION: i32 = 4;

fn render(sql: &str, name: &TableName) -> String {
    sql.replace("{records}", &name.qualified())
        .replace(
            "{expires_index}",
            &format!("\"{}\"", name.derived("expires_at_idx")),
        )
        .replace(
            "{abandoned_index}",
            &format!("\"{}\"", name.derived("abandoned_idx")),
        )
}

fn db(source: sqlx::Error) -> PostgresError {
    PostgresError::Database { source }
}

/// Applies the missing migrations and checks the result, in one transaction on `conn`.
pub(crate) async fn migrate(
    conn: &mut PgConnection,
    name: &TableName,
) -> Result<(), PostgresError> {
    // A concurrent `migrate()` at SERIALIZABLE may fail to serialize; it is a fresh
    // transaction every time, so run it again.
    let mut attempt = 0;
    loop {
        match migrate_once(conn, name).await {
            Err(PostgresError::Database { source })
                if is_serialization_failure(&source) && attempt < 5 =>
            {
                attempt += 1;
            }
            other => return other,
        }
    }
}

async fn migrate_once(conn: &mut PgConnection, name: &TableName) -> Result<(), PostgresError> {
    let qualified = name.qualified();
    let migrations_table = format!(
        "{}.\"{}\"",
        name.quoted_schema(),
        name.derived("migrations")
    );
    let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(db)?;
    apply(&mut tx, name, &qualified, &migrations_table).await?;
    tx.commit().await.map_err(db)
}

/// The body of [`migrate_once`], on the open transaction. A plain `&mut PgConnection` (rather
/// than the `Transaction`) keeps the future `Send` for any lifetime, so `migrate()` can run in
/// a spawned task.
async fn apply(
    tx: &mut PgConnection,
    name: &TableName,
    qualified: &str,
    migrations_table: &str,
) -> Result<(), PostgresError> {
    let migrate_err = |detail: String, source: Option<sqlx::Error>| PostgresError::Migrate {
        table: qualified.to_owned(),
        detail,
        source,
    };
    // READ COMMITTED whatever the session's default: every statement after the lock must see
    // what the previous holder of the lock committed (at REPEATABLE READ the snapshot would be
    // taken before the lock is granted).
    tx.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        .await
        .map_err(db)?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("idempotency-postgres migrate {qualified}"))
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    // CREATE SCHEMA IF NOT EXISTS needs the CREATE privilege on the database even when the
    // schema exists, so look first.
    let schema_exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(name.schema())
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
    if !schema_exists {
        let create = format!("CREATE SCHEMA IF NOT EXISTS {}", name.quoted_schema());
        tx.execute(create.as_str())
            .await
            .map_err(|e| migrate_err("cannot create the schema".into(), Some(e)))?;
    }
    let create = format!(
        "CREATE TABLE IF NOT EXISTS {migrations_table} (
            version     integer     PRIMARY KEY,
            description text        NOT NULL,
            applied_at  timestamptz NOT NULL DEFAULT now()
        )"
    );
    tx.execute(create.as_str())
        .await
        .map_err(|e| migrate_err("cannot create the migrations table".into(), Some(e)))?;
    let applied: Vec<i32> = sqlx::query_scalar(&format!(
        "SELECT version FROM {migrations_table} ORDER BY version"
    ))
    .fetch_all(&mut *tx)
    .await
    .map_err(db)?;
    if let Some(newest) = applied
        .iter()
        .copied()
        .max()
        .filter(|v| *v > LATEST_VERSION)
    {
        return Err(PostgresError::SchemaTooNew {
            table: name.qualified(),
            found: newest.into(),
            supported: LATEST_VERSION.into(),
        });
    }
    if applied.is_empty() {
        // No migration recorded but a table by that name exists: someone else's table, or
        // one created by hand. Adopt it only if it has our shape.
        match verify(&mut *tx, name).await {
            Ok(()) | Err(PostgresError::MissingTable { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    for m in MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)) {
        // Sent as a simple query: a migration file holds several statements.
        let sql = render(m.sql, name);
        tx.execute(sql.as_str()).await.map_err(|e| {
            migrate_err(
                format!("migration {} ({}) failed", m.version, m.description),
                Some(e),
            )
        })?;
        sqlx::query(&format!(
            "INSERT INTO {migrations_table} (version, description) VALUES ($1, $2)"
        ))
        .bind(m.version)
        .bind(m.description)
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    }
    // A table of another shape that happened to have our name would have been left alone by
    // CREATE TABLE IF NOT EXISTS: refuse it, and roll back.
    verify(tx, name).await
}

/// Expected columns: name, `format_type` of the type.
const COLUMNS: &[(&str, &str)] = &[
    ("scope", "text"),
    ("key", "text"),
    ("fingerprint", "bytea"),
    ("status", "text"),
    ("token", "bigint"),
    ("lease_until", "timestamp with time zone"),
    ("outcome", "bytea"),
    ("attempts", "integer"),
    ("failure_retryable", "boolean"),
    ("failure_message", "text"),
    ("hits", "bigint"),
    ("created_at", "timestamp with time zone"),
    ("updated_at", "timestamp with time zone"),
    ("expires_at", "timestamp with time zone"),
    ("op_name", "text"),
    ("op_phase", "integer"),
    ("op_origin", "bigint"),
    ("op_state", "bytea"),
];

/// Checks that the table exists and has the shape the statements need.
pub(crate) async fn verify(conn: &mut PgConnection, name: &TableName) -> Result<(), PostgresError> {
    let table = name.qualified();
    let kind: Option<String> = sqlx::query_scalar(
        "SELECT c.relkind::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND c.relname = $2",
    )
    .bind(name.schema())
    .bind(name.table())
    .fetch_optional(&mut *conn)
    .await
    .map_err(db)?;
    let shape = |detail: String| PostgresError::TableShape {
        table: table.clone(),
        detail,
    };
    match kind.as_deref() {
        None => return Err(PostgresError::MissingTable { table }),
        Some("r" | "p") => {}
        Some(other) => return Err(shape(format!("it is not a table (relkind {other})"))),
    }
    let rows = sqlx::query(
        "SELECT a.attname::text AS name, format_type(a.atttypid, a.atttypmod) AS type,
                a.attnotnull AS not_null, a.atthasdef AS has_default
         FROM pg_attribute a
         JOIN pg_class c ON c.oid = a.attrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped",
    )
    .bind(name.schema())
    .bind(name.table())
    .fetch_all(&mut *conn)
    .await
    .map_err(db)?;
    let mut problems = Vec::new();
    for row in &rows {
        let col: String = row.try_get("name").map_err(db)?;
        let ty: String = row.try_get("type").map_err(db)?;
        let not_null: bool = row.try_get("not_null").map_err(db)?;
        let has_default: bool = row.try_get("has_default").map_err(db)?;
        match COLUMNS.iter().find(|(n, _)| *n == col) {
            Some((_, want)) if *want != ty => {
                problems.push(format!("column {col} is {ty}, expected {want}"));
            }
            Some(_) => {}
            None if not_null && !has_default => {
                problems.push(format!(
                    "unexpected NOT NULL column {col} without a default"
                ));
            }
            None => {}
        }
    }
    for (col, want) in COLUMNS {
        if !rows
            .iter()
            .any(|r| r.try_get::<String, _>("name").ok().as_deref() == Some(*col))
        {
            problems.push(format!("column {col} ({want}) is missing"));
        }
    }
    let unique_on_id: bool = sqlx::query_scalar(
        "SELECT EXISTS (
            SELECT 1 FROM pg_index i
            JOIN pg_class c ON c.oid = i.indrelid
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = $1 AND c.relname = $2 AND i.indisunique AND i.indpred IS NULL
              AND i.indnkeyatts = 2
              AND (SELECT array_agg(a.attname::text ORDER BY a.attname)
                   FROM pg_attribute a
                   WHERE a.attrelid = c.oid AND a.attnum = ANY(i.indkey)) = ARRAY['key', 'scope'])",
    )
    .bind(name.schema())
    .bind(name.table())
    .fetch_one(&mut *conn)
    .await
    .map_err(db)?;
    if !unique_on_id {
        problems.push("no primary key or unique index on (scope, key)".into());
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(shape(problems.join("; ")))
    }
}
