//! The books table: in SQLite through rusqlite (the default), or in Postgres or MariaDB through
//! sqlx when the idempotency records are there too.
//!
//! Each row has a `version` that every update increments. The ETag is computed from the
//! representation, and a conditional update compares the version it read in the same request
//! (`UPDATE … WHERE id = ? AND version = ?`): like is compared with like, so a change to the
//! representation's format, or a row written by another program, never makes every PATCH fail.

use crate::book::{Book, BookInput};
use crate::dynamo::DynamoBooks;
use bytes::Bytes;
use http::Response;
use idempotency_core::Error;
use idempotency_dynamodb::DynamoTransaction;
use idempotency_mysql::sqlx::mysql::MySqlRow;
use idempotency_mysql::sqlx::{MySqlConnection, MySqlPool};
use idempotency_mysql::{MySqlStore, TableName as MySqlTableName};
use idempotency_postgres::sqlx::{self, PgConnection, PgPool, Row as _};
use idempotency_postgres::PostgresStore;
use idempotency_sqlite::{SqliteStore, SqliteTransaction};
use idempotency_tower::ClaimedKey;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// What can go wrong in the books table.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RepoError {
    /// SQLite failed.
    #[error("books database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// Postgres failed.
    #[error("books database error: {0}")]
    Postgres(#[from] sqlx::Error),
    /// MariaDB failed. (The same `sqlx::Error` type as Postgres's, so not converted by `?`:
    /// the MariaDB paths map their errors here explicitly.)
    #[error("books database error: {0}")]
    Mysql(sqlx::Error),
    /// DynamoDB failed, or a book item is not what the service writes.
    #[error("books database error: {0}")]
    Dynamo(String),
    /// The blocking task running the statement failed.
    #[error("books database task failed: {0}")]
    Task(String),
}

/// The result of a conditional update.
#[derive(Debug)]
pub enum Update {
    /// The row still had the expected version and was replaced.
    Updated(Book),
    /// The row changed since it was read; nothing was written.
    Stale,
    /// There is no such book.
    NotFound,
}

/// A book as stored: the book and the version its row is at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versioned {
    /// The book.
    pub book: Book,
    /// Incremented by every update.
    pub version: i64,
}

#[derive(Clone, Debug)]
enum Backend {
    Sqlite {
        conn: Arc<Mutex<Connection>>,
        /// The idempotency store, when its records are in the same file.
        records: Option<SqliteStore>,
    },
    Postgres {
        pool: PgPool,
        /// The quoted, schema-qualified table name.
        table: String,
        records: PostgresStore,
    },
    Mysql {
        pool: MySqlPool,
        /// The back-quoted table name, in the database of the pool's URL.
        table: String,
        records: MySqlStore,
    },
    Dynamo(DynamoBooks),
}

/// The books table.
#[derive(Clone, Debug)]
pub struct BookRepo {
    backend: Backend,
}

const SQLITE_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS books (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    author TEXT NOT NULL,
    year INTEGER NOT NULL,
    summary TEXT,
    version INTEGER NOT NULL DEFAULT 1,
    created_at INTEGER NOT NULL DEFAULT (unixepoch('subsec') * 1000)
);";

impl BookRepo {
    /// Opens (and creates) the table in the SQLite file at `path`, in WAL mode.
    /// With `records`, an idempotency store on the same file, creates complete their key in
    /// the book's own transaction ([`BookRepo::create_completing`]).
    ///
    /// A table from an earlier version of the example (an `etag` column, no `version`) is
    /// converted in place.
    pub fn open_sqlite(path: &Path, records: Option<SqliteStore>) -> Result<Self, RepoError> {
        let mut conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let has_etag: bool = tx
            .query_row(
                "SELECT count(*) FROM pragma_table_info('books') WHERE name = 'etag'",
                [],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n > 0)?;
        if has_etag {
            tx.execute_batch(&format!(
                "ALTER TABLE books RENAME TO books_before_versions;
                 {SQLITE_SCHEMA}
                 INSERT INTO books (id, title, author, year, summary, version, created_at)
                     SELECT id, title, author, year, summary, 1, created_at
                     FROM books_before_versions;
                 DROP TABLE books_before_versions;"
            ))?;
        } else {
            tx.execute_batch(SQLITE_SCHEMA)?;
        }
        tx.commit()?;
        Ok(Self {
            backend: Backend::Sqlite {
                conn: Arc::new(Mutex::new(conn)),
                records,
            },
        })
    }

