//! Validated schema and table names.

use crate::PostgresError;
use std::fmt;

/// The longest name accepted for the table, in bytes. PostgreSQL truncates identifiers to 63
/// bytes; the store derives `<table>_expires_at_idx` and `<table>_migrations` from the table
/// name, and those must fit too.
pub const MAX_TABLE_NAME_LEN: usize = 47;

/// The longest schema name accepted, in bytes (PostgreSQL's identifier limit).
pub const MAX_SCHEMA_NAME_LEN: usize = 63;

/// A schema-qualified table name that is safe to splice into SQL.
///
/// Both parts must be plain identifiers: ASCII letters, digits and `_`, not starting with a
/// digit. They are always double-quoted in SQL, so case is kept as given. Schema names starting
/// with `pg_` are reserved by PostgreSQL and refused.
///
/// ```
/// use idempotency_postgres::TableName;
///
/// let t = TableName::new("billing", "idempotency_records")?;
/// assert_eq!(t.qualified(), r#""billing"."idempotency_records""#);
/// assert!(TableName::new("billing", "records; DROP TABLE users").is_err());
/// # Ok::<(), idempotency_postgres::PostgresError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct TableName {
    schema: String,
    table: String,
}

impl TableName {
    /// The schema used when none is given.
    pub const DEFAULT_SCHEMA: &'static str = "public";
    /// The table used when none is given.
    pub const DEFAULT_TABLE: &'static str = "idempotency_records";

    /// Validates a schema and a table name.
    pub fn new(schema: &str, table: &str) -> Result<Self, PostgresError> {
        check_identifier("schema", schema, MAX_SCHEMA_NAME_LEN)?;
        if schema.starts_with("pg_") {
            return Err(PostgresError::InvalidName {
                what: "schema",
                name: schema.to_owned(),
                reason: "names starting with pg_ are reserved by PostgreSQL".into(),
            });
        }
        check_identifier("table", table, MAX_TABLE_NAME_LEN)?;
        Ok(Self {
            schema: schema.to_owned(),
            table: table.to_owned(),
        })
    }

    /// The schema name, unquoted.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The table name, unquoted.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// `"schema"."table"`, ready for SQL.
    pub fn qualified(&self) -> String {
        format!(r#""{}"."{}""#, self.schema, self.table)
    }

    /// `"schema"`, ready for SQL.
    pub(crate) fn quoted_schema(&self) -> String {
        format!(r#""{}""#, self.schema)
    }

    /// A name derived from the table's (`<table>_<suffix>`), unquoted.
    pub(crate) fn derived(&self, suffix: &str) -> String {
        format!("{}_{suffix}", self.table)
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self {
            schema: Self::DEFAULT_SCHEMA.to_owned(),
            table: Self::DEFAULT_TABLE.to_owned(),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.qualified())
    }
}

fn check_identifier(what: &'static str, name: &str, max: usize) -> Result<(), PostgresError> {
    let fail = |reason: String| {
        Err(PostgresError::InvalidName {
            what,
            name: name.to_owned(),
            reason,
        })
    };
    let Some(first) = name.chars().next() else {
        return fail("it is empty".into());
    };
    if name.len() > max {
        return fail(format!("it is {} bytes long (at most {max})", name.len()));
    }
    if first.is_ascii_digit() {
        return fail("it starts with a digit".into());
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_'))
    {
        return fail(format!(
            "{c:?} is not allowed (use ASCII letters, digits and _)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_identifiers() {
        let t = TableName::new("app_1", "Idem_Records").unwrap();
        assert_eq!(t.qualified(), "\"app_1\".\"Idem_Records\"");
        assert_eq!(t.derived("migrations"), "Idem_Records_migrations");
        assert_eq!(
            TableName::default().qualified(),
            "\"public\".\"idempotency_records\""
        );
        let longest = "t".repeat(MAX_TABLE_NAME_LEN);
        assert!(TableName::new("s", &longest).is_ok());
        // Derived names still fit PostgreSQL's 63-byte identifiers.
        assert!(
            TableName::new("s", &longest)
                .unwrap()
                .derived("expires_at_idx")
                .len()
                <= 63
        );
    }

    #[test]
    fn refuses_anything_else() {
        for (schema, table) in [
            ("", "t"),
            ("s", ""),
            ("1s", "t"),
            ("s", "9t"),
            ("s", "t\"; drop table x; --"),
            ("s", "a b"),
            ("s", "a-b"),
            ("s", "é"),
            ("s.x", "t"),
            ("pg_catalog", "t"),
            ("s", &"t".repeat(MAX_TABLE_NAME_LEN + 1)),
            (&"s".repeat(64), "t"),
        ] {
            let err = TableName::new(schema, table).unwrap_err();
            assert!(
                matches!(err, PostgresError::InvalidName { .. }),
                "{schema:?}.{table:?}: {err}"
            );
        }
    }
}
