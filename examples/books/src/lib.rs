#![doc = include_str!("../README.md")]

pub mod book;
mod dynamo;
pub mod repo;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use book::{validate, Book, Issue};
use idempotency_core::{is_json_media_type, Idempotency, IdempotencyStore, Maintenance, Policy};
use idempotency_tower::{ClaimedKey, IdempotencyLayer, NothingDone, RoutePart};
use repo::{BookRepo, RepoError, Update};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Where the API's problem types live; the idempotency layer's refusals use the same base.
pub const PROBLEM_BASE: &str = "urn:books-api:problem:";

/// The media type of a JSON Merge Patch.
pub const MERGE_PATCH: &str = "application/merge-patch+json";

/// The patch formats PATCH accepts, as `Accept-Patch` lists them.
pub const ACCEPT_PATCH: &str = "application/merge-patch+json, application/json";

/// The key prefix of the service's records when they live in Redis.
pub const REDIS_PREFIX: &str = "books-api:";

/// The books table's name in MariaDB, after [`Config::mysql_table_prefix`].
pub const MYSQL_BOOKS_TABLE: &str = "books";

/// Which idempotency store records the keys.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreChoice {
    /// The `idempotency_records` table in the books' SQLite file (the default).
    Sqlite,
    /// In process; keys are forgotten on restart.
    Memory,
    /// A Postgres server at this URL (records in `idempotency_records`, migrated at start).
    Postgres(String),
    /// A Redis server at this URL (records under the `books-api:` key prefix).
    Redis(String),
    /// A MariaDB server at this URL, in the database the URL names: the books move there too,
    /// in `<prefix>books` beside the records in `<prefix>idempotency_records`
    /// ([`Config::mysql_table_prefix`]), both created at start.
    Mysql(String),
    /// DynamoDB at this endpoint URL (a local stand-in, such as moto's server, in the tests):
    /// the books move there too, in the table `<prefix>books` beside the records in
    /// `<prefix>idempotency` ([`Config::dynamodb_table_prefix`]), both created when missing.
    /// Credentials and region come from `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
    /// `AWS_REGION` (for a stand-in, any values; `local` and `us-east-1` when unset).
    Dynamodb(String),
}

/// How the service is set up.
#[derive(Clone, Debug)]
pub struct Config {
    /// The SQLite file holding the books table (and, with [`StoreChoice::Sqlite`], the
    /// idempotency records). With [`StoreChoice::Postgres`] or [`StoreChoice::Mysql`] the books
    /// are in that server instead.
    pub database: PathBuf,
    /// The idempotency store.
    pub store: StoreChoice,
    /// With [`StoreChoice::Postgres`]: the schema holding the books table and the idempotency
    /// records (created when missing).
    pub postgres_schema: String,
    /// With [`StoreChoice::Mysql`]: the prefix of the two tables' names, `<prefix>books` and
    /// `<prefix>idempotency_records`, in the URL's database (created when missing). MariaDB has
    /// no schemas inside a database: the prefix keeps services that share one database apart,
    /// as the Postgres schema does. Empty by default; ASCII letters, digits and `_`.
    pub mysql_table_prefix: String,
    /// With [`StoreChoice::Dynamodb`]: the prefix of the two tables' names, `<prefix>books`
    /// and `<prefix>idempotency`. `books-api-` by default.
    pub dynamodb_table_prefix: String,
    /// The engine policy (lease, retention, in-flight behaviour).
    pub policy: Policy,
    /// How often expired idempotency records are purged.
    pub purge_every: Duration,
}

fn env_secs(name: &str) -> Result<Option<Duration>, ConfigError> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => match v.parse::<f64>() {
            Ok(secs) if secs.is_finite() && secs > 0.0 && secs < 1e9 => {
                Ok(Some(Duration::from_secs_f64(secs)))
            }
            _ => Err(ConfigError(format!(
                "{name}={v} is not a positive number of seconds"
            ))),
        },
    }
}

