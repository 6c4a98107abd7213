//! txflow-client against the real broker, registry, PostgreSQL and anvil: a request published by
//! `Producer` is executed once and `OutcomeReader`'s book shows it booked exactly as the chain
//! holds it; a request that breaks the contract is refused before the broker and nothing of it
//! reaches `tx.requests` or PostgreSQL; the same request published twice executes once and is
//! booked once.

use std::time::Duration;

use txflow_client::{ClientError, OutcomeReader, Producer, ReadOptions, Settings};
use txflow_tests::pipeline::Pipeline;

const LONG: Duration = Duration::from_secs(240);

fn settings(p: &Pipeline) -> Settings {
    Settings {
        brokers: p.config.kafka.brokers.clone(),
        schema_registry_url: p.config.schema_registry_url.clone(),
        topic_prefix: p.config.topics.prefix.clone(),
        chain_id: p.config.chain_id,
    }
}

/// A reader of `tx.outcomes` and `tx.confirmations` from their beginning.
async fn open_reader(settings: &Settings) -> OutcomeReader {
    OutcomeReader::open(
        settings,
        ReadOptions {
            confirmations: true,
        },
    )
    .await
    .expect("reader")
}

#[tokio::test]
async fn a_published_request_is_booked_as_the_chain_holds_it_and_a_bad_one_never_leaves_the_client()
{
    let mut p = Pipeline::prepare(1, |c| c.confirmations_required = 2).await;
    let config = p.config.clone();
    p.start_all_stages(&config).await;
    let settings = settings(&p);
    let producer = Producer::new(&settings).expect("producer");

    let bad = txflow_client::TxRequest {
        to: "0x1234".into(),
        ..p.request(0, "bad-1")
    };
    match producer.publish(&bad).await {
        Err(ClientError::Invalid(e)) => assert_eq!(e.code, "INVALID_TO"),
        other => panic!("expected INVALID_TO before the broker, got {other:?}"),
    }
    let wrong_chain = txflow_client::TxRequest {
        chain_id: settings.chain_id + 1,
        ..p.request(0, "bad-2")
    };
    match producer.publish(&wrong_chain).await {
        Err(ClientError::Invalid(e)) => assert_eq!(e.code, "WRONG_CHAIN"),
        other => panic!("expected WRONG_CHAIN before the broker, got {other:?}"),
    }

    let good = p.request(0, "good-1");
    producer.publish(&good).await.expect("published");
    // A redelivery by the upstream (a new event id, the same request).
    let again = txflow_client::TxRequest {
        event_id: uuid::Uuid::new_v4().to_string(),
        ..good.clone()
    };
    producer.publish(&again).await.expect("published again");

    let mut reader = open_reader(&settings).await;
    let deadline = tokio::time::Instant::now() + LONG;
    while !reader
        .book()
        .by_request(&p.signer(0), "good-1")
        .iter()
        .any(|v| v.executed())
    {
        assert!(tokio::time::Instant::now() < deadline, "never booked");
        reader.poll(Duration::from_millis(500)).await.expect("poll");
    }
    // Read on a little: a second booking would show now.
    reader.poll(Duration::from_secs(2)).await.expect("poll");

    let views = reader.book().by_request(&p.signer(0), "good-1");
    assert_eq!(views.len(), 1, "one transaction for the request: {views:?}");
    let booked = views[0].booked.clone().expect("booked");
    assert!(booked.success);
    let mined = p.mined().await;
    assert_eq!(mined.len(), 1, "mined once: {mined:?}");
    assert_eq!(mined[0].marker(), "txflow:good-1");
    assert_eq!(booked.nonce, mined[0].nonce as i64);
    assert_eq!(
        booked.block_number, mined[0].block as i64,
        "booked in the block the chain holds it in"
    );
    assert_eq!(
        p.count("SELECT count(*) FROM managed_tx WHERE request_id LIKE 'bad-%'")
            .await,
        0,
        "a refused request never reached the allocator"
    );

    // A second reader that only reads through a barrier (an empty record produced to each
    // partition of tx.outcomes now, no poll of its own) holds every event the first one read.
    let outcomes = p.config.topics.tx_outcomes();
    let barrier = txflow_tests::producer(&p.config.kafka);
    let mut marks = Vec::new();
    for partition in 0..p.config.partitions {
        let d = barrier
            .send(
                rdkafka::producer::FutureRecord::<[u8], [u8]>::to(&outcomes)
                    .partition(partition)
                    .payload(&[]),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .expect("barrier produced");
        marks.push((outcomes.clone(), d.partition, d.offset));
    }
    let mut late = open_reader(&settings).await;
    assert!(
        late.read_through(&marks, LONG).await.expect("read through"),
        "read past the barrier before the deadline"
    );
    assert!(
        late.unreadable >= marks.len() as u64,
        "the barrier's records are read and are not events: {}",
        late.unreadable
    );
    assert!(
        late.book().outcomes_read() >= reader.book().outcomes_read(),
        "the late reader holds {} events, the first read {}",
        late.book().outcomes_read(),
        reader.book().outcomes_read()
    );
    assert_eq!(late.book().journal(), reader.book().journal());
    let late_views = late.book().by_request(&p.signer(0), "good-1");
    assert_eq!(late_views.len(), 1, "{late_views:?}");
    assert_eq!(late_views[0].booked.as_ref(), Some(&booked));
    p.stop().await;
}
