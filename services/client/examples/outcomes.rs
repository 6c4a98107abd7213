//! Downstream: read tx.outcomes into the final view, as a ledger would book it.
//!
//! With txflow running locally (`make up` or `make demo`, then
//! `source ~/.cache/txflow/run/services.env`):
//!
//!     cargo run -p txflow-client --example outcomes
//!
//! Prints each transaction whose TxConfirmed stands (booked) or that failed, then totals.

use std::time::Duration;

use txflow_client::{OutcomeReader, ReadOptions, Settings};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let var = |k: &str| std::env::var(k).map_err(|_| anyhow::anyhow!("{k} is not set"));
    let settings = Settings {
        brokers: var("TXFLOW_BROKERS")?,
        schema_registry_url: var("TXFLOW_SCHEMA_REGISTRY_URL")?,
        topic_prefix: var("TXFLOW_TOPIC_PREFIX").unwrap_or_else(|_| "txflow".into()),
        chain_id: var("TXFLOW_CHAIN_ID").map_or(Ok(31337), |v| v.parse())?,
    };
    let mut reader = OutcomeReader::open(
        &settings,
        ReadOptions {
            confirmations: true,
        },
    )
    .await?;
    // Everything there is now: read until two seconds pass with nothing new.
    let read = reader.poll(Duration::from_secs(2)).await?;
    let (mut booked, mut failed) = (0, 0);
    for v in reader.book().views() {
        if let Some(b) = &v.booked {
            booked += 1;
            println!(
                "booked  {} {} nonce {} block {} success {} (generation {})",
                v.signer, v.request_id, b.nonce, b.block_number, b.success, b.generation
            );
        } else if let Some((code, _)) = &v.failed {
            failed += 1;
            println!("failed  {} {} {code}", v.signer, v.request_id);
        }
    }
    println!(
        "{read} events read; {booked} booked, {failed} failed, {} reversals",
        reader
            .book()
            .journal()
            .iter()
            .filter(|e| matches!(e, txflow_client::Entry::Reverse { .. }))
            .count()
    );
    Ok(())
}
