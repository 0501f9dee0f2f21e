//! Duplicates in flight, leases and failures: 409 with Retry-After, the wait policy, released
//! keys, panics, store outages, handlers that outlive their lease, and failed completions.

use super::*;

/// A duplicate while the first request runs gets 409 problem+json with `Retry-After` in whole
/// seconds (at least 1); once the first finishes, the duplicate gets the replay.
pub async fn in_flight_duplicate_gets_409_with_retry_after(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"slow": 1});
    let slow = tokio::spawn(send(
        post(&c, &s, "/items", "busy", &body).header(control::DELAY_MS, "700"),
    ));
    wait_for_executions(&s, 1).await;
    let dup = send(post(&c, &s, "/items", "busy", &body)).await;
    assert_problem(
        &dup,
        409,
        Refusal::InProgress {
            retry_after: Duration::ZERO,
        }
        .slug(),
    );
    let retry_after: u64 = dup
        .header("retry-after")
        .expect("Retry-After on 409")
        .parse()
        .expect("Retry-After in whole seconds");
    assert!(retry_after >= 1);
    let first = slow.await.expect("first request");
    assert_eq!(first.status, StatusCode::CREATED);
    let after = send(post(&c, &s, "/items", "busy", &body)).await;
    assert!(after.replayed());
    assert_eq!(after.body, first.body);
    assert_eq!(s.executions(), 1);
}

/// With `InFlight::Wait`, a duplicate waits for the first request and gets its replay.
pub async fn in_flight_wait_policy_replays(store: TestStore) {
    let policy = Policy::default().in_flight(InFlight::wait(Duration::from_secs(10)));
    let s = TestServer::with_store(store.store.clone(), policy, |l| l).await;
    let c = client();
    let body = json!({"wait": 1});
    let slow = tokio::spawn(send(
        post(&c, &s, "/items", "wait", &body).header(control::DELAY_MS, "500"),
    ));
    wait_for_executions(&s, 1).await;
    let dup = send(post(&c, &s, "/items", "wait", &body)).await;
    let first = slow.await.expect("first request");
    assert_eq!(dup.status, StatusCode::CREATED, "{dup:?}");
    assert!(dup.replayed());
    assert_eq!(dup.body, first.body);
    assert_eq!(s.executions(), 1);
}

/// Statuses the layer is told not to store (`store_status`), for handlers that answer them
/// only before acting: 5xx, 408 and 429 here. With `OnUnstored::Release` they are delivered
/// but not stored: the key is released and the retry runs the handler. A client error the
/// rule stores (404, 400) is replayed.
pub async fn server_errors_408_429_release_the_key(store: TestStore) {
    let s = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.store_status(not_5xx_408_429)
            .on_unstored(OnUnstored::Release)
    })
    .await;
    let c = client();
    let mut expected = 0;
    for code in ["500", "503", "408", "429"] {
        let key = format!("released-{code}");
        let body = json!({"code": code});
        let failed = send(post(&c, &s, "/items", &key, &body).header(control::STATUS, code)).await;
        expected += 1;
        assert_eq!(failed.status.as_str(), code);
        assert!(!failed.replayed());
        let retry = send(post(&c, &s, "/items", &key, &body)).await;
        expected += 1;
        assert_eq!(retry.status, StatusCode::CREATED, "retry after {code}");
        assert!(!retry.replayed(), "a {code} is never replayed");
        assert_eq!(retry.execution(), expected);
    }
    for code in ["404", "400"] {
        let key = format!("stored-{code}");
        let body = json!({"code": code});
        let first = send(post(&c, &s, "/items", &key, &body).header(control::STATUS, code)).await;
        expected += 1;
        let again = send(post(&c, &s, "/items", &key, &body)).await;
        assert_eq!(again.status.as_str(), code);
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
    }
    assert_eq!(s.executions(), expected);
}