/// A configuration error, with what to set.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);

impl Config {
    /// The books in `database` (a SQLite file), the keys in `store`, with the default policy,
    /// the `public` Postgres schema, no MariaDB table prefix and a purge every minute.
    pub fn new(database: impl Into<PathBuf>, store: StoreChoice) -> Self {
        Self {
            database: database.into(),
            store,
            postgres_schema: "public".to_owned(),
            mysql_table_prefix: String::new(),
            dynamodb_table_prefix: "books-api-".to_owned(),
            policy: Policy::default(),
            purge_every: Duration::from_secs(60),
        }
    }

    /// Reads `BOOKS_DATABASE` (default: `books-api.sqlite3` in the temp directory),
    /// `BOOKS_STORE` (`sqlite`, the default, `postgres`, `mysql`, `redis`, `dynamodb` or
    /// `memory`) and, for
    /// Postgres, `BOOKS_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and
    /// `BOOKS_POSTGRES_SCHEMA` (default `public`), for MariaDB, `BOOKS_MYSQL_URL` (default
    /// `mysql://root@127.0.0.1:3306/test`) and `BOOKS_MYSQL_TABLE_PREFIX` (default empty), for
    /// Redis, `BOOKS_REDIS_URL` (default `redis://127.0.0.1:6379`); for DynamoDB,
    /// `BOOKS_DYNAMODB_URL` (default `http://127.0.0.1:8000`) and
    /// `BOOKS_DYNAMODB_TABLE_PREFIX` (default `books-api-`);
    /// `BOOKS_KEY_RETENTION_SECS` (default 86400), `BOOKS_LEASE_SECS` (default 30) and
    /// `BOOKS_PURGE_EVERY_SECS` (default 60).
    pub fn from_env() -> Result<Self, ConfigError> {
        let database = std::env::var_os("BOOKS_DATABASE")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("books-api.sqlite3"));
        let store = match std::env::var("BOOKS_STORE").as_deref() {
            Err(_) | Ok("sqlite") => StoreChoice::Sqlite,
            Ok("memory") => StoreChoice::Memory,
            Ok("postgres") => StoreChoice::Postgres(
                std::env::var("BOOKS_POSTGRES_URL")
                    .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
            ),
            Ok("mysql") => StoreChoice::Mysql(
                std::env::var("BOOKS_MYSQL_URL")
                    .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned()),
            ),
            Ok("redis") => StoreChoice::Redis(
                std::env::var("BOOKS_REDIS_URL")
                    .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned()),
            ),
            Ok("dynamodb") => StoreChoice::Dynamodb(
                std::env::var("BOOKS_DYNAMODB_URL")
                    .unwrap_or_else(|_| "http://127.0.0.1:8000".to_owned()),
            ),
            Ok(other) => {
                return Err(ConfigError(format!(
                    "BOOKS_STORE={other} is not supported \
                     (use: sqlite, postgres, mysql, redis, dynamodb, memory)"
                )))
            }
        };
        let mut policy = Policy::default();
        if let Some(ttl) = env_secs("BOOKS_KEY_RETENTION_SECS")? {
            policy = policy.retention(ttl);
        }
        if let Some(lease) = env_secs("BOOKS_LEASE_SECS")? {
            policy = policy.lease(lease);
        }
        policy
            .validate()
            .map_err(|e| ConfigError(format!("the idempotency policy is invalid: {e}")))?;
        Ok(Self {
            database,
            store,
            postgres_schema: std::env::var("BOOKS_POSTGRES_SCHEMA")
                .unwrap_or_else(|_| "public".to_owned()),
            mysql_table_prefix: std::env::var("BOOKS_MYSQL_TABLE_PREFIX").unwrap_or_default(),
            dynamodb_table_prefix: std::env::var("BOOKS_DYNAMODB_TABLE_PREFIX")
                .unwrap_or_else(|_| "books-api-".to_owned()),
            policy,
            purge_every: env_secs("BOOKS_PURGE_EVERY_SECS")?.unwrap_or(Duration::from_secs(60)),
        })
    }

    /// With [`StoreChoice::Dynamodb`]: the names of the books table and of the idempotency
    /// records' table, `(<prefix>books, <prefix>idempotency)`.
    pub fn dynamodb_tables(&self) -> (String, String) {
        let prefix = &self.dynamodb_table_prefix;
        (format!("{prefix}books"), format!("{prefix}idempotency"))
    }

    /// With [`StoreChoice::Mysql`]: the names of the books table and of the idempotency
    /// records' table, `(<prefix>books, <prefix>idempotency_records)`.
    pub fn mysql_tables(&self) -> (String, String) {
        let prefix = &self.mysql_table_prefix;
        (
            format!("{prefix}{MYSQL_BOOKS_TABLE}"),
            format!("{prefix}{}", idempotency_mysql::TableName::DEFAULT_TABLE),
        )
    }
}

