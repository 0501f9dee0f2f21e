//! The validated table name.

use crate::MySqlError;
use std::fmt;

/// The longest table name accepted, in bytes: MySQL's and MariaDB's identifier limit.
pub const MAX_TABLE_NAME_LEN: usize = 64;

/// A table name that is safe to splice into SQL.
///
/// ASCII letters, digits and `_`, not starting with a digit, at most
/// [`MAX_TABLE_NAME_LEN`] bytes. It is always back-quoted in SQL and lives in the database the
/// connection URL names.
///
/// ```
/// use idempotency_mysql::TableName;
///
/// let t = TableName::new("idempotency_records")?;
/// assert_eq!(t.quoted(), "`idempotency_records`");
/// assert!(TableName::new("records; DROP TABLE users").is_err());
/// # Ok::<(), idempotency_mysql::MySqlError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct TableName {
    table: String,
}

impl TableName {
    /// The table used when none is given.
    pub const DEFAULT_TABLE: &'static str = "idempotency_records";

    /// Validates a table name.
    pub fn new(table: &str) -> Result<Self, MySqlError> {
        let bad = |reason: &str| MySqlError::InvalidName {
            what: "table",
            name: table.to_owned(),
            reason: reason.to_owned(),
        };
        if table.is_empty() {
            return Err(bad("it is empty"));
        }
        if table.len() > MAX_TABLE_NAME_LEN {
            return Err(bad(&format!(
                "it is {} bytes long, more than {MAX_TABLE_NAME_LEN}",
                table.len()
            )));
        }
        if table.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(bad("it starts with a digit"));
        }
        if let Some(c) = table
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '_'))
        {
            return Err(bad(&format!(
                "{c:?} is not allowed (only ASCII letters, digits and _)"
            )));
        }
        Ok(Self {
            table: table.to_owned(),
        })
    }

    /// The table name, unquoted.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// `` `table` ``, ready for SQL.
    pub fn quoted(&self) -> String {
        format!("`{}`", self.table)
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self {
            table: Self::DEFAULT_TABLE.to_owned(),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.table)
    }
}