/// A handler that answered may have acted, whatever its status: a 500 after the charge, a 503
/// after a write whose answer was lost. By default every answer is stored and replayed, with
/// the replay marker, for the key's retention, also once the lease has passed: a retry never
/// runs the handler again.
pub async fn answers_of_every_status_are_replayed_after_the_lease(store: TestStore) {
    let lease = store.short_lease();
    let policy = Policy::default().lease(lease).retention(store.long());
    let s = TestServer::with_store(store.store.clone(), policy, |l| l).await;
    let c = client();
    for (i, code) in ["500", "503", "408", "429"].into_iter().enumerate() {
        let key = format!("answered-{code}");
        let body = json!({"code": code});
        let failed = send(post(&c, &s, "/items", &key, &body).header(control::STATUS, code)).await;
        assert_eq!(failed.status.as_str(), code);
        assert!(!failed.replayed());
        // The lease passes (a real-time store sleeps; a manual clock moves).
        store.advance(lease * 2).await;
        let retry = send(post(&c, &s, "/items", &key, &body)).await;
        assert_eq!(retry.status.as_str(), code, "{retry:?}");
        assert!(retry.replayed(), "the {code} was not replayed: {retry:?}");
        assert_eq!(retry.body, failed.body);
        assert_eq!(s.executions(), i as u64 + 1, "the {code} handler ran again");
    }
}

/// A rule that stores every status but 5xx, 408 and 429 (the default before every answer was
/// stored).
fn not_5xx_408_429(status: StatusCode) -> bool {
    !(status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS)
}

/// A status the layer is told not to store still comes from a handler that may have acted. By
/// default (`OnUnstored::Settle`) the key records that it ran, with its status and `Location`
/// but not its body: a retry, also after the lease, is told so (replayed, the original status)
/// and the handler never runs again. With `OnUnstored::Hold` the key is held until its lease
/// passes: a retry 100 ms later gets 409 with `Retry-After`.
pub async fn unstored_statuses_settle_or_hold_the_key(store: TestStore) {
    let lease = store.short_lease();
    let policy = Policy::default().lease(lease).retention(store.long());
    let settled = TestServer::with_store(store.store.clone(), policy.clone(), |l| {
        l.store_status(not_5xx_408_429)
    })
    .await;
    let held = TestServer::with_store(store.store.clone(), policy, |l| {
        l.store_status(not_5xx_408_429)
            .on_unstored(OnUnstored::Hold)
    })
    .await;
    let c = client();
    for (i, code) in ["500", "503", "408", "429"].into_iter().enumerate() {
        let body = json!({"code": code});
        let key = format!("settled-{code}");
        let failed =
            send(post(&c, &settled, "/items", &key, &body).header(control::STATUS, code)).await;
        assert_eq!(failed.status.as_str(), code);
        assert!(!failed.replayed());
        store.advance(lease * 2).await;
        let retry = send(post(&c, &settled, "/items", &key, &body)).await;
        let location = format!("/items/{}", i + 1);
        assert_not_replayable(&retry, failed.status.as_u16(), Some(&location), true);
        assert_eq!(
            settled.executions(),
            i as u64 + 1,
            "the {code} handler ran again"
        );

        let key = format!("held-{code}");
        let failed =
            send(post(&c, &held, "/items", &key, &body).header(control::STATUS, code)).await;
        assert_eq!(failed.status.as_str(), code);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let retry = send(post(&c, &held, "/items", &key, &body)).await;
        assert_problem(
            &retry,
            409,
            Refusal::InProgress {
                retry_after: Duration::ZERO,
            }
            .slug(),
        );
        let after: u64 = retry
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no Retry-After on {retry:?}"));
        assert!(after >= 1, "{retry:?}");
        assert_eq!(
            held.executions(),
            i as u64 + 1,
            "the {code} handler ran again"
        );
    }
}

