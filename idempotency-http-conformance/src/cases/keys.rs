//! Keys, scopes and refusals: how the key header is read and validated, which requests the
//! layer covers, caller scopes, and pluggable refusals.

use super::*;

/// `Idempotency-Key: abc` and `Idempotency-Key: "abc"` are one key.
pub async fn quoted_and_bare_keys_are_one_key(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"q": true});
    let first = send(post(&c, &s, "/items", "same-key", &body)).await;
    let quoted = send(post(&c, &s, "/items", "\"same-key\"", &body)).await;
    assert!(quoted.replayed(), "{quoted:?}");
    assert_eq!(quoted.body, first.body);
    let first_q = send(post(&c, &s, "/items", r#""q\"k""#, &body)).await;
    let bare = send(post(&c, &s, "/items", r#"q"k"#, &body)).await;
    assert!(!first_q.replayed());
    assert!(bare.replayed());
    assert_eq!(s.executions(), 2);
}

/// No key: the request passes through (runs every time, no replay); with `required`, it gets
/// 400 "Idempotency-Key header is required" and the handler does not run.
pub async fn missing_key_passes_through_or_400_when_required(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    for n in 1..=2 {
        let r = send(c.post(s.url("/items")).json(&json!({"x": 1}))).await;
        assert_eq!(r.status, StatusCode::CREATED);
        assert!(!r.replayed());
        assert_eq!(r.execution(), n);
    }
    let strict =
        TestServer::with_store(store.store.clone(), Policy::default(), |l| l.required(true)).await;
    let r = send(c.post(strict.url("/items")).json(&json!({"x": 1}))).await;
    assert_problem(&r, 400, Refusal::KeyRequired.slug());
    assert!(r.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .contains("Idempotency-Key header is required"));
    assert_eq!(r.json()["title"], "Idempotency-Key header is required");
    assert_eq!(strict.executions(), 0);
    // Methods the layer does not cover never need a key.
    let get = send(c.get(strict.url("/items"))).await;
    assert_eq!(get.status, StatusCode::CREATED);
}

/// Empty, overlong (256 bytes), control-character, badly quoted, comma-joined and duplicated
/// keys get 400 and never run the handler; a 255-byte key is accepted.
pub async fn malformed_keys_get_400(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let slug = Refusal::KeyInvalid(idempotency_tower::KeyHeaderError::AmbiguousComma).slug();
    let bad: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"\"\"".to_vec(),
        vec![b'k'; 256],
        b"tab\there".to_vec(),
        "c1-control-\u{85}".as_bytes().to_vec(),
        b"\"unterminated".to_vec(),
        b"\"bad\\escape\"".to_vec(),
        b"\"after\"quote".to_vec(),
        b"joined, by-proxy".to_vec(),
        b"\xff\xfe".to_vec(),
    ];
    for key in bad {
        let value = reqwest::header::HeaderValue::from_bytes(&key).expect("sendable header");
        let r = send(
            c.post(s.url("/items"))
                .header("idempotency-key", value)
                .json(&json!({"x": 1})),
        )
        .await;
        assert_problem(&r, 400, slug);
    }
    // Two field lines; reqwest sends each appended value on its own line.
    let dup = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "one")
            .header("idempotency-key", "one")
            .json(&json!({"x": 1})),
    )
    .await;
    assert_problem(&dup, 400, slug);
    assert!(dup.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .contains("times"));
    assert_eq!(s.executions(), 0);
    let longest = "k".repeat(255);
    let ok = send(post(&c, &s, "/items", &longest, &json!({"x": 1}))).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(s.executions(), 1);
}

/// A body over the limit gets 413 whether its length is declared or it is chunked, and the
/// handler does not run; a body at the limit is accepted.
pub async fn oversized_body_gets_413(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.body_limit(1024)
    })
    .await;
    let c = client();
    let slug = Refusal::BodyTooLarge { limit: 0 }.slug();
    let big = "x".repeat(1025);
    let declared = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "big")
            .header("content-type", "text/plain")
            .body(big.clone()),
    )
    .await;
    assert_problem(&declared, 413, slug);
    // The unread rest of the body makes the connection unusable; the layer says so.
    assert_eq!(declared.header("connection"), Some("close"));
    let chunks: Vec<Result<Bytes, std::io::Error>> =
        (0..5).map(|_| Ok(Bytes::from(vec![b'y'; 300]))).collect();
    let chunked = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "big-chunked")
            .header("content-type", "text/plain")
            .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks))),
    )
    .await;
    assert_problem(&chunked, 413, slug);
    assert_eq!(s.executions(), 0);
    let at_limit = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "fits")
            .header("content-type", "text/plain")
            .body("z".repeat(1024)),
    )
    .await;
    assert_eq!(at_limit.status, StatusCode::CREATED);
    // The refused key was never claimed: it works once the body fits.
    let retry = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "big")
            .header("content-type", "text/plain")
            .body("small"),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(s.executions(), 2);
}

