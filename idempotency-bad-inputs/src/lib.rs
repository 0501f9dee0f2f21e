#![doc = include_str!("../README.md")]

/// The heading of the table in the root README.
pub const HEADING: &str = "## Bad inputs and what they get";

/// One row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// 1-based line number in the README, for messages.
    pub line: usize,
    /// Which part of the library the input reaches (`key`, `sqlite open`, `HTTP`…).
    pub place: String,
    /// What is wrong with the input, in words.
    pub input: String,
    /// The example, without its backticks.
    pub example: String,
    /// What it gets, without its backticks (the first code span of the column).
    pub gets: String,
    /// `in-process`, or the test that checks it as `path::function`.
    pub checked_by: String,
}

/// The first code span of a cell, or the trimmed cell when it has none.
fn code(cell: &str) -> String {
    let cell = cell.trim();
    match cell.find('`') {
        Some(start) => {
            let rest = &cell[start + 1..];
            rest.find('`').map_or(rest, |end| &rest[..end]).to_owned()
        }
        None => cell.to_owned(),
    }
}

/// The rows of the table under [`HEADING`] (empty when there is none). The table ends at the
/// first line that does not start with `|`.
pub fn rows(markdown: &str) -> Vec<Row> {
    let mut out = Vec::new();
    let mut lines = markdown.lines().enumerate();
    if !lines.any(|(_, l)| l.trim() == HEADING) {
        return out;
    }
    let mut seen_table = false;
    for (i, line) in lines {
        let line = line.trim();
        if !line.starts_with('|') {
            if seen_table {
                break;
            }
            continue;
        }
        seen_table = true;
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").collect();
        if cells.len() != 5 || cells[0].trim() == "where" || cells[0].starts_with("---") {
            continue;
        }
        out.push(Row {
            line: i + 1,
            place: cells[0].trim().to_owned(),
            input: cells[1].trim().to_owned(),
            example: code(cells[2]),
            gets: code(cells[3]),
            checked_by: code(cells[4]),
        });
    }
    out
}

/// Decodes an example literal: `"text"` or `b"bytes"` with the escapes `\\`, `\"`, `\t`,
/// `\n`, `\r`, `\0`, `\xNN` and `\u{…}`, optionally followed by `* N` (repeated N times).
/// `None` when the example is not such a literal.
pub fn literal(example: &str) -> Option<Vec<u8>> {
    let (lit, times) = match example.rsplit_once(" * ") {
        Some((lit, n)) => (lit.trim(), n.trim().parse::<usize>().ok()?),
        None => (example.trim(), 1),
    };
    let body = lit
        .strip_prefix("b\"")
        .or_else(|| lit.strip_prefix('"'))?
        .strip_suffix('"')?;
    let mut out = Vec::new();
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            let mut buf = [0u8; 4];
            out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            continue;
        }
        match chars.next()? {
            '\\' => out.push(b'\\'),
            '"' => out.push(b'"'),
            't' => out.push(b'\t'),
            'n' => out.push(b'\n'),
            'r' => out.push(b'\r'),
            '0' => out.push(0),
            'x' => {
                let hex: String = chars.by_ref().take(2).collect();
                out.push(u8::from_str_radix(&hex, 16).ok()?);
            }
            'u' => {
                if chars.next()? != '{' {
                    return None;
                }
                let hex: String = chars.by_ref().take_while(|&c| c != '}').collect();
                let c = char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?;
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
            _ => return None,
        }
    }
    Some(out.repeat(times))
}

/// A comma-separated list of literals (`b"a", b"b"`); `None` if any item is not a literal.
pub fn literals(example: &str) -> Option<Vec<Vec<u8>>> {
    let mut items = Vec::new();
    let mut rest = example.trim();
    while !rest.is_empty() {
        // An item ends at the first `", ` outside an escape, or at the end.
        let start = rest.find('"')? + 1;
        let mut end = None;
        let bytes = rest.as_bytes();
        let mut i = start;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => i += 2,
                b'"' => {
                    end = Some(i);
                    break;
                }
                _ => i += 1,
            }
        }
        let end = end?;
        let mut item_end = end + 1;
        if let Some(times) = rest[item_end..].strip_prefix(" * ") {
            item_end += 3 + times.find(',').unwrap_or(times.len());
        }
        items.push(literal(&rest[..item_end])?);
        rest = rest[item_end..]
            .trim_start()
            .trim_start_matches(',')
            .trim_start();
    }
    Some(items)
}

/// Whether an actual `Debug` rendering (prefixed with its type) is what the row documents:
/// equal, or starting with it where an identifier ends.
pub fn documented(gets: &str, actual: &str) -> bool {
    actual == gets
        || actual
            .strip_prefix(gets)
            .is_some_and(|rest| rest.starts_with(|c: char| !(c.is_alphanumeric() || c == '_')))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_decode() {
        assert_eq!(literal(r#""a\tb""#), Some(b"a\tb".to_vec()));
        assert_eq!(literal(r#""k" * 3"#), Some(b"kkk".to_vec()));
        assert_eq!(literal(r#"b"\xff\xfe""#), Some(vec![0xff, 0xfe]));
        assert_eq!(
            literal(r#""c1\u{85}""#),
            Some("c1\u{85}".as_bytes().to_vec())
        );
        assert_eq!(literal("status = 'x'"), None);
        assert_eq!(
            literals(r#"b"a", b"\"b,\"", "k" * 2"#),
            Some(vec![b"a".to_vec(), b"\"b,\"".to_vec(), b"kk".to_vec()])
        );
    }

    #[test]
    fn documented_matches_at_identifier_ends() {
        assert!(documented("KeyError::Empty", "KeyError::Empty"));
        assert!(documented("Error::Config", "Error::Config(\"x\")"));
        assert!(!documented("Error::Config", "Error::ConfigX"));
        assert!(!documented("KeyError::Empty", "KeyError::TooLong"));
    }
}