/// A handler cut off by a timeout layer inside the idempotency layer (it counted, then slept
/// past the timeout) may have acted: the `408` is its answer, stored, and a retry 100 ms later
/// gets it replayed, not a second run.
pub async fn handler_cut_off_by_an_inner_timeout_runs_once(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"cut": true});
    let cut = send(
        post(&c, &s, "/items", "cut-off", &body)
            .header(control::DELAY_MS, "5000")
            .header(control::TIMEOUT_MS, "100"),
    )
    .await;
    assert_eq!(cut.status, StatusCode::REQUEST_TIMEOUT, "{cut:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let retry = send(post(&c, &s, "/items", "cut-off", &body)).await;
    assert_eq!(retry.status, StatusCode::REQUEST_TIMEOUT, "{retry:?}");
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(s.executions(), 1, "the cut-off handler ran again");
}

/// A handler that says it did nothing (`NothingDone` on its response) frees the key at once,
/// whatever its status: the retry runs the handler, and its answer is stored as usual.
pub async fn handler_that_did_nothing_frees_the_key(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"nothing": true});
    let refused = send(
        post(&c, &s, "/items", "nothing-done", &body)
            .header(control::STATUS, "503")
            .header(control::NOTHING_DONE, "1"),
    )
    .await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    // The key is released by a background write; give it a moment on slow stores.
    let retry = retry_while_409(|| post(&c, &s, "/items", "nothing-done", &body)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(retry.execution(), 2);
    let replay = send(post(&c, &s, "/items", "nothing-done", &body)).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(s.executions(), 2);
}

/// A handler that panics may have acted before it panicked (charged, then failed building
/// its answer): the client gets `500`, and the key is settled for good, never run again:
/// a retry is told `422` outcome-lost, a changed body `422` key-reused. Only under
/// `OnUnstored::Release` (handlers that fail only before acting) is the key released.
pub async fn handler_panic_settles_the_key(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"p": 1});
    let panicked = send(post(&c, &s, "/items", "panic", &body).header(control::PANIC, "1")).await;
    assert_problem(&panicked, 500, Refusal::HandlerFailed.slug());
    // The key is settled by a background write; give it a moment on slow stores.
    let retry = retry_while_409(|| post(&c, &s, "/items", "panic", &body)).await;
    assert_problem(&retry, 422, "idempotency-key-outcome-lost");
    let other = send(post(&c, &s, "/items", "panic", &json!({"p": 2}))).await;
    assert_problem(&other, 422, "idempotency-key-reused");
    assert_eq!(s.executions(), 1, "the handler ran again after a panic");

    let released = TestServer::with_store(store.store.clone(), Policy::default(), |l| {
        l.on_unstored(OnUnstored::Release)
    })
    .await;
    let panicked =
        send(post(&c, &released, "/items", "panic-released", &body).header(control::PANIC, "1"))
            .await;
    assert_problem(&panicked, 500, Refusal::HandlerFailed.slug());
    let retry = retry_while_409(|| post(&c, &released, "/items", "panic-released", &body)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.replayed());
    assert_eq!(released.executions(), 2);
}

