//! Upstream: publish one request, and see a bad one refused before it reaches the broker.
//!
//! With txflow running locally (`make up`, then `source $TXFLOW_RUN/services.env`, by default
//! `~/.cache/txflow/run/services.env`):
//!
//!     cargo run -p txflow-client --example publish -- 0x<signer the signer gateway holds>
//!
//! Reads TXFLOW_BROKERS, TXFLOW_SCHEMA_REGISTRY_URL, TXFLOW_TOPIC_PREFIX (default `txflow`) and
//! TXFLOW_CHAIN_ID (default 31337).

use txflow_client::{ClientError, Producer, Settings, TxRequest};

fn settings() -> anyhow::Result<Settings> {
    let var = |k: &str| std::env::var(k).map_err(|_| anyhow::anyhow!("{k} is not set"));
    Ok(Settings {
        brokers: var("TXFLOW_BROKERS")?,
        schema_registry_url: var("TXFLOW_SCHEMA_REGISTRY_URL")?,
        topic_prefix: var("TXFLOW_TOPIC_PREFIX").unwrap_or_else(|_| "txflow".into()),
        chain_id: var("TXFLOW_CHAIN_ID").map_or(Ok(31337), |v| v.parse())?,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let signer = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: publish 0x<signer>"))?;
    let settings = settings()?;
    let producer = Producer::new(&settings)?;
    let request_id = format!("example-{}", uuid::Uuid::new_v4());
    let request = TxRequest {
        event_id: uuid::Uuid::new_v4().to_string(),
        request_id: request_id.clone(),
        chain_id: settings.chain_id,
        signer,
        to: "0x000000000000000000000000000000000000dEaD".into(),
        value: "1".into(),
        data: Vec::new(),
        gas_limit: None,
        max_fee_per_gas: None,
        max_priority_fee_per_gas: None,
        metadata: Default::default(),
        depends_on_request_id: None,
        depends_on_signer: None,
        submitted_by: None,
    };
    let at = producer.publish(&request).await?;
    println!(
        "published {request_id} at partition {} offset {}",
        at.partition, at.offset
    );

    // The same request with a bad address: refused here, with the allocator's code.
    let bad = TxRequest {
        to: "0xnot-an-address".into(),
        ..request
    };
    match producer.publish(&bad).await {
        Err(ClientError::Invalid(e)) => println!("refused before the broker: {}", e.code),
        other => anyhow::bail!("expected INVALID_TO, got {other:?}"),
    }
    Ok(())
}
