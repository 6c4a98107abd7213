//! The Avro contracts of `schemas/`: golden datum round trips, Confluent wire-format round trips
//! through the real Schema Registry, the registry's compatibility checks, and a compatible
//! evolution of one of our own schemas read by old and new readers.
//!
//! Goldens live in `tests/golden/*.hex`. After a deliberate schema change, regenerate them with
//! `TXFLOW_BLESS=1 cargo test -p txflow-tests --test schemas` and review the diff.

use std::collections::BTreeMap;
use std::path::PathBuf;

use apache_avro::Schema;
use apache_avro::types::Value;
use txflow_core::codec::{RegistryCodec, Subjects, decode_datum, encode_datum, value_strategy};
use txflow_core::events::*;
use txflow_tests::{registry_url, unique};

const SIGNER: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";
const TO: &str = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8";
const HASH: &str = "0x5c504ed432cb51138bcf09aa5e8a410dd4a1e204ef84bfed1be16dfba1b22060";
const BLOCK: &str = "0x0d2d6a83b1e1e8ad7a3bd2a5e0ea4a5b6e1b7e0b4f3e6a9f1c2d3e4f5a6b7c8d";
const TX_ID: &str = "0195f3a4-7c2e-7b1a-9c3d-4e5f6a7b8c9d";

fn ev(n: u8) -> String {
    format!("00000000-0000-4000-8000-0000000000{n:02}")
}

fn tx_request() -> TxRequest {
    TxRequest {
        event_id: ev(1),
        request_id: "invoice-2026-0001".into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        to: TO.into(),
        value: "1000000000000000000".into(),
        data: vec![0xa9, 0x05, 0x9c, 0xbb, 0x00, 0x01],
        gas_limit: Some(21_000),
        max_fee_per_gas: Some("3000000000".into()),
        max_priority_fee_per_gas: None,
        metadata: BTreeMap::from([("desk".to_string(), "treasury".to_string())]),
        depends_on_request_id: Some("invoice-2026-0000".into()),
        depends_on_signer: Some(SIGNER.into()),
        submitted_by: Some("op-1".into()),
    }
}
fn tx_accepted() -> TxAccepted {
    TxAccepted {
        event_id: ev(2),
        tx_id: TX_ID.into(),
        request_id: "invoice-2026-0001".into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        fencing_token: 7,
        accepted_at_ms: 1_795_000_000_000,
    }
}
fn tx_allocated() -> TxAllocated {
    TxAllocated {
        event_id: ev(3),
        tx_id: TX_ID.into(),
        request_id: "invoice-2026-0001".into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        nonce: 42,
        to: TO.into(),
        value: "1000000000000000000".into(),
        data: vec![],
        gas_limit: 21_000,
        max_fee_per_gas: "3000000000".into(),
        max_priority_fee_per_gas: "1000000000".into(),
        fencing_token: 7,
    }
}
fn tx_signed() -> TxSigned {
    TxSigned {
        event_id: ev(4),
        tx_id: TX_ID.into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        nonce: 42,
        attempt: 1,
        tx_hash: HASH.into(),
        raw_tx: vec![0x02, 0xf8, 0x6b, 0x82, 0x7a, 0x69],
        max_fee_per_gas: "3000000000".into(),
        max_priority_fee_per_gas: "1000000000".into(),
        fencing_token: 7,
    }
}
fn tx_submitted() -> TxSubmitted {
    TxSubmitted {
        event_id: ev(5),
        tx_id: TX_ID.into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        nonce: 42,
        attempt: 1,
        tx_hash: HASH.into(),
        outcome: SubmitOutcome::PossiblySent,
        submitted_at_ms: 1_795_000_000_123,
        fencing_token: 7,
    }
}
fn tx_receipt_updated() -> TxReceiptUpdated {
    TxReceiptUpdated {
        event_id: ev(6),
        tx_id: TX_ID.into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        nonce: 42,
        status: ReceiptStatus::Mined,
        tx_hash: Some(HASH.into()),
        block_number: Some(1234),
        block_hash: Some(BLOCK.into()),
        gas_used: Some(21_000),
        effective_gas_price: Some("1000000007".into()),
        fencing_token: 7,
    }
}
fn tx_confirmations_updated() -> TxConfirmationsUpdated {
    TxConfirmationsUpdated {
        event_id: ev(7),
        tx_id: TX_ID.into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        nonce: 42,
        tx_hash: HASH.into(),
        new_fork: true,
        confirmations: vec![
            BlockRef {
                number: 1234,
                hash: BLOCK.into(),
                parent_hash: HASH.into(),
            },
            BlockRef {
                number: 1235,
                hash: HASH.into(),
                parent_hash: BLOCK.into(),
            },
        ],
        required_confirmations: 12,
        fencing_token: 7,
    }
}
fn tx_confirmed() -> TxConfirmed {
    TxConfirmed {
        event_id: ev(8),
        tx_id: TX_ID.into(),
        request_id: "invoice-2026-0001".into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        nonce: 42,
        tx_hash: HASH.into(),
        block_number: 1234,
        block_hash: BLOCK.into(),
        success: true,
        confirmations: 12,
        fencing_token: 7,
        reorg_generation: 1,
        revert_reason: None,
    }
}
fn tx_confirmation_reverted() -> TxConfirmationReverted {
    TxConfirmationReverted {
        event_id: ev(16),
        tx_id: TX_ID.into(),
        request_id: "invoice-2026-0001".into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        nonce: 42,
        tx_hash: HASH.into(),
        block_number: 1234,
        block_hash: BLOCK.into(),
        success: true,
        reorg_generation: 0,
        reverted_event_id: ev(8),
        required_confirmations: 12,
        fencing_token: 7,
    }
}
fn tx_failed() -> TxFailed {
    TxFailed {
        event_id: ev(9),
        tx_id: TX_ID.into(),
        request_id: "invoice-2026-0002".into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        code: "SIMULATION_REVERTED".into(),
        reason: "execution reverted".into(),
        nonce: None,
        nonce_released: false,
        fencing_token: 7,
    }
}
fn tx_command() -> TxCommand {
    TxCommand {
        event_id: ev(10),
        tx_id: TX_ID.into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        command: TxCommandKind::Approve,
        requested_by: "ops@example.com".into(),
        reason: Some("within the desk's limit".into()),
    }
}

