//! Replays and what makes two requests the same one: the stored response, the fingerprint
//! (bodies, JSON key order, preconditions, media types), and responses that cannot be replayed.

use super::*;

/// First request runs the handler; the retry gets the stored status, allowlisted headers and
/// body with `Idempotent-Replayed: true`, and the handler does not run again.
pub async fn first_request_runs_then_replays(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"title": "Kindred", "year": 1979});
    let first = send(post(&c, &s, "/items", "k-1", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.execution(), 1);
    assert_eq!(first.json()["received"], body);
    for _ in 0..3 {
        let again = send(post(&c, &s, "/items", "k-1", &body)).await;
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed(), "{again:?}");
        assert_eq!(
            again.body, first.body,
            "the replayed body is byte-identical"
        );
        for h in ["content-type", "location", "etag"] {
            assert_eq!(again.header(h), first.header(h), "replayed {h}");
        }
    }
    assert_eq!(s.executions(), 1);
    // Another key is another operation.
    let other = send(post(&c, &s, "/items", "k-2", &body)).await;
    assert!(!other.replayed());
    assert_eq!(other.execution(), 2);
}

/// `Set-Cookie`, `Authorization` and hop-by-hop headers are never stored, even when
/// allowlisted; headers outside the allowlist are not replayed; the first response keeps them
/// all.
pub async fn replay_omits_credentials_cookies_and_unlisted_headers(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.store_header(HeaderName::from_static("x-allowlisted"))
            .store_header(HeaderName::from_static("set-cookie"))
            .store_header(HeaderName::from_static("authorization"))
            .store_header(HeaderName::from_static("connection"))
    })
    .await;
    let c = client();
    let body = json!({"a": 1});
    let first = send(post(&c, &s, "/items", "cookie", &body)).await;
    assert!(first.header("set-cookie").is_some());
    assert!(first.header("authorization").is_some());
    assert!(first.header("x-unlisted").is_some());
    let again = send(post(&c, &s, "/items", "cookie", &body)).await;
    assert!(again.replayed());
    assert_eq!(again.header("set-cookie"), None);
    assert_eq!(again.header("authorization"), None);
    assert_eq!(again.header("x-unlisted"), None);
    assert_eq!(again.header("x-allowlisted"), Some("run-1"));
    assert_eq!(s.executions(), 1);
}