/// What the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// The books table.
    pub books: BookRepo,
    /// How long idempotency keys are kept, as the service publishes it.
    pub key_retention: Duration,
    /// The idempotency engine (and its store).
    pub engine: Idempotency,
}

/// A wrapper for the create handler's method router, applied under the idempotency layer:
/// see [`build_with`].
pub type WrapCreate =
    Box<dyn FnOnce(MethodRouter<Arc<AppState>>) -> MethodRouter<Arc<AppState>> + Send>;

/// A failure while building the service.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The books table could not be opened.
    #[error(transparent)]
    Books(#[from] RepoError),
    /// The idempotency engine could not be set up.
    #[error(transparent)]
    Idempotency(#[from] idempotency_core::Error),
    /// The SQLite idempotency store could not be opened or migrated.
    #[error(transparent)]
    Sqlite(#[from] idempotency_sqlite::SqliteError),
    /// The Postgres idempotency store could not be reached or migrated.
    #[error(transparent)]
    Postgres(#[from] idempotency_postgres::PostgresError),
    /// The MariaDB idempotency store could not be reached or migrated, or a table name made
    /// with [`Config::mysql_table_prefix`] is not valid.
    #[error(transparent)]
    Mysql(#[from] idempotency_mysql::MySqlError),
    /// The DynamoDB store's table names are not valid.
    #[error(transparent)]
    Dynamodb(#[from] idempotency_dynamodb::DynamoError),
}

/// An SDK client for DynamoDB at `endpoint`, over plain HTTP or HTTPS as the URL says, with
/// the credentials and region of the environment (`local` and `us-east-1` when unset). A
/// service on AWS would build its client with `aws-config` instead.
fn dynamodb_client(endpoint: &str) -> idempotency_dynamodb::aws_sdk_dynamodb::Client {
    use idempotency_dynamodb::aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let config = idempotency_dynamodb::aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(env("AWS_REGION", "us-east-1")))
        .endpoint_url(endpoint)
        .credentials_provider(Credentials::new(
            env("AWS_ACCESS_KEY_ID", "local"),
            env("AWS_SECRET_ACCESS_KEY", "local"),
            None,
            None,
            "environment",
        ))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    idempotency_dynamodb::aws_sdk_dynamodb::Client::from_conf(config)
}

/// The caller identity, from `Authorization: Bearer <token>`. The example accepts any token:
/// it stands for whatever your authentication establishes.
#[derive(Clone, Debug)]
pub struct Caller(pub String);

async fn authenticate(mut req: Request, next: Next) -> Response {
    let caller = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| Caller(t.to_owned()));
    if let Some(caller) = caller {
        req.extensions_mut().insert(caller);
    }
    next.run(req).await
}

/// The idempotency store `config` names, and the books table beside it: in the same SQLite
/// file, Postgres schema or MariaDB database (under the same table prefix) when the records are
/// there, so that a create and its completion commit together.
pub async fn stores(config: &Config) -> Result<(Arc<dyn IdempotencyStore>, BookRepo), BuildError> {
    match config.store {
        StoreChoice::Sqlite => {
            let store = idempotency_sqlite::SqliteStore::open(&config.database).await?;
            store.migrate().await?;
            let books = BookRepo::open_sqlite(&config.database, Some(store.clone()))?;
            Ok((Arc::new(store), books))
        }
        StoreChoice::Memory => Ok((
            Arc::new(idempotency_memory::MemoryStore::new()),
            BookRepo::open_sqlite(&config.database, None)?,
        )),
        StoreChoice::Postgres(ref url) => {
            let store = idempotency_postgres::PostgresStore::builder()
                .schema(config.postgres_schema.clone())
                .connect(url)
                .await?;
            store.migrate().await?;
            let books = BookRepo::open_postgres(store.clone()).await?;
            Ok((Arc::new(store), books))
        }
        StoreChoice::Mysql(ref url) => {
            let (books_table, records_table) = config.mysql_tables();
            // Both names are checked before anything is created.
            let books_table = idempotency_mysql::TableName::new(&books_table)?;
            let store = idempotency_mysql::MySqlStore::builder()
                .table(records_table)
                .connect(url)
                .await?;
            store.migrate().await?;
            let books = BookRepo::open_mysql(store.clone(), &books_table).await?;
            Ok((Arc::new(store), books))
        }
        StoreChoice::Dynamodb(ref url) => {
            let (books_table, records_table) = config.dynamodb_tables();
            let store = idempotency_dynamodb::DynamoStore::builder()
                .table(records_table)
                .build(dynamodb_client(url))?;
            // Created when missing (a table of another shape is refused by `verify`). Another
            // instance starting at once may be creating it: then it passes `verify` shortly.
            if let Err(mut e) = store.verify().await {
                if store.create_table().await.is_err() {
                    let mut verified = false;
                    for _ in 0..50 {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        match store.verify().await {
                            Ok(()) => {
                                verified = true;
                                break;
                            }
                            Err(again) => e = again,
                        }
                    }
                    if !verified {
                        return Err(e.into());
                    }
                }
            }
            let books = BookRepo::open_dynamodb(store.clone(), books_table).await?;
            Ok((Arc::new(store), books))
        }
        StoreChoice::Redis(ref url) => {
            let store = idempotency_redis::RedisStore::builder()
                .prefix(REDIS_PREFIX)
                .connect(url.as_str())
                .await?;
            Ok((
                Arc::new(store),
                BookRepo::open_sqlite(&config.database, None)?,
            ))
        }
    }
}

/// Builds the router and its state.
///
/// `POST /books` requires an `Idempotency-Key`; `PATCH /books/{id}` takes one optionally. Both
/// are scoped to the caller. A PATCH answered `412 Precondition Failed` changed nothing, so it
/// is not stored and says it did nothing: the key is free at once for the retry with a fresh
/// `If-Match`.
pub async fn build(config: &Config) -> Result<(Router, Arc<AppState>), BuildError> {
    build_with(config, Box::new(|create| create)).await
}

/// [`build`], with `wrap_create` applied to the `POST /books` handler under the idempotency
/// layer, so that what it adds runs only for a request that holds its key. The tests put their
/// fault injection there (a slow create, a create that fails), outside the service's code:
///
/// ```no_run
/// # async fn demo(config: books_api::Config) -> Result<(), books_api::BuildError> {
/// use axum::middleware::{from_fn, Next};
/// use axum::extract::Request;
///
/// let (router, _state) = books_api::build_with(
///     &config,
///     Box::new(|create| {
///         create.layer(from_fn(|req: Request, next: Next| async move {
///             tokio::time::sleep(std::time::Duration::from_millis(100)).await;
///             next.run(req).await
///         }))
///     }),
/// )
/// .await?;
/// # let _ = router; Ok(()) }
/// ```
pub async fn build_with(
    config: &Config,
    wrap_create: WrapCreate,
) -> Result<(Router, Arc<AppState>), BuildError> {
    let (store, books) = stores(config).await?;
    let engine: Idempotency = Idempotency::builder(store)
        .policy(config.policy.clone())
        .build()?
        .into();
    let state = Arc::new(AppState {
        books,
        key_retention: config.policy.retention,
        engine: engine.clone(),
    });
    let caller = |req: &http::request::Parts| req.extensions.get::<Caller>().map(|c| c.0.clone());
    let create_layer = IdempotencyLayer::per_caller(engine.clone(), caller)
        .required(true)
        .methods([http::Method::POST])
        .problem_type_base(PROBLEM_BASE)
        .route(RoutePart::Template);
    let patch_layer = IdempotencyLayer::per_caller(engine, caller)
        .methods([http::Method::PATCH])
        .problem_type_base(PROBLEM_BASE)
        .route(RoutePart::Template);
    let router = Router::new()
        .route("/", get(describe))
        .route(
            "/books",
            wrap_create(post(create))
                .route_layer(create_layer)
                .get(list),
        )
        .route(
            "/books/{id}",
            get(show).patch(update).route_layer(patch_layer),
        )
        .with_state(state.clone())
        .layer(middleware::from_fn(authenticate));
    Ok((router, state))
}

/// `GET /`: what the service is, and its idempotency-key policy (the draft asks servers to
/// publish how long keys are kept).
async fn describe(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({
        "service": "books-api",
        "idempotency": {
            "header": "Idempotency-Key",
            "required_for": ["POST /books"],
            "optional_for": ["PATCH /books/{id}"],
            "key_retention_seconds": state.key_retention.as_secs(),
            "scope": "per caller (Authorization: Bearer <token>), method and route",
        }
    }))
    .into_response()
}

fn problem(status: StatusCode, slug: &str, title: &str, detail: Option<String>) -> Response {
    let mut doc = json!({
        "type": format!("{PROBLEM_BASE}{slug}"),
        "title": title,
        "status": status.as_u16(),
    });
    if let Some(detail) = detail {
        doc["detail"] = detail.into();
    }
    problem_doc(status, doc)
}

fn problem_doc(status: StatusCode, doc: Value) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        )],
        doc.to_string(),
    )
        .into_response()
}

