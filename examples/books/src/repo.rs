//! The books table, in SQLite through rusqlite.

use crate::book::{Book, BookInput};
use rusqlite::{params, Connection, OptionalExtension};
use std::path::Path;
use std::sync::{Arc, Mutex};

/// What can go wrong in the books table.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RepoError {
    /// SQLite failed.
    #[error("books database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// The blocking task running the statement failed.
    #[error("books database task failed: {0}")]
    Task(String),
}

/// The result of a conditional update.
#[derive(Debug)]
pub enum Update {
    /// The row held the expected ETag and was replaced.
    Updated(Book),
    /// The row changed since the ETag was read; nothing was written.
    Stale,
    /// There is no such book.
    NotFound,
}

/// The books table. One connection behind a mutex: SQLite serialises writers anyway, and the
/// example favours clarity over throughput.
#[derive(Clone, Debug)]
pub struct BookRepo {
    conn: Arc<Mutex<Connection>>,
}

impl BookRepo {
    /// Opens (and creates) the table in the SQLite file at `path`, in WAL mode.
    pub fn open(path: &Path) -> Result<Self, RepoError> {
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS books (
                id TEXT PRIMARY KEY,
                title TEXT NOT NULL,
                author TEXT NOT NULL,
                year INTEGER NOT NULL,
                summary TEXT,
                etag TEXT NOT NULL,
                created_at INTEGER NOT NULL
            );",
        )?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    async fn with<T, F>(&self, f: F) -> Result<T, RepoError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, rusqlite::Error> + Send + 'static,
    {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let guard = conn
                .lock()
                .map_err(|_| RepoError::Task("connection mutex poisoned".into()))?;
            f(&guard).map_err(RepoError::from)
        })
        .await
        .map_err(|e| RepoError::Task(e.to_string()))?
    }

    /// Inserts a new book.
    pub async fn create(&self, input: BookInput) -> Result<Book, RepoError> {
        let book = Book::new(uuid::Uuid::new_v4().to_string(), input);
        let row = book.clone();
        self.with(move |c| {
            c.execute(
                "INSERT INTO books (id, title, author, year, summary, etag, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, unixepoch('subsec') * 1000)",
                params![
                    row.id,
                    row.input.title,
                    row.input.author,
                    row.input.year,
                    row.input.summary,
                    row.etag()
                ],
            )
        })
        .await?;
        Ok(book)
    }

    /// One book.
    pub async fn get(&self, id: &str) -> Result<Option<Book>, RepoError> {
        let id = id.to_owned();
        self.with(move |c| {
            c.query_row(
                "SELECT id, title, author, year, summary FROM books WHERE id = ?1",
                [id],
                row_to_book,
            )
            .optional()
        })
        .await
    }

    /// Every book, oldest first.
    pub async fn list(&self) -> Result<Vec<Book>, RepoError> {
        self.with(|c| {
            let mut stmt = c.prepare(
                "SELECT id, title, author, year, summary FROM books ORDER BY created_at, id",
            )?;
            let rows = stmt.query_map([], row_to_book)?;
            rows.collect()
        })
        .await
    }

    /// Replaces the book only if it still has ETag `expected`: the precondition and the write
    /// are one `UPDATE … WHERE id = ? AND etag = ?`, so no other write can land between them.
    pub async fn update_if(
        &self,
        id: &str,
        expected: &str,
        input: BookInput,
    ) -> Result<Update, RepoError> {
        let book = Book::new(id.to_owned(), input);
        let (id, expected, row) = (id.to_owned(), expected.to_owned(), book.clone());
        let changed = self
            .with(move |c| {
                let n = c.execute(
                    "UPDATE books SET title = ?1, author = ?2, year = ?3, summary = ?4, etag = ?5
                     WHERE id = ?6 AND etag = ?7",
                    params![
                        row.input.title,
                        row.input.author,
                        row.input.year,
                        row.input.summary,
                        row.etag(),
                        id,
                        expected
                    ],
                )?;
                if n == 1 {
                    return Ok(Some(true));
                }
                // Nothing written; tell "changed meanwhile" from "gone" for the answer.
                let exists = c
                    .query_row("SELECT 1 FROM books WHERE id = ?1", [id], |_| Ok(()))
                    .optional()?;
                Ok(exists.map(|()| false))
            })
            .await?;
        Ok(match changed {
            Some(true) => Update::Updated(book),
            Some(false) => Update::Stale,
            None => Update::NotFound,
        })
    }
}

fn row_to_book(r: &rusqlite::Row<'_>) -> Result<Book, rusqlite::Error> {
    Ok(Book::new(
        r.get(0)?,
        BookInput {
            title: r.get(1)?,
            author: r.get(2)?,
            year: r.get(3)?,
            summary: r.get(4)?,
        },
    ))
}
