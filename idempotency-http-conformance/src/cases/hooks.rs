//! The hooks: the response hook and the fingerprint hook.

use super::*;

/// The response hook adds headers to fresh and replayed responses, knowing which is which and
/// when the key expires; its headers are not stored.
pub async fn response_hook_sees_fresh_and_replayed(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.on_response(|ctx, headers| {
            let replay = if ctx.is_replay() { "true" } else { "false" };
            headers.insert("x-hook-replay", http::HeaderValue::from_static(replay));
            headers.insert(
                "x-hook-key",
                http::HeaderValue::from_str(ctx.key().as_str()).expect("a header value"),
            );
            if let Some(at) = ctx.expires_at() {
                let secs = at
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                headers.insert("x-hook-expires", http::HeaderValue::from(secs));
            }
        })
        .store_header(HeaderName::from_static("x-hook-replay"))
    })
    .await;
    let c = client();
    let body = json!({"h": 1});
    let first = send(post(&c, &s, "/items", "hooked", &body)).await;
    assert_eq!(first.header("x-hook-replay"), Some("false"));
    assert_eq!(first.header("x-hook-key"), Some("hooked"));
    let again = send(post(&c, &s, "/items", "hooked", &body)).await;
    assert!(again.replayed());
    assert_eq!(
        again.header("x-hook-replay"),
        Some("true"),
        "hook headers are set on each answer, not stored: {again:?}"
    );
    let expiry = |r: &Reply| -> i64 {
        r.header("x-hook-expires")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no expiry on {r:?}"))
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64;
    let retention = Policy::default().retention.as_secs() as i64;
    for r in [&first, &again] {
        assert!(
            (expiry(r) - (now + retention)).abs() <= 5,
            "expiry {} for a {retention} s retention",
            expiry(r)
        );
    }
    // Refusals do not reach the hook.
    let mismatch = send(post(&c, &s, "/items", "hooked", &json!({"h": 2}))).await;
    assert_problem(&mismatch, 422, Refusal::KeyReused.slug());
    assert_eq!(mismatch.header("x-hook-replay"), None);
    assert_eq!(s.executions(), 1);
}

/// A fingerprint hook chooses what is compared: here a JSON member the client regenerates on
/// every attempt is left out, so attempts that differ only there are one request, while any
/// other change is still a 422.
pub async fn fingerprint_hook_selects_what_is_hashed(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.fingerprint_with(|req| match serde_json::from_slice::<Value>(req.body()) {
            Ok(mut doc) => {
                if let Some(members) = doc.as_object_mut() {
                    members.remove("sent_at");
                }
                let canonical = idempotency_core::canonical_json(&doc);
                req.builder().body(canonical.as_bytes()).finish()
            }
            Err(_) => req.default_fingerprint(),
        })
    })
    .await;
    let c = client();
    let first = send(post(
        &c,
        &s,
        "/items",
        "hook-fp",
        &json!({"amount": 5, "sent_at": 1}),
    ))
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(post(
        &c,
        &s,
        "/items",
        "hook-fp",
        &json!({"sent_at": 2, "amount": 5}),
    ))
    .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    let changed = send(post(
        &c,
        &s,
        "/items",
        "hook-fp",
        &json!({"amount": 6, "sent_at": 3}),
    ))
    .await;
    assert_problem(&changed, 422, Refusal::KeyReused.slug());
    let query = send(post(&c, &s, "/items?x=1", "hook-fp", &json!({"amount": 5}))).await;
    assert_problem(&query, 422, Refusal::KeyReused.slug());
    assert_eq!(s.executions(), 1);
}