fn tx_replaced() -> TxReplaced {
    TxReplaced {
        event_id: ev(11),
        tx_id: TX_ID.into(),
        chain_id: 31337,
        signer: SIGNER.into(),
        nonce: 4,
        chain_nonce: 6,
        reason: "-32003: nonce too low".into(),
        fencing_token: 7,
    }
}

fn spot_command() -> SpotCommand {
    SpotCommand {
        event_id: ev(12),
        req_id: TX_ID.into(),
        user_id: "user-42".into(),
        asset: "USDT".into(),
        amount: "1250.000001".into(),
        op: SpotOp::Debit,
        compensation: false,
        external: true,
    }
}

fn spot_reply() -> SpotReply {
    SpotReply {
        event_id: ev(13),
        req_id: TX_ID.into(),
        op: SpotOp::Debit,
        user_id: "user-42".into(),
        asset: "USDT".into(),
        outcome: SpotOutcome::Rejected,
        code: Some("INSUFFICIENT_BALANCE".into()),
        balance: Some("17.5".into()),
        wal_seq: Some(9),
        replied_at_ms: 1_735_000_000_000,
        external_net: Some("-2.5".into()),
    }
}

fn transfer_requested() -> TransferRequested {
    TransferRequested {
        event_id: ev(14),
        req_id: TX_ID.into(),
        user_id: "user-42".into(),
        asset: "USDT".into(),
        amount: "1250.000001".into(),
        from_account: "FUNDING".into(),
        to_account: "SPOT".into(),
        created_at_ms: 1_735_000_000_000,
        traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
    }
}

fn transfer_updated() -> TransferUpdated {
    TransferUpdated {
        event_id: ev(15),
        req_id: TX_ID.into(),
        user_id: "user-42".into(),
        asset: "USDT".into(),
        amount: "1250.000001".into(),
        from_account: "SPOT".into(),
        to_account: "FUNDING".into(),
        state: "COMPENSATING".into(),
        state_id: -20,
        error_code: Some("ACCOUNT_DISABLED".into()),
        fencing_token: 7,
        updated_at_ms: 1_735_000_000_001,
    }
}

fn golden_path(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("golden")
        .join(file.replace(".avsc", ".hex"))
}

/// Encodes `e`, compares with its golden bytes, and decodes them back to `e`.
fn golden<E: Event>(e: E) {
    let bytes = encode_datum(&e).unwrap_or_else(|err| panic!("{}: {err:?}", E::FULL_NAME));
    let path = golden_path(E::SCHEMA_FILE);
    if std::env::var("TXFLOW_BLESS").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().expect("golden dir")).expect("mkdir golden");
        std::fs::write(&path, hex::encode(&bytes) + "\n").expect("write golden");
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "no golden at {}: run with TXFLOW_BLESS=1 once and review it",
            path.display()
        )
    });
    assert_eq!(
        hex::encode(&bytes),
        want.trim(),
        "{} bytes differ from {}",
        E::FULL_NAME,
        path.display()
    );
    let golden_bytes = hex::decode(want.trim()).expect("golden is hex");
    let back: E = decode_datum(E::schema(), &golden_bytes).expect("golden decodes");
    assert_eq!(back, e, "{} round trip", E::FULL_NAME);
}