/// Methods outside the covered set pass through with their key; the set is configurable.
pub async fn uncovered_methods_pass_through(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    for n in 1..=2 {
        let r = send(
            c.put(s.url("/items"))
                .header("idempotency-key", "put")
                .json(&json!({})),
        )
        .await;
        assert!(!r.replayed());
        assert_eq!(r.execution(), n);
    }
    let covered = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.methods([Method::PUT])
    })
    .await;
    let put = || {
        c.put(covered.url("/items"))
            .header("idempotency-key", "put")
            .json(&json!({}))
    };
    let a = send(put()).await;
    let b = send(put()).await;
    assert!(!a.replayed());
    assert!(b.replayed());
    // POST is no longer covered there.
    let p1 = send(post(&c, &covered, "/items", "post", &json!({}))).await;
    let p2 = send(post(&c, &covered, "/items", "post", &json!({}))).await;
    assert!(!p1.replayed() && !p2.replayed());
    assert_eq!(covered.executions(), 3);
}

/// Records never cross scopes: two callers using the same key run separately; a caller the
/// scope function cannot identify gets 401.
pub async fn scopes_isolate_callers(store: TestStore) {
    let s = TestServer::per_principal(store.store.clone(), Policy::default(), |l| l).await;
    let c = client();
    let body = json!({"s": 1});
    let alice =
        send(post(&c, &s, "/items", "shared", &body).header(control::PRINCIPAL, "alice")).await;
    let bob = send(post(&c, &s, "/items", "shared", &body).header(control::PRINCIPAL, "bob")).await;
    assert!(!alice.replayed() && !bob.replayed());
    assert_ne!(alice.execution(), bob.execution());
    let alice2 =
        send(post(&c, &s, "/items", "shared", &body).header(control::PRINCIPAL, "alice")).await;
    assert!(alice2.replayed());
    assert_eq!(alice2.body, alice.body);
    let anon = send(post(&c, &s, "/items", "shared", &body)).await;
    assert_problem(&anon, 401, Refusal::CallerUnidentified.slug());
    // A different route is a different operation, so the key is free there.
    let other =
        send(post(&c, &s, "/items/7", "shared", &body).header(control::PRINCIPAL, "alice")).await;
    assert!(!other.replayed());
    assert_eq!(s.executions(), 3);
}

/// Refusals use the configured problem type base, or a user's own error format.
pub async fn refusals_are_pluggable(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.required(true)
            .problem_type_base("https://api.example.test/errors/")
    })
    .await;
    let c = client();
    let r = send(c.post(s.url("/items")).json(&json!({}))).await;
    assert_problem(&r, 400, "idempotency-key-required");
    assert_eq!(
        r.json()["type"],
        "https://api.example.test/errors/idempotency-key-required"
    );

    let custom = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.responder(|refusal: &Refusal| {
            let body =
                json!({"error": {"code": refusal.code(), "retryable": refusal.is_retryable()}});
            http::Response::builder()
                .status(refusal.status())
                .header("content-type", "application/vnd.custom+json")
                .body(Bytes::from(body.to_string()))
                .unwrap_or_default()
        })
    })
    .await;
    let body = json!({"c": 1});
    let slow = tokio::spawn(send(
        post(&c, &custom, "/items", "custom", &body).header(control::DELAY_MS, "400"),
    ));
    wait_for_executions(&custom, 1).await;
    let busy = send(post(&c, &custom, "/items", "custom", &body)).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(
        busy.header("content-type"),
        Some("application/vnd.custom+json")
    );
    assert_eq!(busy.json()["error"]["code"], "IDEMPOTENCY_KEY_IN_PROGRESS");
    assert_eq!(busy.json()["error"]["retryable"], true);
    assert!(
        busy.header("retry-after").is_some(),
        "the layer adds Retry-After"
    );
    let mismatch = send(post(&c, &custom, "/items", "custom", &json!({"c": 2}))).await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        mismatch.json()["error"]["code"],
        "IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD"
    );
    assert_eq!(
        slow.await.expect("first request").status,
        StatusCode::CREATED
    );
}

