//! The `idempotency.http` span carries the decision, and keys can be hashed in logs.
#![allow(clippy::unwrap_used)]

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use idempotency_core::{Idempotency, Policy};
use idempotency_memory::MemoryStore;
use idempotency_tower::{IdempotencyLayer, RequestBody};
use std::cell::RefCell;
use std::convert::Infallible;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use tower::{Service, ServiceBuilder, ServiceExt};
use tracing_subscriber::fmt::MakeWriter;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

thread_local! {
    /// Where the logs of this thread go, while a test captures them.
    static CAPTURING: RefCell<Option<Captured>> = const { RefCell::new(None) };
}

/// Writes to the capture of the thread that logs, or nowhere.
struct ThisThread;

impl<'a> MakeWriter<'a> for ThisThread {
    type Writer = Box<dyn Write + 'a>;

    fn make_writer(&'a self) -> Self::Writer {
        match CAPTURING.with(|c| c.borrow().clone()) {
            Some(captured) => Box::new(captured),
            None => Box::new(std::io::sink()),
        }
    }
}

/// One subscriber for the whole process, writing each thread's logs to that thread's capture.
///
/// Not a scoped subscriber per test: `tracing` caches whether a callsite is enabled when the
/// callsite is first hit, and with one scoped subscriber alive, a callsite first hit on
/// another test's thread (no subscriber there) is cached as disabled for every thread (seen
/// in CI: the span of the layer missing from the captured logs).
fn install_subscriber() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_writer(ThisThread)
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("no other subscriber is installed in this test binary");
    });
    // Callsites first hit by other tests before the installation are enabled from now on.
    tracing::callsite::rebuild_interest_cache();
}

async fn call<S>(svc: &mut S, key: &str) -> u16
where
    S: Service<
        Request<Full<Bytes>>,
        Response = Response<idempotency_tower::ResponseBody<Full<Bytes>>>,
        Error = Infallible,
    >,
{
    let req = Request::post("/orders")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"a\":1}")))
        .unwrap();
    let resp = svc.ready().await.unwrap().call(req).await.unwrap();
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await.unwrap();
    status
}

fn service(
    hash: bool,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<idempotency_tower::ResponseBody<Full<Bytes>>>,
    Error = Infallible,
> + Clone {
    let policy = Policy::default().hash_keys_in_logs(hash);
    let engine = Idempotency::new(Arc::new(MemoryStore::new()), policy).unwrap();
    ServiceBuilder::new()
        .layer(IdempotencyLayer::shared(engine))
        .service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        })
}

fn capture(hash: bool) -> String {
    install_subscriber();
    let captured = Captured::default();
    CAPTURING.with(|c| *c.borrow_mut() = Some(captured.clone()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut svc = service(hash);
        assert_eq!(call(&mut svc, "secret-key-1").await, 200);
        assert_eq!(call(&mut svc, "secret-key-1").await, 200);
        assert_eq!(call(&mut svc, "").await, 400);
    });
    drop(rt);
    CAPTURING.with(|c| *c.borrow_mut() = None);
    captured.text()
}

#[test]
fn spans_carry_the_decision_and_outcome() {
    let logs = capture(false);
    assert!(
        logs.contains("decision=\"executed\"") || logs.contains("decision=executed"),
        "{logs}"
    );
    assert!(logs.contains("replayed"), "{logs}");
    assert!(logs.contains("refused"), "{logs}");
    assert!(logs.contains("stored"), "{logs}");
    assert!(
        logs.contains("secret-key-1"),
        "keys are logged in clear by default: {logs}"
    );
}

#[test]
fn keys_can_be_hashed_in_logs() {
    let logs = capture(true);
    assert!(!logs.contains("secret-key-1"), "the key leaked: {logs}");
    assert!(logs.contains(r#"key="sha256:"#), "{logs}");
    assert!(logs.contains(r#"http_decision="replayed""#), "{logs}");
}