#[test]
fn every_schema_round_trips_its_golden_datum() {
    golden(tx_request());
    golden(tx_accepted());
    golden(tx_allocated());
    golden(tx_signed());
    golden(tx_submitted());
    golden(tx_receipt_updated());
    golden(tx_confirmations_updated());
    golden(tx_confirmed());
    golden(tx_confirmation_reverted());
    golden(tx_failed());
    golden(tx_command());
    golden(tx_replaced());
    golden(spot_command());
    golden(spot_reply());
    golden(transfer_requested());
    golden(transfer_updated());
}

async fn wire_round_trip<E: Event>(codec: &RegistryCodec, topic: &str, subjects: Subjects, e: E) {
    let bytes = codec
        .encode(topic, subjects, &e)
        .await
        .unwrap_or_else(|err| panic!("{}: {err:?}", E::FULL_NAME));
    assert_eq!(bytes[0], 0, "Confluent magic byte");
    let id = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
    let registered = codec
        .register::<E>(topic, subjects)
        .await
        .expect("registered");
    assert_eq!(
        id, registered,
        "the wire header carries the registered schema id"
    );
    assert_eq!(
        &bytes[5..],
        encode_datum(&e).expect("datum").as_slice(),
        "payload after the header is the datum"
    );
    let back: E = codec
        .decode(&bytes)
        .await
        .unwrap_or_else(|err| panic!("{}: {err:?}", E::FULL_NAME));
    assert_eq!(back, e);
}

#[tokio::test]
async fn every_schema_round_trips_through_the_registry_in_wire_format() {
    let codec = RegistryCodec::new(registry_url());
    let t = unique("wire");
    let one = Subjects::TopicName;
    wire_round_trip(&codec, &format!("{t}.requests"), one, tx_request()).await;
    wire_round_trip(&codec, &format!("{t}.commands"), one, tx_command()).await;
    wire_round_trip(&codec, &format!("{t}.allocated"), one, tx_allocated()).await;
    wire_round_trip(&codec, &format!("{t}.signed"), one, tx_signed()).await;
    wire_round_trip(&codec, &format!("{t}.submitted"), one, tx_submitted()).await;
    wire_round_trip(&codec, &format!("{t}.receipts"), one, tx_receipt_updated()).await;
    wire_round_trip(
        &codec,
        &format!("{t}.confirmations"),
        one,
        tx_confirmations_updated(),
    )
    .await;
    let many = Subjects::TopicRecordName;
    wire_round_trip(&codec, &format!("{t}.outcomes"), many, tx_accepted()).await;
    wire_round_trip(&codec, &format!("{t}.outcomes"), many, tx_confirmed()).await;
    wire_round_trip(
        &codec,
        &format!("{t}.outcomes"),
        many,
        tx_confirmation_reverted(),
    )
    .await;
    wire_round_trip(&codec, &format!("{t}.outcomes"), many, tx_failed()).await;
    wire_round_trip(&codec, &format!("{t}.spot.commands"), one, spot_command()).await;
    wire_round_trip(&codec, &format!("{t}.spot.events"), one, spot_reply()).await;
    wire_round_trip(
        &codec,
        &format!("{t}.transfer.requests"),
        one,
        transfer_requested(),
    )
    .await;
    wire_round_trip(
        &codec,
        &format!("{t}.transfer.events"),
        one,
        transfer_updated(),
    )
    .await;
}

#[tokio::test]
async fn decoding_as_the_wrong_type_or_from_garbage_is_a_permanent_error() {
    use txflow_core::codec::CodecError;
    use txflow_core::retry::Classify;
    let codec = RegistryCodec::new(registry_url());
    let topic = unique("wrongtype");
    let bytes = codec
        .encode(&topic, Subjects::TopicName, &tx_command())
        .await
        .expect("encode");
    let err = codec
        .decode::<TxRequest>(&bytes)
        .await
        .expect_err("a TxCommand is not a TxRequest");
    assert!(matches!(err, CodecError::WrongType { .. }), "{err:?}");
    assert!(!err.is_transient());
    let err = codec
        .decode::<TxRequest>(b"not avro at all")
        .await
        .expect_err("garbage");
    assert!(
        !err.is_transient(),
        "garbage is dead-lettered, not retried: {err:?}"
    );
}