/// The key sent as a structured-field string with parameters (`"abc";v=1`) is the key `abc`;
/// quoted values that are not one string item are still refused.
pub async fn structured_field_key_parameters_are_read(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"sf": 1});
    let first = send(post(&c, &s, "/items", "\"sf-key\";v=1", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    for same in [
        "sf-key",
        "\"sf-key\"",
        "\"sf-key\";v=2;ts=\"x\"",
        "\"sf-key\"; v=1",
    ] {
        let r = send(post(&c, &s, "/items", same, &body)).await;
        assert!(r.replayed(), "{same}: {r:?}");
    }
    let slug = Refusal::KeyInvalid(idempotency_tower::KeyHeaderError::AmbiguousComma).slug();
    for bad in [
        "\"a\", \"b\"",
        "\"sf-key\";V=1",
        "\"sf-key\" ;v=1",
        "\"sf-key\";v=",
    ] {
        let r = send(post(&c, &s, "/items", bad, &body)).await;
        assert_problem(&r, 400, slug);
    }
    assert_eq!(s.executions(), 1);
}

/// A caller the scope function cannot identify gets 401 with a `WWW-Authenticate` challenge
/// (`Bearer` by default, configurable).
pub async fn unidentified_caller_gets_a_challenge(store: TestStore) {
    let s = TestServer::per_principal(store.store.clone(), Policy::default(), |l| l).await;
    let c = client();
    let r = send(post(&c, &s, "/items", "who", &json!({}))).await;
    assert_problem(&r, 401, Refusal::CallerUnidentified.slug());
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    let custom = TestServer::per_principal(store.store.clone(), Policy::default(), |l| {
        l.unidentified_challenge(http::HeaderValue::from_static("Basic realm=\"api\""))
    })
    .await;
    let r = send(post(&c, &custom, "/items", "who", &json!({}))).await;
    assert_problem(&r, 401, Refusal::CallerUnidentified.slug());
    assert_eq!(r.header("www-authenticate"), Some("Basic realm=\"api\""));
    assert_eq!(s.executions() + custom.executions(), 0);
}

/// The key header name is configurable, a validator publishes the API's key format (refused
/// keys get 400 `idempotency-key-invalid` with its message), and the replay marker is
/// configurable or off.
pub async fn key_header_validator_and_replay_marker_are_configurable(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.key_header(HeaderName::from_static("x-request-key"))
            .validate_key(|key| {
                let s = key.as_str();
                let ok = s.len() == 36
                    && s.char_indices().all(|(i, ch)| match i {
                        8 | 13 | 18 | 23 => ch == '-',
                        _ => ch.is_ascii_hexdigit(),
                    });
                ok.then_some(()).ok_or_else(|| "keys are UUIDs".to_owned())
            })
            .replay_marker(Some((
                HeaderName::from_static("x-cache"),
                http::HeaderValue::from_static("replay"),
            )))
    })
    .await;
    let c = client();
    let body = json!({"k": 1});
    let with_key = |key: &str| {
        c.post(s.url("/items"))
            .header("x-request-key", key)
            .json(&body)
    };
    let bad = send(with_key("not-a-uuid")).await;
    assert_problem(&bad, 400, "idempotency-key-invalid");
    assert!(
        bad.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("keys are UUIDs")),
        "{bad:?}"
    );
    assert_eq!(s.executions(), 0);
    let uuid = "8e2c1f0a-5b7d-4c3e-9f21-0a6b7c8d9e10";
    let first = send(with_key(uuid)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let again = send(with_key(uuid)).await;
    assert_eq!(again.header("x-cache"), Some("replay"));
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(again.body, first.body);
    // The default header is not read there: the request passes through.
    let other = send(post(&c, &s, "/items", uuid, &body)).await;
    assert!(other.header("x-cache").is_none());
    assert_eq!(s.executions(), 2);

    let unmarked = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.replay_marker(None)
    })
    .await;
    let first = send(post(&c, &unmarked, "/items", "unmarked", &body)).await;
    let again = send(post(&c, &unmarked, "/items", "unmarked", &body)).await;
    assert_eq!(again.header("idempotent-replayed"), None);
    assert_eq!(again.body, first.body);
    assert_eq!(unmarked.executions(), 1);
}