    /// Creates the table `books` in the schema of `records`' table on its server, and keeps
    /// the books there: creates complete their key in the book's own transaction.
    pub async fn open_postgres(records: PostgresStore) -> Result<Self, RepoError> {
        let name = records.table_name();
        let table = format!("\"{}\".books", name.schema().replace('"', "\"\""));
        let pool = records.pool().clone();
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                id TEXT PRIMARY KEY,
                title TEXT NOT NULL,
                author TEXT NOT NULL,
                year INTEGER NOT NULL,
                summary TEXT,
                version BIGINT NOT NULL DEFAULT 1,
                created_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
            )"
        ))
        .execute(&pool)
        .await?;
        Ok(Self {
            backend: Backend::Postgres {
                pool,
                table,
                records,
            },
        })
    }

    /// Creates the table `table` in the database of `records`' pool (the database its URL
    /// names, where its records' table is), and keeps the books there: creates complete their
    /// key in the book's own transaction.
    ///
    /// Ids are bytes (`VARBINARY`), compared exactly as in SQLite and Postgres: no collation
    /// folds case or ignores trailing spaces.
    pub async fn open_mysql(
        records: MySqlStore,
        table: &MySqlTableName,
    ) -> Result<Self, RepoError> {
        let table = table.quoted();
        let pool = records.pool().clone();
        sqlx::query(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                id VARBINARY(255) NOT NULL PRIMARY KEY,
                title TEXT CHARACTER SET utf8mb4 NOT NULL,
                author TEXT CHARACTER SET utf8mb4 NOT NULL,
                year INT NOT NULL,
                summary TEXT CHARACTER SET utf8mb4 NULL,
                version BIGINT NOT NULL DEFAULT 1,
                created_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
            ) ENGINE = InnoDB"
        ))
        .execute(&pool)
        .await
        .map_err(RepoError::Mysql)?;
        Ok(Self {
            backend: Backend::Mysql {
                pool,
                table,
                records,
            },
        })
    }

    /// Creates the table `table` (key `id`) on the DynamoDB of `records` when it is missing,
    /// and keeps the books there: creates complete their key in the book's own
    /// `TransactWriteItems`.
    pub async fn open_dynamodb(
        records: idempotency_dynamodb::DynamoStore,
        table: String,
    ) -> Result<Self, RepoError> {
        Ok(Self {
            backend: Backend::Dynamo(DynamoBooks::open(records, table).await?),
        })
    }

    /// Whether the idempotency records live in the books' database, so that a create and its
    /// completion can commit together.
    pub fn completes_in_transaction(&self) -> bool {
        match &self.backend {
            Backend::Sqlite { records, .. } => records.is_some(),
            Backend::Postgres { .. } | Backend::Mysql { .. } | Backend::Dynamo(_) => true,
        }
    }

    async fn sqlite<T, F>(conn: &Arc<Mutex<Connection>>, f: F) -> Result<T, RepoError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, RepoError> + Send + 'static,
    {
        let conn = conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = conn
                .lock()
                .map_err(|_| RepoError::Task("connection mutex poisoned".into()))?;
            f(&mut guard)
        })
        .await
        .map_err(|e| RepoError::Task(e.to_string()))?
    }

    /// Inserts `book`.
    pub async fn create(&self, book: &Book) -> Result<(), RepoError> {
        match &self.backend {
            Backend::Sqlite { conn, .. } => {
                let row = book.clone();
                Self::sqlite(conn, move |c| {
                    insert_sqlite(c, &row)?;
                    Ok(())
                })
                .await
            }
            Backend::Postgres { pool, table, .. } => {
                let mut conn = pool.acquire().await?;
                Ok(insert_postgres(&mut conn, table, book).await?)
            }
            Backend::Mysql { pool, table, .. } => {
                let mut conn = pool.acquire().await.map_err(RepoError::Mysql)?;
                insert_mysql(&mut conn, table, book)
                    .await
                    .map_err(RepoError::Mysql)
            }
            Backend::Dynamo(books) => books.create(book).await,
        }
    }

    /// Inserts `book` and completes the request's key with the response `answer` builds, in
    /// **one transaction** ([`ClaimedKey::run_in_transaction`]): both commit or neither does,
    /// and the key is settled with the layer whatever the end (a conflict runs the transaction
    /// again; a fenced completion answers `409`; a rollback releases the key). Returns the
    /// response to send. Needs [`BookRepo::completes_in_transaction`].
    pub async fn create_completing(
        &self,
        book: &Book,
        claim: &ClaimedKey,
        answer: fn(&Book) -> Response<Bytes>,
    ) -> Result<Response<Bytes>, RepoError> {
        Ok(match &self.backend {
            Backend::Sqlite { records, .. } => {
                let Some(records) = records else {
                    return Err(RepoError::Task(
                        "the idempotency records are not in the books' database".into(),
                    ));
                };
                claim
                    .run_in_transaction(records, |tx: &mut SqliteTransaction| {
                        let row = book.clone();
                        Box::pin(async move {
                            let written = row.clone();
                            tx.run(move |t| insert_sqlite(t, &written))
                                .await?
                                .map_err(|e| Error::backend(false, e))?;
                            Ok(answer(&row))
                        })
                    })
                    .await
            }
            Backend::Postgres { table, records, .. } => {
                claim
                    .run_in_transaction(records, |tx: &mut PgConnection| {
                        let (table, row) = (table.clone(), book.clone());
                        Box::pin(async move {
                            insert_postgres(tx, &table, &row).await?;
                            Ok(answer(&row))
                        })
                    })
                    .await
            }
            Backend::Mysql { table, records, .. } => {
                claim
                    .run_in_transaction(records, |tx: &mut MySqlConnection| {
                        let (table, row) = (table.clone(), book.clone());
                        Box::pin(async move {
                            insert_mysql(tx, &table, &row).await?;
                            Ok(answer(&row))
                        })
                    })
                    .await
            }
            Backend::Dynamo(books) => {
                claim
                    .run_in_transaction(books.records(), |tx: &mut DynamoTransaction| {
                        let (put, row) = (books.put(book), book.clone());
                        Box::pin(async move {
                            tx.put(put.map_err(|e| Error::backend(false, e))?)?;
                            Ok(answer(&row))
                        })
                    })
                    .await
            }
        })
    }

    /// One book.
    pub async fn get(&self, id: &str) -> Result<Option<Versioned>, RepoError> {
        match &self.backend {
            Backend::Sqlite { conn, .. } => {
                let id = id.to_owned();
                Self::sqlite(conn, move |c| {
                    Ok(c.query_row(
                        "SELECT id, title, author, year, summary, version FROM books WHERE id = ?1",
                        [id],
                        sqlite_row,
                    )
                    .optional()?)
                })
                .await
            }
            Backend::Postgres { pool, table, .. } => {
                let row = sqlx::query(&format!(
                    "SELECT id, title, author, year, summary, version FROM {table} WHERE id = $1"
                ))
                .bind(id)
                .fetch_optional(pool)
                .await?;
                row.map(|r| postgres_row(&r)).transpose()
            }
            Backend::Mysql { pool, table, .. } => {
                let row = sqlx::query(&format!(
                    "SELECT id, title, author, year, summary, version FROM {table} WHERE id = ?"
                ))
                .bind(id)
                .fetch_optional(pool)
                .await
                .map_err(RepoError::Mysql)?;
                row.map(|r| mysql_row(&r))
                    .transpose()
                    .map_err(RepoError::Mysql)
            }
            Backend::Dynamo(books) => books.get(id).await,
        }
    }

    /// Every book, oldest first.
    pub async fn list(&self) -> Result<Vec<Book>, RepoError> {
        match &self.backend {
            Backend::Sqlite { conn, .. } => {
                Self::sqlite(conn, |c| {
                    let mut stmt = c.prepare(
                        "SELECT id, title, author, year, summary, version FROM books
                         ORDER BY created_at, id",
                    )?;
                    let rows = stmt.query_map([], sqlite_row)?;
                    Ok(rows.map(|r| r.map(|v| v.book)).collect::<Result<_, _>>()?)
                })
                .await
            }
            Backend::Postgres { pool, table, .. } => {
                let rows = sqlx::query(&format!(
                    "SELECT id, title, author, year, summary, version FROM {table}
                     ORDER BY created_at, id"
                ))
                .fetch_all(pool)
                .await?;
                rows.iter()
                    .map(|r| postgres_row(r).map(|v| v.book))
                    .collect()
            }
            Backend::Mysql { pool, table, .. } => {
                let rows = sqlx::query(&format!(
                    "SELECT id, title, author, year, summary, version FROM {table}
                     ORDER BY created_at, id"
                ))
                .fetch_all(pool)
                .await
                .map_err(RepoError::Mysql)?;
                rows.iter()
                    .map(|r| mysql_row(r).map(|v| v.book).map_err(RepoError::Mysql))
                    .collect()
            }
            Backend::Dynamo(books) => books.list().await,
        }
    }

    /// Replaces the book only if its row is still at `version`: the precondition and the
    /// write are one `UPDATE … WHERE id = ? AND version = ?`, so no other write can land
    /// between them.
    pub async fn update_if(
        &self,
        id: &str,
        version: i64,
        input: BookInput,
    ) -> Result<Update, RepoError> {
        let book = Book::new(id.to_owned(), input);
        let changed = match &self.backend {
            Backend::Sqlite { conn, .. } => {
                let row = book.clone();
                Self::sqlite(conn, move |c| {
                    let n = c.execute(
                        "UPDATE books SET title = ?1, author = ?2, year = ?3, summary = ?4,
                             version = version + 1
                         WHERE id = ?5 AND version = ?6",
                        params![
                            row.input.title,
                            row.input.author,
                            row.input.year,
                            row.input.summary,
                            row.id,
                            version
                        ],
                    )?;
                    Ok(n == 1)
                })
                .await?
            }
            Backend::Postgres { pool, table, .. } => {
                let done = sqlx::query(&format!(
                    "UPDATE {table} SET title = $1, author = $2, year = $3, summary = $4,
                         version = version + 1
                     WHERE id = $5 AND version = $6"
                ))
                .bind(&book.input.title)
                .bind(&book.input.author)
                .bind(book.input.year)
                .bind(&book.input.summary)
                .bind(&book.id)
                .bind(version)
                .execute(pool)
                .await?;
                done.rows_affected() == 1
            }
            Backend::Mysql { pool, table, .. } => {
                // `version + 1` changes the row whenever it matches, so the affected-row count
                // is the match count whether or not the client sets `CLIENT_FOUND_ROWS`.
                let done = sqlx::query(&format!(
                    "UPDATE {table} SET title = ?, author = ?, year = ?, summary = ?,
                         version = version + 1
                     WHERE id = ? AND version = ?"
                ))
                .bind(&book.input.title)
                .bind(&book.input.author)
                .bind(book.input.year)
                .bind(&book.input.summary)
                .bind(&book.id)
                .bind(version)
                .execute(pool)
                .await
                .map_err(RepoError::Mysql)?;
                done.rows_affected() == 1
            }
            Backend::Dynamo(books) => books.update_if(&book, version).await?,
        };
        if changed {
            return Ok(Update::Updated(book));
        }
        // Nothing written; tell "changed meanwhile" from "gone" for the answer.
        Ok(match self.get(id).await? {
            Some(_) => Update::Stale,
            None => Update::NotFound,
        })
    }
}

