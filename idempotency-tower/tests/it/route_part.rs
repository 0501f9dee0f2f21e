//! The route part of the scope is a setting, never a cargo feature: inside an axum router the
//! default is the request path (two paths of one route are two key spaces), and only
//! `RoutePart::Template` puts them in one (the second is a key reused: 422).
#![cfg(feature = "axum")]
#![allow(clippy::unwrap_used)]

use axum::body::Body;
use axum::routing::patch;
use axum::Router;
use http::{Request, StatusCode};
use idempotency_core::Idempotency;
use idempotency_memory::MemoryStore;
use idempotency_tower::{IdempotencyLayer, RoutePart};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tower::ServiceExt;

/// The statuses of one key sent to `/items/1` then `/items/2` (bodies alike), and the runs.
async fn same_key_on_two_paths(route: Option<RoutePart>) -> (StatusCode, StatusCode, u64) {
    let runs = Arc::new(AtomicU64::new(0));
    let engine = Idempotency::builder(MemoryStore::new()).build().unwrap();
    let mut layer = IdempotencyLayer::shared(engine);
    if let Some(route) = route {
        layer = layer.route(route);
    }
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/items/{id}",
            patch(move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { "patched" }
            }),
        )
        .route_layer(layer);
    let mut statuses = Vec::new();
    for path in ["/items/1", "/items/2"] {
        let req = Request::patch(path)
            .header("idempotency-key", "k-1")
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .unwrap();
        statuses.push(app.clone().oneshot(req).await.unwrap().status());
    }
    (statuses[0], statuses[1], runs.load(Ordering::SeqCst))
}

#[tokio::test]
async fn the_default_route_part_is_the_path_inside_a_router_too() {
    assert_eq!(
        same_key_on_two_paths(None).await,
        (StatusCode::OK, StatusCode::OK, 2)
    );
    assert_eq!(
        same_key_on_two_paths(Some(RoutePart::Path)).await,
        (StatusCode::OK, StatusCode::OK, 2)
    );
}

#[tokio::test]
async fn the_route_template_is_chosen_explicitly() {
    assert_eq!(
        same_key_on_two_paths(Some(RoutePart::Template)).await,
        (StatusCode::OK, StatusCode::UNPROCESSABLE_ENTITY, 1)
    );
}