/// Same key with a different body, query or content type: 422, and the handler does not run.
pub async fn different_request_gets_422(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"amount": 500});
    let first = send(post(&c, &s, "/items", "reuse", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let slug = Refusal::KeyReused.slug();
    let changed = send(post(&c, &s, "/items", "reuse", &json!({"amount": 501}))).await;
    assert_problem(&changed, 422, slug);
    assert_eq!(
        changed.json()["code"],
        "IDEMPOTENCY_KEY_REUSED_WITH_DIFFERENT_PAYLOAD"
    );
    let query = send(post(&c, &s, "/items?dry_run=1", "reuse", &body)).await;
    assert_problem(&query, 422, slug);
    let ctype = send(
        c.post(s.url("/items"))
            .header("idempotency-key", "reuse")
            .header("content-type", "text/plain")
            .body(body.to_string()),
    )
    .await;
    assert_problem(&ctype, 422, slug);
    assert_eq!(s.executions(), 1);
    // The original request still replays.
    assert!(send(post(&c, &s, "/items", "reuse", &body))
        .await
        .replayed());
}

/// JSON bodies are compared in canonical form: key order and whitespace do not matter.
pub async fn json_key_order_is_the_same_request(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let send_raw = |raw: &'static str| {
        c.post(s.url("/items"))
            .header("idempotency-key", "canon")
            .header("content-type", "application/json")
            .body(raw)
    };
    let first = send(send_raw(r#"{"a":1,"b":{"c":2,"d":[1,2]}}"#)).await;
    let again = send(send_raw(r#"{ "b": {"d": [1, 2], "c": 2}, "a": 1 }"#)).await;
    assert!(!first.replayed());
    assert!(again.replayed(), "{again:?}");
    let swapped = send(send_raw(r#"{"a":1,"b":{"c":2,"d":[2,1]}}"#)).await;
    assert_problem(&swapped, 422, Refusal::KeyReused.slug());
    assert_eq!(s.executions(), 1);
}

/// A streaming response (no exact size) that ends within the response limit is stored and
/// replayed. A response over the limit, declared or streamed, is delivered whole, and its key
/// records that the handler ran: the retry gets the original status and `Location` with a
/// `idempotency-response-not-replayable` problem document, and the handler does not run again.
pub async fn small_streams_are_stored_oversized_responses_run_once(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.response_limit(2048)
    })
    .await;
    let c = client();
    let body = json!({"s": 1});
    let streamed = send(post(&c, &s, "/items", "stream", &body).header(control::STREAM, "1")).await;
    assert_eq!(streamed.status, StatusCode::CREATED);
    assert!(!streamed.replayed());
    assert_eq!(&streamed.body[..], b"chunk-1-0;chunk-1-1;chunk-1-2;");
    let again = send(post(&c, &s, "/items", "stream", &body).header(control::STREAM, "1")).await;
    assert!(again.replayed(), "a small stream is stored: {again:?}");
    assert_eq!(again.body, streamed.body);
    assert_eq!(again.header("location"), streamed.header("location"));
    assert_eq!(s.executions(), 1);

    let large = send(post(&c, &s, "/items", "large", &body).header(control::LARGE, "4096")).await;
    assert_eq!(large.status, StatusCode::CREATED);
    assert_eq!(large.body.len(), 4096);
    assert_eq!(large.body[0], b'2');
    let again = send(post(&c, &s, "/items", "large", &body).header(control::LARGE, "4096")).await;
    assert_not_replayable(&again, 201, large.header("location"), true);
    assert_eq!(
        s.executions(),
        2,
        "an oversized response is not a second execution"
    );

    // A stream that passes the limit while it is read is delivered whole too.
    let big_stream =
        send(post(&c, &s, "/items", "big-stream", &body).header(control::STREAM_LARGE, "4100"))
            .await;
    assert_eq!(big_stream.status, StatusCode::CREATED);
    assert_eq!(big_stream.body.len(), 4100);
    assert_eq!(big_stream.body[0], b'3');
    assert!(big_stream.body[1..].iter().all(|&b| b == b's'));
    let again = send(post(&c, &s, "/items", "big-stream", &body)).await;
    assert_not_replayable(&again, 201, big_stream.header("location"), true);
    assert_eq!(s.executions(), 3);

    // At the limit it is stored, streamed or not.
    let fits = send(post(&c, &s, "/items", "fits", &body).header(control::LARGE, "2048")).await;
    let replay = send(post(&c, &s, "/items", "fits", &body).header(control::LARGE, "2048")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, fits.body);
    let fits_stream =
        send(post(&c, &s, "/items", "fits-stream", &body).header(control::STREAM_LARGE, "2048"))
            .await;
    let replay = send(post(&c, &s, "/items", "fits-stream", &body)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, fits_stream.body);
    assert_eq!(s.executions(), 5);
}

/// A response body that fails after the handler ran: by default the key records that the
/// handler ran, and the client and its retries get the not-replayable answer (handler not run
/// again). With `OnUnreplayable::Release`, the client gets 500 and the retry runs the handler,
/// and an oversized response releases the key too.
pub async fn unreplayable_responses_are_recorded_or_released(store: TestStore) {
    let c = client();
    let body = json!({"f": 1});
    let s = server(&store).await;
    let failed =
        send(post(&c, &s, "/items", "fails", &body).header(control::STREAM_FAIL, "1")).await;
    assert_not_replayable(&failed, 201, Some("/items/1"), false);
    assert_eq!(failed.json()["reason"], "body_failed");
    let again = send(post(&c, &s, "/items", "fails", &body)).await;
    assert_not_replayable(&again, 201, Some("/items/1"), true);
    assert_eq!(s.executions(), 1, "a failed body is not a second execution");

    let released = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.response_limit(1024)
            .on_unreplayable(idempotency_tower::OnUnreplayable::Release)
    })
    .await;
    let failed = send(
        post(&c, &released, "/items", "fails-released", &body).header(control::STREAM_FAIL, "1"),
    )
    .await;
    assert_problem(&failed, 500, Refusal::HandlerFailed.slug());
    let retry = retry_while_409(|| post(&c, &released, "/items", "fails-released", &body)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    let large =
        send(post(&c, &released, "/items", "large-released", &body).header(control::LARGE, "2000"))
            .await;
    assert_eq!(large.body.len(), 2000);
    let again =
        send(post(&c, &released, "/items", "large-released", &body).header(control::LARGE, "2000"))
            .await;
    assert!(!again.replayed());
    assert_eq!(again.body.len(), 2000);
    assert_eq!(released.executions(), 4);
}

/// A stored outcome that is not a response this layer wrote answers 500, never panics, and is
/// left as it is.
pub async fn corrupt_stored_response_is_500(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.route(idempotency_tower::RoutePart::Path)
    })
    .await;
    let body = json!({"corrupt": 1});
    let raw = body.to_string();
    let fingerprint = Fingerprint::builder()
        .method("POST")
        .path("/items")
        .content_type("application/json")
        .body(raw.as_bytes())
        .finish();
    let id = RecordId::new(
        IdempotencyKey::new("corrupt").expect("key"),
        http_scope("anonymous", &Method::POST, "/items").expect("scope"),
    );
    let claim = store
        .store
        .claim(&ClaimRequest::new(
            id.clone(),
            fingerprint,
            Duration::from_secs(60),
            Duration::from_secs(3600),
        ))
        .await
        .expect("claim");
    let idempotency_core::store::Claim::Claimed { token, .. } = claim else {
        panic!("fresh key must be claimed: {claim:?}")
    };
    store
        .store
        .complete(
            &id,
            token,
            b"{\"not\":\"a stored response\"}",
            Duration::from_secs(3600),
        )
        .await
        .expect("complete");
    let c = client();
    for _ in 0..2 {
        let r = send(post(&c, &s, "/items", "corrupt", &body)).await;
        assert_problem(
            &r,
            500,
            Refusal::StoredResponseUnreadable(String::new()).slug(),
        );
    }
    assert_eq!(s.executions(), 0);
    let record = store
        .store
        .get(&id)
        .await
        .expect("get")
        .expect("record kept");
    assert_eq!(
        record.outcome.as_deref(),
        Some(&b"{\"not\":\"a stored response\"}"[..])
    );
}

/// Preconditions are part of the request. A PATCH answered 412 (stored: a deterministic
/// client error) is replayed to the same retry, but the same key with a fresh `If-Match` is a
/// different request: 422, never the stored 412; a new key with the fresh precondition runs.
/// With `fingerprint_headers([])` preconditions do not count (the stored 412 is replayed).
/// A request without preconditions keeps the fingerprint it had before headers counted: a
/// record stored under that fingerprint is replayed.
pub async fn preconditions_are_part_of_the_request(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"title": "Kindred"});
    let stale = send(
        patch(&c, &s, "edit-1", &body)
            .header("if-match", "\"v1\"")
            .header(control::STATUS, "412"),
    )
    .await;
    assert_eq!(stale.status, StatusCode::PRECONDITION_FAILED);
    let same = send(patch(&c, &s, "edit-1", &body).header("if-match", "\"v1\"")).await;
    assert_eq!(same.status, StatusCode::PRECONDITION_FAILED);
    assert!(
        same.replayed(),
        "the same precondition is the same request: {same:?}"
    );
    let fresh = send(patch(&c, &s, "edit-1", &body).header("if-match", "\"v2\"")).await;
    assert_problem(&fresh, 422, Refusal::KeyReused.slug());
    for other in ["if-none-match", "if-unmodified-since", "if-modified-since"] {
        let r = send(
            patch(&c, &s, "edit-1", &body)
                .header("if-match", "\"v1\"")
                .header(other, "Sun, 06 Nov 1994 08:49:37 GMT"),
        )
        .await;
        assert_problem(&r, 422, Refusal::KeyReused.slug());
    }
    // One If-Match line or two (as an intermediary may send them) is one request.
    let one = send(patch(&c, &s, "edit-2", &body).header("if-match", "\"v2\", \"v3\"")).await;
    let two = send(
        patch(&c, &s, "edit-2", &body)
            .header("if-match", "\"v2\"")
            .header("if-match", "\"v3\""),
    )
    .await;
    assert_eq!(one.status, StatusCode::CREATED);
    assert!(two.replayed(), "{two:?}");
    let new_key = send(patch(&c, &s, "edit-3", &body).header("if-match", "\"v2\"")).await;
    assert_eq!(new_key.status, StatusCode::CREATED);
    assert!(!new_key.replayed());
    assert_eq!(s.executions(), 3);

    let unlisted = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.fingerprint_headers([])
    })
    .await;
    let first = send(
        patch(&c, &unlisted, "edit-u", &body)
            .header("if-match", "\"v1\"")
            .header(control::STATUS, "412"),
    )
    .await;
    assert_eq!(first.status, StatusCode::PRECONDITION_FAILED);
    let again = send(patch(&c, &unlisted, "edit-u", &body).header("if-match", "\"v2\"")).await;
    assert_eq!(again.status, StatusCode::PRECONDITION_FAILED);
    assert!(
        again.replayed(),
        "without preconditions in the fingerprint: {again:?}"
    );

    // A record stored under the fingerprint without headers (as before they counted).
    let raw = body.to_string();
    let fingerprint = Fingerprint::builder()
        .method("PATCH")
        .path("/items/1")
        .content_type("application/json")
        .body(raw.as_bytes())
        .finish();
    let id = RecordId::new(
        IdempotencyKey::new("stored-before").expect("key"),
        // The layer's route is axum's matched template (the suite enables the `axum` feature).
        http_scope("anonymous", &Method::PATCH, "/items/{id}").expect("scope"),
    );
    seed(
        &store,
        &id,
        fingerprint,
        StatusCode::OK,
        b"{\"seeded\":true}",
    )
    .await;
    let r = send(patch(&c, &s, "stored-before", &body)).await;
    assert_eq!(r.status, StatusCode::OK, "{r:?}");
    assert!(r.replayed());
    assert_eq!(r.json()["seeded"], true);
    assert_eq!(s.executions(), 3);
}