fn validation_failed(issues: Vec<Issue>) -> Response {
    problem_doc(
        StatusCode::UNPROCESSABLE_ENTITY,
        json!({
            "type": format!("{PROBLEM_BASE}validation-failed"),
            "title": "The request failed validation",
            "status": 422,
            "errors": issues,
        }),
    )
}

fn internal(e: impl std::fmt::Display) -> Response {
    tracing::error!(error = %e, "request failed");
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "The request failed on the server",
        None,
    )
}

fn not_found() -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "not-found",
        "The resource does not exist",
        Some("No book has that id.".into()),
    )
}

/// The book's representation with its ETag, bytes in memory (so that a create can store it
/// with the book's own transaction).
fn book_reply(status: StatusCode, book: &Book) -> http::Response<Bytes> {
    let body = serde_json::to_vec(&book.representation()).unwrap_or_default();
    let mut resp = http::Response::new(Bytes::from(body));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Ok(tag) = HeaderValue::from_str(&book.etag()) {
        h.insert(header::ETAG, tag);
    }
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, no-cache"),
    );
    resp
}

fn book_response(status: StatusCode, book: &Book) -> Response {
    book_reply(status, book).map(axum::body::Body::from)
}

fn bad_json(e: serde_json::Error) -> Response {
    problem(
        StatusCode::BAD_REQUEST,
        "bad-request",
        "The request is malformed",
        Some(format!("the body is not valid JSON: {e}")),
    )
}