/// The store is down: 503 problem and the handler does not run (fail closed); with
/// `fail_open`, the handler runs unprotected. When the store is back, keys work again.
pub async fn store_outage_fails_closed_or_open(store: TestStore) {
    let outage = Outage::new(store.store.clone());
    let closed = TestServer::with_store(outage.clone(), Policy::default(), |l| l).await;
    let open =
        TestServer::with_store(outage.clone(), Policy::default(), |l| l.fail_open(true)).await;
    let c = client();
    let body = json!({"o": 1});
    outage.set_down(true);
    let r = send(post(&c, &closed, "/items", "outage", &body)).await;
    assert_problem(&r, 503, Refusal::StoreUnavailable(String::new()).slug());
    assert!(
        !String::from_utf8_lossy(&r.body).contains("injected"),
        "store internals leak: {r:?}"
    );
    assert_eq!(closed.executions(), 0);
    let o = send(post(&c, &open, "/items", "outage", &body)).await;
    assert_eq!(o.status, StatusCode::CREATED);
    assert!(!o.replayed());
    assert_eq!(open.executions(), 1);
    outage.set_down(false);
    let first = send(post(&c, &closed, "/items", "outage", &body)).await;
    let again = send(post(&c, &closed, "/items", "outage", &body)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(closed.executions(), 1);
}

/// 64 concurrent requests with one key: the handler runs once; every other request gets 409 or
/// the replay of that one response.
pub async fn concurrent_duplicates_run_once(store: TestStore) {
    let s = Arc::new(server(&store).await);
    let c = client();
    let body = json!({"race": true});
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (c, s, body) = (c.clone(), s.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            send(post(&c, &s, "/items", "race", &body).header(control::DELAY_MS, "200")).await
        }));
    }
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.expect("request task"));
    }
    let fresh: Vec<_> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
        .collect();
    assert_eq!(fresh.len(), 1, "exactly one request runs the handler");
    for r in &replies {
        match r.status {
            StatusCode::CREATED if r.replayed() => assert_eq!(r.body, fresh[0].body),
            StatusCode::CREATED => {}
            StatusCode::CONFLICT => assert_problem(
                r,
                409,
                Refusal::InProgress {
                    retry_after: Duration::ZERO,
                }
                .slug(),
            ),
            other => panic!("unexpected {other}: {r:?}"),
        }
    }
    assert_eq!(s.executions(), 1);
}

/// A client that times out and retries gets the response of the first attempt: the handler
/// is not cancelled by the disconnect, runs once, and its outcome is stored.
pub async fn client_timeout_then_retry_gets_the_same_response(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let body = json!({"t": 1});
    let request = post(&c, &s, "/items", "timeout", &body)
        .header(control::DELAY_MS, "600")
        .send();
    // The client gives up once the handler runs (its key claimed), as a client whose timeout
    // fires mid-request: a fixed client timeout could fire before the claim on a slow store,
    // and test nothing but the lease.
    tokio::select! {
        biased;
        () = wait_for_executions(&s, 1) => {}
        answered = request => panic!("the handler answered before the client gave up: {answered:?}"),
    }
    let retry = retry_while_409(|| post(&c, &s, "/items", "timeout", &body)).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(retry.replayed());
    assert_eq!(retry.execution(), 1);
    assert_eq!(s.executions(), 1);
}

/// After a released failure (a 500 whose handler said it did nothing), a retry with a
/// corrected body runs: nothing took effect under the key, so it is not a mismatch.
pub async fn released_key_accepts_corrected_request(store: TestStore) {
    let s = server(&store).await;
    let c = client();
    let failed = send(
        post(&c, &s, "/items", "fix", &json!({"v": 1}))
            .header(control::STATUS, "500")
            .header(control::NOTHING_DONE, "1"),
    )
    .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let corrected = send(post(&c, &s, "/items", "fix", &json!({"v": 2}))).await;
    assert_eq!(corrected.status, StatusCode::CREATED);
    assert_eq!(corrected.json()["received"], json!({"v": 2}));
    let replay = send(post(&c, &s, "/items", "fix", &json!({"v": 2}))).await;
    assert!(replay.replayed());
    let old = send(post(&c, &s, "/items", "fix", &json!({"v": 1}))).await;
    assert_problem(&old, 422, Refusal::KeyReused.slug());
    assert_eq!(s.executions(), 2);
}