/// Registers `schema` under `subject` through the registry's REST API; returns (status, body).
async fn post_schema(subject: &str, schema: &str) -> (u16, serde_json::Value) {
    let url = format!("{}/subjects/{subject}/versions", registry_url());
    let resp = reqwest::Client::new()
        .post(&url)
        .header("content-type", "application/vnd.schemaregistry.v1+json")
        .json(&serde_json::json!({ "schema": schema }))
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(serde_json::Value::Null))
}

/// `TxRequest` with one more field.
fn tx_request_with(field: serde_json::Value) -> String {
    let mut v: serde_json::Value = serde_json::from_str(TxRequest::SCHEMA_JSON).expect("json");
    v["fields"].as_array_mut().expect("fields").push(field);
    v.to_string()
}

#[tokio::test]
async fn the_registry_refuses_an_incompatible_change_and_accepts_a_compatible_one() {
    let subject = format!("{}-value", unique("compat"));
    let config_url = format!("{}/config/{subject}", registry_url());
    let put = reqwest::Client::new()
        .put(&config_url)
        .json(&serde_json::json!({ "compatibility": "BACKWARD" }))
        .send()
        .await
        .expect("PUT config");
    assert!(
        put.status().is_success(),
        "set BACKWARD on {subject}: {}",
        put.status()
    );

    let (status, body) = post_schema(&subject, TxRequest::SCHEMA_JSON).await;
    assert_eq!(status, 200, "first version registers: {body}");
    let v1 = body["id"].as_i64().expect("id");

    // A new required field without a default: new readers cannot read old data.
    let incompatible = tx_request_with(serde_json::json!({"name": "priority", "type": "int"}));
    let (status, body) = post_schema(&subject, &incompatible).await;
    assert_eq!(status, 409, "an incompatible change is refused: {body}");

    // A new optional field with a default: compatible.
    let compatible = tx_request_with(
        serde_json::json!({"name": "priority", "type": ["null", "int"], "default": null}),
    );
    let (status, body) = post_schema(&subject, &compatible).await;
    assert_eq!(status, 200, "a compatible change is accepted: {body}");
    assert_ne!(body["id"].as_i64().expect("id"), v1, "a new schema id");
}

#[tokio::test]
async fn an_evolved_schema_is_read_by_old_and_new_readers() {
    // TxSubmitted v2 gains an optional field with a default.
    let mut v2: serde_json::Value = serde_json::from_str(TxSubmitted::SCHEMA_JSON).expect("json");
    v2["fields"]
        .as_array_mut()
        .expect("fields")
        .push(serde_json::json!(
            {"name": "rpc_endpoint", "type": ["null", "string"], "default": null}
        ));
    let v2_json = v2.to_string();
    let v2_schema = Schema::parse_str(&v2_json).expect("v2 parses");

    let codec = RegistryCodec::new(registry_url());
    let topic = unique("evolve");
    // Old writer: registers v1 and writes.
    let old_bytes = codec
        .encode(&topic, Subjects::TopicName, &tx_submitted())
        .await
        .expect("v1 encode");

    // New writer: registers v2 (accepted as compatible) and writes a value with the new field.
    let encoder = schema_registry_converter::async_impl::easy_avro::EasyAvroEncoder::new(
        schema_registry_converter::async_impl::schema_registry::SrSettings::new(
            registry_url().to_string(),
        ),
    );
    let mut strategy = value_strategy::<TxSubmitted>(&topic, Subjects::TopicName);
    if let schema_registry_converter::schema_registry_common::SubjectNameStrategy::TopicNameStrategyWithSchema(_, _, s) =
        &mut strategy
    {
        s.schema = v2_json.clone();
    }
    let mut fields = match apache_avro::to_value(tx_submitted()).expect("value") {
        Value::Record(f) => f,
        other => panic!("not a record: {other:?}"),
    };
    fields.push((
        "rpc_endpoint".into(),
        Value::Union(1, Box::new(Value::String("http://rpc-2".into()))),
    ));
    let value = Value::Record(fields).resolve(&v2_schema).expect("v2 value");
    let new_bytes = encoder
        .encode_value(value, &strategy)
        .await
        .expect("v2 registers and encodes");
    let old_id = u32::from_be_bytes([old_bytes[1], old_bytes[2], old_bytes[3], old_bytes[4]]);
    let new_id = u32::from_be_bytes([new_bytes[1], new_bytes[2], new_bytes[3], new_bytes[4]]);
    assert_ne!(old_id, new_id, "v2 is a new registered version");

    // Old reader (this binary's TxSubmitted) reads both.
    let from_old: TxSubmitted = codec
        .decode(&old_bytes)
        .await
        .expect("old reader, old data");
    let from_new: TxSubmitted = codec
        .decode(&new_bytes)
        .await
        .expect("old reader, new data");
    assert_eq!(from_old, tx_submitted());
    assert_eq!(
        from_new,
        tx_submitted(),
        "the old reader ignores the new field"
    );

    // New reader (v2) reads both: old data gets the default.
    let decoder = schema_registry_converter::async_impl::easy_avro::EasyAvroDecoder::new(
        schema_registry_converter::async_impl::schema_registry::SrSettings::new(
            registry_url().to_string(),
        ),
    );
    let field = |bytes: Vec<u8>| {
        let decoder = decoder.clone();
        let v2_schema = v2_schema.clone();
        async move {
            let v = decoder
                .decode(Some(&bytes))
                .await
                .expect("decode")
                .value
                .resolve(&v2_schema)
                .expect("resolve to v2");
            match v {
                Value::Record(f) => f
                    .into_iter()
                    .find(|(n, _)| n == "rpc_endpoint")
                    .map(|(_, v)| v),
                _ => None,
            }
        }
    };
    assert_eq!(
        field(old_bytes).await,
        Some(Value::Union(0, Box::new(Value::Null))),
        "default for old data"
    );
    assert_eq!(
        field(new_bytes).await,
        Some(Value::Union(
            1,
            Box::new(Value::String("http://rpc-2".into()))
        )),
        "new data keeps the new field"
    );
}