fn insert_sqlite(c: &Connection, book: &Book) -> Result<(), rusqlite::Error> {
    c.execute(
        "INSERT INTO books (id, title, author, year, summary) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![
            book.id,
            book.input.title,
            book.input.author,
            book.input.year,
            book.input.summary
        ],
    )?;
    Ok(())
}

async fn insert_postgres(
    conn: &mut sqlx::PgConnection,
    table: &str,
    book: &Book,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO {table} (id, title, author, year, summary) VALUES ($1, $2, $3, $4, $5)"
    ))
    .bind(&book.id)
    .bind(&book.input.title)
    .bind(&book.input.author)
    .bind(book.input.year)
    .bind(&book.input.summary)
    .execute(conn)
    .await?;
    Ok(())
}

async fn insert_mysql(
    conn: &mut MySqlConnection,
    table: &str,
    book: &Book,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO {table} (id, title, author, year, summary) VALUES (?, ?, ?, ?, ?)"
    ))
    .bind(&book.id)
    .bind(&book.input.title)
    .bind(&book.input.author)
    .bind(book.input.year)
    .bind(&book.input.summary)
    .execute(conn)
    .await?;
    Ok(())
}

fn sqlite_row(r: &rusqlite::Row<'_>) -> Result<Versioned, rusqlite::Error> {
    Ok(Versioned {
        book: Book::new(
            r.get(0)?,
            BookInput {
                title: r.get(1)?,
                author: r.get(2)?,
                year: r.get(3)?,
                summary: r.get(4)?,
            },
        ),
        version: r.get(5)?,
    })
}

fn postgres_row(r: &sqlx::postgres::PgRow) -> Result<Versioned, RepoError> {
    Ok(Versioned {
        book: Book::new(
            r.try_get("id")?,
            BookInput {
                title: r.try_get("title")?,
                author: r.try_get("author")?,
                year: r.try_get("year")?,
                summary: r.try_get("summary")?,
            },
        ),
        version: r.try_get("version")?,
    })
}

fn mysql_row(r: &MySqlRow) -> Result<Versioned, sqlx::Error> {
    // The id column is VARBINARY: bytes, which this service only ever writes as UTF-8.
    let id: Vec<u8> = r.try_get("id")?;
    let id = String::from_utf8(id).map_err(|e| sqlx::Error::ColumnDecode {
        index: "\"id\"".to_owned(),
        source: Box::new(e),
    })?;
    Ok(Versioned {
        book: Book::new(
            id,
            BookInput {
                title: r.try_get("title")?,
                author: r.try_get("author")?,
                year: r.try_get("year")?,
                summary: r.try_get("summary")?,
            },
        ),
        version: r.try_get("version")?,
    })
}