/// Equivalent media types are one request (`application/json`, with `charset=utf-8`, in
/// another case; parameters in another order or quoted); another media type is another
/// request. Query order stays significant.
pub async fn equivalent_media_types_are_one_request(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let with_type = |key: &str, path: &str, ct: &str| {
        c.post(s.url(path))
            .header("idempotency-key", key)
            .header("content-type", ct)
            .body(r#"{"a":1}"#)
    };
    let first = send(with_type("media", "/items", "application/json")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for same in [
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/json;charset=\"UTF-8\"",
    ] {
        let r = send(with_type("media", "/items", same)).await;
        assert!(r.replayed(), "{same}: {r:?}");
        assert_eq!(r.body, first.body);
    }
    for other in [
        "text/plain",
        "application/json; charset=latin1",
        "text/json",
    ] {
        let r = send(with_type("media", "/items", other)).await;
        assert_problem(&r, 422, Refusal::KeyReused.slug());
    }
    let params = send(with_type("params", "/items", "text/plain; b=\"2\"; A=1")).await;
    let reordered = send(with_type("params", "/items", "text/plain;a=1;b=2")).await;
    assert!(!params.replayed());
    assert!(reordered.replayed(), "{reordered:?}");
    let query = send(with_type("query", "/items?a=1&b=2", "application/json")).await;
    let swapped = send(with_type("query", "/items?b=2&a=1", "application/json")).await;
    assert!(!query.replayed());
    assert_problem(&swapped, 422, Refusal::KeyReused.slug());
    assert_eq!(s.executions(), 3);
}
