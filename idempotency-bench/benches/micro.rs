//! Criterion microbenchmarks of the pure parts: the decision and fingerprinting.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use idempotency_core::{
    decide, DecisionOptions, FencingToken, Fingerprint, IdempotencyKey, Record, RecordId,
    RecordStatus, Scope, Timestamp,
};

fn record() -> Record {
    Record {
        id: RecordId::new(
            Scope::new("tenant|POST /orders").expect("scope"),
            IdempotencyKey::new("k").expect("key"),
        ),
        fingerprint: Fingerprint::from_bytes(b"a"),
        status: RecordStatus::Completed,
        token: FencingToken(1),
        lease_until: None,
        outcome: Some(b"{}".to_vec()),
        attempts: 1,
        failure: None,
        hits: 3,
        created_at: Timestamp::from_millis(0),
        updated_at: Timestamp::from_millis(0),
        expires_at: Timestamp::from_millis(i64::MAX),
    }
}

/// A 1 KiB JSON body with nested objects whose keys are out of order.
fn body_1k() -> Vec<u8> {
    let mut items = Vec::new();
    for i in 0..12 {
        items.push(format!(
            r#"{{"z_note":"item number {i} with some text","qty":{i},"sku":"SKU-{i:05}","price":{{"currency":"EUR","amount":{}}}}}"#,
            i * 100
        ));
    }
    let body = format!(
        r#"{{"customer":"c_42","items":[{}],"a":true}}"#,
        items.join(",")
    );
    body.into_bytes()
}

fn benches(c: &mut Criterion) {
    let r = record();
    let fp = Fingerprint::from_bytes(b"a");
    let now = Timestamp::from_millis(1_000);
    c.bench_function("decide (completed, same fingerprint)", |b| {
        b.iter(|| {
            decide(
                black_box(Some(&r)),
                black_box(&fp),
                now,
                DecisionOptions::default(),
            )
        })
    });
    let body = body_1k();
    assert!(
        (900..1300).contains(&body.len()),
        "body is {} bytes",
        body.len()
    );
    c.bench_function("fingerprint 1 KiB JSON body (canonical)", |b| {
        b.iter(|| {
            Fingerprint::builder()
                .method("POST")
                .path("/orders")
                .content_type("application/json")
                .body(black_box(&body))
                .finish()
        })
    });
    c.bench_function("fingerprint 1 KiB raw bytes", |b| {
        b.iter(|| Fingerprint::from_bytes(black_box(&body)))
    });
}

criterion_group!(micro, benches);
criterion_main!(micro);