/// A handler that runs longer than its lease is not run a second time by a retry: the layer
/// extends the lease while the handler runs. (300 ms lease, a 3 s handler, a retry after
/// about 1.1 s: 409, then the replay.) The retry must reach the layer while the handler runs:
/// a machine so loaded that it arrives after the handler ended gets the replay, which says
/// nothing about the lease, so the case runs again on a fresh key with a handler twice as
/// long, a few times.
pub async fn handler_outliving_its_lease_runs_once(store: TestStore) {
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .retention(store.long());
    let s = Arc::new(TestServer::with_store(store.store.clone(), policy, |l| l).await);
    let c = client();
    let body = json!({"slow": true});
    let mut handler_ms = 3000u64;
    let mut executions = 0;
    for attempt in 1..=4 {
        let key = format!("slow-{attempt}");
        let first = {
            let (c, s, body, key) = (c.clone(), s.clone(), body.clone(), key.clone());
            let delay = handler_ms.to_string();
            tokio::spawn(async move {
                send(post(&c, &s, "/items", &key, &body).header(control::DELAY_MS, delay)).await
            })
        };
        tokio::time::sleep(Duration::from_millis(700)).await;
        // Time passes on the store's clock too (a manual clock only moves when told).
        store.advance(Duration::from_millis(400)).await;
        let retry = send(post(&c, &s, "/items", &key, &body)).await;
        let first = first.await.expect("first request");
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert!(!first.replayed());
        executions += 1;
        if retry.status == StatusCode::CREATED
            && retry.replayed()
            && retry.execution() == first.execution()
        {
            // The handler had ended before the retry arrived: try again, longer.
            assert_eq!(s.executions(), executions, "the slow handler ran twice");
            handler_ms *= 2;
            continue;
        }
        assert_eq!(
            retry.status,
            StatusCode::CONFLICT,
            "a retry while a handler outlives its lease must get 409, got {retry:?}"
        );
        let after = send(post(&c, &s, "/items", &key, &body)).await;
        assert_eq!(after.status, StatusCode::CREATED, "{after:?}");
        assert!(
            after.replayed(),
            "the retry after the slow handler: {after:?}"
        );
        assert_eq!(s.executions(), executions, "the slow handler ran twice");
        return;
    }
    panic!("every retry arrived after its handler had ended (the last ran {handler_ms} ms)");
}