/// TxRequest as it was before `depends_on_request_id` (issue 14 point 5): today's schema without
/// that field.
fn tx_request_before_dependencies() -> String {
    let mut v: serde_json::Value = serde_json::from_str(TxRequest::SCHEMA_JSON).expect("json");
    v["fields"]
        .as_array_mut()
        .expect("fields")
        .retain(|f| f["name"] != "depends_on_request_id");
    v.to_string()
}

#[tokio::test]
async fn tx_request_gained_depends_on_request_id_compatibly() {
    use apache_avro::reader::datum::GenericDatumReader;
    use apache_avro::writer::datum::GenericDatumWriter;

    let before_json = tx_request_before_dependencies();
    let before = Schema::parse_str(&before_json).expect("the old TxRequest parses");
    assert_ne!(before_json, TxRequest::SCHEMA_JSON, "the field was removed");

    // The registry, as it runs (BACKWARD), takes today's TxRequest over the one before it.
    let subject = format!("{}-value", unique("dependson"));
    let put = reqwest::Client::new()
        .put(format!("{}/config/{subject}", registry_url()))
        .json(&serde_json::json!({ "compatibility": "BACKWARD" }))
        .send()
        .await
        .expect("PUT config");
    assert!(put.status().is_success(), "{}", put.status());
    let (status, body) = post_schema(&subject, &before_json).await;
    assert_eq!(status, 200, "the old TxRequest registers: {body}");
    let (status, body) = post_schema(&subject, TxRequest::SCHEMA_JSON).await;
    assert_eq!(
        status, 200,
        "today's TxRequest is a compatible change: {body}"
    );

    // A request from an upstream that predates the field reads as one without a dependency.
    let mut fields = match apache_avro::to_value(tx_request()).expect("value") {
        Value::Record(f) => f,
        other => panic!("not a record: {other:?}"),
    };
    fields.retain(|(name, _)| name != "depends_on_request_id");
    let old = Value::Record(fields)
        .resolve(&before)
        .expect("an old value");
    let old_bytes = GenericDatumWriter::builder(&before)
        .build()
        .and_then(|w| w.write_value_to_vec(old))
        .expect("old datum");
    let read: TxRequest = decode_datum(&before, &old_bytes).expect("today's reader, old data");
    assert_eq!(
        read,
        TxRequest {
            depends_on_request_id: None,
            ..tx_request()
        }
    );

    // A reader that predates the field reads today's requests, without it.
    let new_bytes = encode_datum(&tx_request()).expect("datum");
    let back = GenericDatumReader::builder(TxRequest::schema())
        .reader_schema(&before)
        .build()
        .and_then(|r| r.read_value(&mut std::io::Cursor::new(&new_bytes)))
        .expect("the old reader, new data");
    let Value::Record(fields) = back else {
        panic!("not a record: {back:?}");
    };
    let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
    assert!(!names.contains(&"depends_on_request_id"), "{names:?}");
    assert!(
        fields.contains(&(
            "request_id".to_string(),
            Value::String("invoice-2026-0001".into())
        )),
        "{fields:?}"
    );
}