fn content_type(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
}

fn media_essence(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// The 201 answer for a new book.
fn created_response(book: &Book) -> http::Response<Bytes> {
    let mut resp = book_reply(StatusCode::CREATED, book);
    if let Ok(loc) = HeaderValue::from_str(&format!("/books/{}", book.id)) {
        resp.headers_mut().insert(header::LOCATION, loc);
    }
    resp
}

/// `POST /books`. With the idempotency records in the books' database (SQLite, the default,
/// Postgres, MariaDB or DynamoDB), the book row and the key's completion commit in one transaction: a
/// crash between the insert and the answer leaves either both (the retry replays the 201) or
/// neither (the retry creates the book, once).
async fn create(
    State(state): State<Arc<AppState>>,
    claim: Option<ClaimedKey>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !content_type(&headers).is_some_and(is_json_media_type) {
        let mut resp = problem(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "The request body's media type is not accepted",
            Some("send the book as application/json".into()),
        );
        resp.headers_mut()
            .insert("accept-post", HeaderValue::from_static("application/json"));
        return resp;
    }
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad_json(e),
    };
    let input = match validate(&value) {
        Ok(input) => input,
        Err(issues) => return validation_failed(issues),
    };
    let book = Book::new(uuid::Uuid::new_v4().to_string(), input);
    let Some(claim) = claim.filter(|_| state.books.completes_in_transaction()) else {
        return match state.books.create(&book).await {
            Ok(()) => created_response(&book)
                .map(axum::body::Body::from)
                .into_response(),
            Err(e) => internal(e),
        };
    };
    // The book row and the stored 201 commit together, and the key is settled with the
    // layer whatever the end: a retry gets the 201 replayed, or creates the book once.
    match state
        .books
        .create_completing(&book, &claim, created_response)
        .await
    {
        Ok(resp) => resp.map(axum::body::Body::from).into_response(),
        Err(e) => internal(e),
    }
}