/// The handler ran but its response cannot be stored (every completion fails): the client
/// still gets the response. The engine records a permanent failure in its place, so a retry
/// is told `422` `idempotency-key-outcome-lost` and never runs the handler again. If
/// the store refuses that write too, a retry is told `409` until the lease passes instead.
pub async fn failed_completion_does_not_rerun_handler(store: TestStore) {
    let policy = Policy::default()
        .lease(store.long())
        .retention(store.long());
    for (key, fail_refused) in [("unstored", false), ("unstored-held", true)] {
        let flaky = FlakyStore::new(store.store.clone(), Fault::Refused);
        flaky.inject(FlakyOp::Complete, u64::MAX / 2);
        if fail_refused {
            flaky.inject(FlakyOp::Fail, u64::MAX / 2);
        }
        let s = TestServer::with_store(Arc::new(flaky.clone()), policy.clone(), |l| l).await;
        let c = client();
        let body = json!({"charge": 1});
        let first = send(post(&c, &s, "/items", key, &body)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert!(flaky.injected() > 0, "no completion was attempted");
        flaky.heal(FlakyOp::Complete);
        flaky.heal(FlakyOp::Fail);
        tokio::time::sleep(Duration::from_millis(100)).await;
        for _ in 0..2 {
            let retry = send(post(&c, &s, "/items", key, &body)).await;
            if fail_refused {
                assert_problem(&retry, 409, "idempotency-key-in-progress");
            } else {
                assert_problem(&retry, 422, "idempotency-key-outcome-lost");
            }
        }
        if !fail_refused {
            // Another payload under the key is refused, as against a stored response.
            let other = send(post(&c, &s, "/items", key, &json!({"charge": 2}))).await;
            assert_problem(&other, 422, "idempotency-key-reused");
        }
        assert_eq!(
            s.executions(),
            1,
            "{key}: the handler ran again after a failed completion"
        );
    }
}

/// `Retry-After` on 409 is capped (5 s by default, configurable) and, with the wait policy,
/// what is left of the lease after the wait; 503 carries `Retry-After` (1 s by default,
/// configurable).
pub async fn retry_after_is_capped_recomputed_and_sent_on_503(store: TestStore) {
    let c = client();
    // The default lease is 30 s: the 409 says 5.
    let s = server(&store).await;
    let body = json!({"ra": 1});
    let slow = tokio::spawn(send(
        post(&c, &s, "/items", "ra", &body).header(control::DELAY_MS, "600"),
    ));
    wait_for_executions(&s, 1).await;
    let dup = send(post(&c, &s, "/items", "ra", &body)).await;
    assert_problem(&dup, 409, "idempotency-key-in-progress");
    assert_eq!(retry_after(&dup), 5, "{dup:?}");
    assert_eq!(dup.json()["retry_after"], 5);
    slow.await.expect("first request");

    // A 4 s lease, waited on for 2 s: at most 2 s are left when the duplicate is answered.
    let policy = Policy::default()
        .lease(Duration::from_secs(4))
        .in_flight(InFlight::wait(Duration::from_secs(2)));
    let waiting = TestServer::with_store(store.store.clone(), policy, |l| {
        l.max_retry_after(Duration::from_secs(60))
    })
    .await;
    let slow = tokio::spawn(send(
        post(&c, &waiting, "/items", "ra-wait", &body).header(control::DELAY_MS, "3500"),
    ));
    wait_for_executions(&waiting, 1).await;
    let dup = send(post(&c, &waiting, "/items", "ra-wait", &body)).await;
    assert_problem(&dup, 409, "idempotency-key-in-progress");
    let after = retry_after(&dup);
    assert!(
        (1..=2).contains(&after),
        "Retry-After {after} after a 2 s wait on a 4 s lease"
    );
    slow.await.expect("first request");

    let outage = Outage::new(store.store.clone());
    let down = TestServer::with_store(outage.clone(), Policy::default(), |l| l).await;
    let custom = TestServer::with_store(outage.clone(), Policy::default(), |l| {
        l.unavailable_retry_after(Duration::from_secs(3))
    })
    .await;
    outage.set_down(true);
    let r = send(post(&c, &down, "/items", "ra-down", &body)).await;
    assert_problem(&r, 503, Refusal::StoreUnavailable(String::new()).slug());
    assert_eq!(retry_after(&r), 1);
    let r = send(post(&c, &custom, "/items", "ra-down", &body)).await;
    assert_eq!(retry_after(&r), 3);
}

/// A handler that outlives its lease without a heartbeat loses the key to a retry; its
/// completion is fenced and recorded as `lease_lost` (its client still gets its response),
/// and the retry's response is the one stored.
pub async fn lost_lease_is_its_own_outcome(store: TestStore) {
    let policy = Policy::default()
        .lease(Duration::from_millis(300))
        .heartbeat(None)
        .retention(store.long());
    let s = Arc::new(TestServer::with_store(store.store.clone(), policy, outcome_header).await);
    let c = client();
    let body = json!({"lost": 1});
    let first = {
        let (c, s, body) = (c.clone(), s.clone(), body.clone());
        tokio::spawn(async move {
            send(post(&c, &s, "/items", "lost", &body).header(control::DELAY_MS, "2000")).await
        })
    };
    wait_for_executions(&s, 1).await;
    // The lease passes (a real-time store sleeps; a manual clock moves).
    store.advance(Duration::from_millis(600)).await;
    assert!(!first.is_finished(), "the first handler is still running");
    let takeover = send(post(&c, &s, "/items", "lost", &body)).await;
    assert_eq!(takeover.status, StatusCode::CREATED, "{takeover:?}");
    assert_eq!(
        takeover.header("x-test-outcome"),
        Some("stored"),
        "{takeover:?}"
    );
    assert_eq!(takeover.execution(), 2);
    let first = first.await.expect("first request");
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.execution(), 1);
    assert_eq!(
        first.header("x-test-outcome"),
        Some("lease_lost"),
        "{first:?}"
    );
    let replay = send(post(&c, &s, "/items", "lost", &body)).await;
    assert!(replay.replayed());
    assert_eq!(replay.header("x-test-outcome"), Some("replayed"));
    assert_eq!(
        replay.execution(),
        2,
        "the fenced completion did not overwrite the record"
    );
}
