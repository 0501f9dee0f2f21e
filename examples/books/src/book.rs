//! The book resource: its writable members, validation and representation.

use garde::Validate;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// A book's writable members, as the API spells them. Create and update share these rules.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct BookInput {
    /// 1 to 200 characters.
    #[garde(length(chars, min = 1, max = 200), custom(not_blank))]
    pub title: String,
    /// 1 to 200 characters.
    #[garde(length(chars, min = 1, max = 200), custom(not_blank))]
    pub author: String,
    /// Publication year, -3000 to 2100.
    #[garde(range(min = -3000, max = 2100))]
    pub year: i32,
    /// Up to 2000 characters; absent when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[garde(inner(length(chars, max = 2000)))]
    pub summary: Option<String>,
}

fn not_blank(value: &str, _: &()) -> garde::Result {
    if value.trim().is_empty() {
        return Err(garde::Error::new("must not be blank"));
    }
    Ok(())
}

/// A stored book.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Book {
    /// Its id.
    pub id: String,
    /// Its writable members.
    pub input: BookInput,
}

/// One failed rule, with the JSON Pointer of the member that broke it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Issue {
    /// JSON Pointer into the (patched) book.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl Book {
    /// A book with `id`.
    pub fn new(id: String, input: BookInput) -> Self {
        Self { id, input }
    }

    /// `{"book": {...}}`, the representation GET, POST and PATCH answer with.
    pub fn representation(&self) -> Value {
        let mut book = self.writable();
        book.insert("id".into(), Value::String(self.id.clone()));
        json!({ "book": book })
    }

    /// The writable members, with unset ones left out: the target a merge patch applies to.
    pub fn writable(&self) -> Map<String, Value> {
        match serde_json::to_value(&self.input) {
            Ok(Value::Object(map)) => map,
            _ => Map::new(),
        }
    }

    /// A strong ETag: a SHA-256 of the representation, so equal bytes mean equal tags.
    pub fn etag(&self) -> String {
        let bytes = self.representation().to_string();
        let digest = Sha256::digest(bytes.as_bytes());
        format!("\"{}\"", &hex::encode(digest)[..32])
    }
}

const REQUIRED: [&str; 3] = ["title", "author", "year"];
const MEMBERS: [&str; 4] = ["title", "author", "year", "summary"];

/// Checks a JSON value against the create rules: an object, the required members present,
/// every member of the right type, no unknown members, and every rule of [`BookInput`].
/// Every issue is reported with its path.
pub fn validate(value: &Value) -> Result<BookInput, Vec<Issue>> {
    let Some(object) = value.as_object() else {
        return Err(vec![Issue {
            path: String::new(),
            message: "a book is a JSON object".into(),
        }]);
    };
    let mut issues: Vec<Issue> = REQUIRED
        .iter()
        .filter(|f| object.get(**f).is_none_or(Value::is_null))
        .map(|f| Issue {
            path: format!("/{f}"),
            message: "is required".into(),
        })
        .collect();
    issues.extend(
        object
            .keys()
            .filter(|k| !MEMBERS.contains(&k.as_str()))
            .map(|k| Issue {
                path: format!("/{}", k.replace('~', "~0").replace('/', "~1")),
                message: "is not a member of a book".into(),
            }),
    );
    if !issues.is_empty() {
        return Err(issues);
    }
    let input: BookInput = match serde_path_to_error::deserialize(value) {
        Ok(input) => input,
        Err(e) => {
            let path = e.path().to_string();
            let pointer = if path == "." {
                String::new()
            } else {
                format!("/{}", path.replace('.', "/"))
            };
            return Err(vec![Issue {
                path: pointer,
                message: e.into_inner().to_string(),
            }]);
        }
    };
    if let Err(report) = input.validate() {
        issues.extend(report.iter().map(|(path, error)| Issue {
            path: format!("/{}", path.to_string().replace('.', "/")),
            message: error.message().to_owned(),
        }));
        return Err(issues);
    }
    Ok(input)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_with_paths() {
        let ok = json!({"title": "Kindred", "author": "Octavia E. Butler", "year": 1979});
        assert!(validate(&ok).is_ok());
        let issues = validate(&json!({"title": "", "author": "A", "year": 99999})).unwrap_err();
        let paths: Vec<_> = issues.iter().map(|i| i.path.as_str()).collect();
        assert!(
            paths.contains(&"/title") && paths.contains(&"/year"),
            "{issues:?}"
        );
        let missing = validate(&json!({"author": "A"})).unwrap_err();
        assert_eq!(missing.len(), 2);
        assert_eq!(missing[0].path, "/title");
        let typed = validate(&json!({"title": "T", "author": "A", "year": "old"})).unwrap_err();
        assert_eq!(typed[0].path, "/year");
        let unknown =
            validate(&json!({"title": "T", "author": "A", "year": 1, "isbn": "x"})).unwrap_err();
        assert_eq!(unknown[0].path, "/isbn");
        assert_eq!(validate(&json!([1])).unwrap_err()[0].path, "");
        let blank = validate(&json!({"title": "  ", "author": "A", "year": 1})).unwrap_err();
        assert_eq!(blank[0].path, "/title");
    }

    #[test]
    fn etag_follows_content() {
        let input: BookInput =
            serde_json::from_value(json!({"title": "T", "author": "A", "year": 1})).unwrap();
        let a = Book::new("1".into(), input.clone());
        let mut changed = input;
        changed.year = 2;
        assert_eq!(a.etag(), Book::new("1".into(), a.input.clone()).etag());
        assert_ne!(a.etag(), Book::new("1".into(), changed).etag());
        assert!(a.etag().starts_with('"') && a.etag().ends_with('"'));
    }
}