async fn list(State(state): State<Arc<AppState>>) -> Response {
    match state.books.list().await {
        Ok(books) => {
            let books: Vec<Value> = books
                .iter()
                .map(|b| b.representation()["book"].clone())
                .collect();
            axum::Json(json!({ "books": books })).into_response()
        }
        Err(e) => internal(e),
    }
}

/// The entity tags of an `If-Match`/`If-None-Match` list; `None` for `*`.
fn tags(value: &str) -> Option<Vec<&str>> {
    if value.trim() == "*" {
        return None;
    }
    Some(
        value
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .collect(),
    )
}

/// Weak comparison (RFC 9110 §8.8.3.2), as `If-None-Match` uses.
fn none_match(headers: &HeaderMap, current: &str) -> bool {
    let Some(value) = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    match tags(value) {
        None => true,
        Some(list) => list
            .iter()
            .any(|t| t.strip_prefix("W/").unwrap_or(t) == current),
    }
}

/// Strong comparison, as `If-Match` uses: `None` when the header is absent, else whether it
/// matches.
fn if_match(headers: &HeaderMap, current: &str) -> Option<bool> {
    let value = headers.get(header::IF_MATCH)?;
    let Ok(value) = value.to_str() else {
        return Some(false);
    };
    Some(match tags(value) {
        None => true,
        Some(list) => list.iter().any(|t| !t.starts_with("W/") && *t == current),
    })
}

async fn show(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let book = match state.books.get(&id).await {
        Ok(Some(row)) => row.book,
        Ok(None) => return not_found(),
        Err(e) => return internal(e),
    };
    let tag = book.etag();
    if none_match(&headers, &tag) {
        let mut resp = StatusCode::NOT_MODIFIED.into_response();
        if let Ok(v) = HeaderValue::from_str(&tag) {
            resp.headers_mut().insert(header::ETAG, v);
        }
        resp.headers_mut().insert(
            header::CACHE_CONTROL,
            HeaderValue::from_static("private, no-cache"),
        );
        return resp;
    }
    book_response(StatusCode::OK, &book)
}

/// The `412` for a stale `If-Match`. Nothing was written, and the response says so
/// ([`NothingDone`]): the layer does not store it and frees the key at once, so the retry
/// with a fresh `If-Match` runs (without it the layer would store the 412 and replay it to
/// every retry under the key).
fn precondition_failed() -> Response {
    let mut resp = problem(
        StatusCode::PRECONDITION_FAILED,
        "precondition-failed",
        "The resource changed after you read it",
        Some("If-Match does not hold the book's current ETag; read it again".into()),
    );
    resp.extensions_mut().insert(NothingDone);
    resp
}

