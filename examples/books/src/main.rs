//! `cargo run -p books-api`: serves the books API on 127.0.0.1 and prints its URL.
//!
//! `BOOKS_PORT` picks the port (default: an ephemeral one); see the crate README for the other
//! variables.

use books_api::{start, Config};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = Config::from_env()?;
    let port = match std::env::var("BOOKS_PORT") {
        Ok(p) => p
            .parse()
            .map_err(|e| format!("BOOKS_PORT={p} is not a port: {e}"))?,
        Err(_) => 0,
    };
    let running = start(&config, port).await?;
    println!("books API listening on {}", running.url);
    eprintln!(
        "books table: {} · idempotency store: {:?}",
        config.database.display(),
        config.store
    );
    running.task.await??;
    Ok(())
}
