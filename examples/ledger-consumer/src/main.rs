//! `ledger-consumer publish N`: publishes N transfers (every tenth twice, as a producer that
//! retried would). `ledger-consumer consume`: applies them until Ctrl-C. `ledger-consumer
//! report`: the ledger's figures. The environment variables are in the crate README.

use ledger_consumer::{BoxError, Config, Ledger};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let config = Config::from_env()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ledger = Ledger::prepare(config).await?;
    match args.first().map(String::as_str).unwrap_or("consume") {
        "consume" => {
            ledger
                .consume(async {
                    let _ = tokio::signal::ctrl_c().await;
                })
                .await
        }
        "publish" => {
            let n: usize = match args.get(1) {
                Some(n) => n.parse().map_err(|e| format!("publish {n}: {e}"))?,
                None => 1000,
            };
            let run = uuid::Uuid::new_v4().simple().to_string();
            let transfers = ledger_consumer::transfers(&run[..8], n, 10);
            ledger.publish(&transfers).await?;
            println!("published {} messages ({n} transfers)", transfers.len());
            Ok(())
        }
        "report" => {
            let report = ledger.report().await?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        other => Err(format!("unknown command {other}: consume, publish [N] or report").into()),
    }
}