async fn update(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // A request without If-Match still never overwrites a write it did not see: the write is
    // conditional on the tag read here, and a lost race reads again (a few times).
    for _ in 0..5 {
        let (book, version) = match state.books.get(&id).await {
            Ok(Some(row)) => (row.book, row.version),
            Ok(None) => return not_found(),
            Err(e) => return internal(e),
        };
        let current = book.etag();
        let conditional = match if_match(&headers, &current) {
            Some(false) => return precondition_failed(),
            Some(true) => true,
            None => false,
        };
        let essence = content_type(&headers).map(media_essence);
        if !matches!(
            essence.as_deref(),
            Some(MERGE_PATCH) | Some("application/json")
        ) {
            let mut resp = problem(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported-media-type",
                "The request body's media type is not accepted",
                Some(format!("send a JSON Merge Patch ({MERGE_PATCH})")),
            );
            resp.headers_mut()
                .insert("accept-patch", HeaderValue::from_static(ACCEPT_PATCH));
            return resp;
        }
        let patch: Value = match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return bad_json(e),
        };
        let mut target = Value::Object(book.writable());
        json_patch::merge(&mut target, &patch);
        let input = match validate(&target) {
            Ok(input) => input,
            Err(issues) => return validation_failed(issues),
        };
        match state.books.update_if(&id, version, input).await {
            Ok(Update::Updated(book)) => return book_response(StatusCode::OK, &book),
            Ok(Update::NotFound) => return not_found(),
            Ok(Update::Stale) if conditional => return precondition_failed(),
            Ok(Update::Stale) => continue,
            Err(e) => return internal(e),
        }
    }
    kept_changing()
}

/// The `409` for a patch that lost the race to other writers every time it tried. Nothing was
/// written, so the key must not keep this answer: a retry under the same key should try the
/// patch again, not be replayed "retry".
fn kept_changing() -> Response {
    let mut resp = problem(
        StatusCode::CONFLICT,
        "conflict",
        "The book is being changed by others",
        Some("the book kept changing while this patch was applied; retry".into()),
    );
    resp.extensions_mut().insert(NothingDone);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Answers that say nothing was written free the key for the retry they ask for.
    #[test]
    fn answers_after_writing_nothing_free_the_key() {
        for (name, resp) in [
            ("409 kept changing", kept_changing()),
            ("412 precondition failed", precondition_failed()),
        ] {
            assert!(
                resp.extensions().get::<NothingDone>().is_some(),
                "{name}: the layer would keep this answer for the key"
            );
        }
    }
}

/// A running service, for tests and `main`.
#[derive(Debug)]
pub struct Running {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// The shared state.
    pub state: Arc<AppState>,
    /// The server task.
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
    /// The task purging expired idempotency records every [`Config::purge_every`].
    pub maintenance: Maintenance,
}

/// Builds the service and serves it on `127.0.0.1:port` (0 for an ephemeral port).
pub async fn start(config: &Config, port: u16) -> Result<Running, Box<dyn std::error::Error>> {
    start_with(config, port, Box::new(|create| create)).await
}

/// [`start`] with the create handler wrapped as [`build_with`] does.
pub async fn start_with(
    config: &Config,
    port: u16,
    wrap_create: WrapCreate,
) -> Result<Running, Box<dyn std::error::Error>> {
    let (router, state) = build_with(config, wrap_create).await?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let url = format!("http://{}", listener.local_addr()?);
    let task = tokio::spawn(async move { axum::serve(listener, router).await });
    let maintenance = state
        .engine
        .maintain()
        .purge_every(config.purge_every)
        .spawn();
    Ok(Running {
        url,
        state,
        task,
        maintenance,
    })
}
