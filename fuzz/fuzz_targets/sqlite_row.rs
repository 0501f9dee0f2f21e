//! SQLite rows: the store's row decoder answers a typed error or a record, never a panic,
//! whatever each column holds (any storage class, NULL, out-of-range numbers, wrong-length
//! blobs, unknown statuses, half-set failure columns). Each input becomes one real row from
//! an in-memory database (`SELECT ?1, …, ?14`), decoded as every read of the store decodes.
#![no_main]

use arbitrary::Arbitrary;
use idempotency_core::store::RecordStatus;
use idempotency_core::protocol::decode_replay;
use idempotency_sqlite::__fuzz;
use libfuzzer_sys::fuzz_target;
use rusqlite::types::Value;
use rusqlite::Connection;

#[derive(Debug, Arbitrary)]
enum Column {
    Null,
    Integer(i64),
    Small(i8),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
    Digest([u8; 32]),
    Status(u8),
}

impl Column {
    fn value(&self) -> Value {
        match self {
            Column::Null => Value::Null,
            Column::Integer(n) => Value::Integer(*n),
            Column::Small(n) => Value::Integer(i64::from(*n)),
            Column::Real(f) => Value::Real(*f),
            Column::Text(s) => Value::Text(s.clone()),
            Column::Blob(b) => Value::Blob(b.clone()),
            Column::Digest(d) => Value::Blob(d.to_vec()),
            Column::Status(n) => Value::Text(
                ["pending", "completed", "failed", "PENDING", ""][usize::from(*n) % 5].to_owned(),
            ),
        }
    }
}

thread_local! {
    static DB: Connection = Connection::open_in_memory().expect("in-memory SQLite");
}

fuzz_target!(|columns: [Column; 14]| {
    let select = format!(
        "SELECT {}",
        (1..=14)
            .map(|i| format!("?{i}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    debug_assert_eq!(__fuzz::COLUMNS.split(',').count(), 14);
    let values: Vec<Value> = columns.iter().map(Column::value).collect();
    DB.with(|db| {
        let mut stmt = db.prepare_cached(&select).expect("prepare");
        let mut rows = stmt
            .query(rusqlite::params_from_iter(values.iter()))
            .expect("query");
        let row = rows.next().expect("step").expect("one row");
        if let Ok(record) = __fuzz::decode_record(row) {
            // What the decoder promises about a record it accepts.
            assert!(record.token.0 >= 1);
            assert!(record.attempts >= 1);
            match record.status {
                RecordStatus::Pending => assert!(record.lease_until.is_some()),
                RecordStatus::Completed => {
                    assert!(record.outcome.is_some());
                    let _ = decode_replay::<serde_json::Value>(&record);
                }
                RecordStatus::Failed => assert!(record.failure.is_some()),
            }
        }
    });
});
