//! Reading `tx.outcomes` (and `tx.confirmations`) into a [`Book`].

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers};
use rdkafka::{Message, Offset, TopicPartitionList};
use txflow_domain::events::{
    TxAccepted, TxConfirmationReverted, TxConfirmationsUpdated, TxConfirmed, TxFailed,
    TxReceiptUpdated, TxSubmitted,
};
use txflow_wire::codec::RegistryCodec;

use crate::book::{Book, Outcome};
use crate::{ClientError, Settings};

/// What an [`OutcomeReader`] reads besides `tx.outcomes`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadOptions {
    /// Also read `tx.confirmations` (the confirming blocks, `new_fork` lists).
    pub confirmations: bool,
}

/// Reads every partition of `tx.outcomes` from its beginning, outside any consumer group, and
/// applies each event to its [`Book`]. It commits nothing: a downstream service that keeps its
/// books durably stores the book and the positions together, in one transaction of its own.
pub struct OutcomeReader {
    consumer: StreamConsumer,
    codec: RegistryCodec,
    outcomes: String,
    confirmations: String,
    book: Book,
    /// Records that are not a txflow outcome (no payload, no `event_id`, another schema).
    pub unreadable: u64,
}

impl OutcomeReader {
    /// A reader with an empty book.
    pub async fn open(
        settings: &Settings,
        options: ReadOptions,
    ) -> Result<OutcomeReader, ClientError> {
        OutcomeReader::resume(settings, options, Book::new()).await
    }

    /// A reader that goes on with `book` (from [`OutcomeReader::into_book`]): it reads the
    /// topics from their beginning again, and the book skips what it has already applied.
    pub async fn resume(
        settings: &Settings,
        options: ReadOptions,
        book: Book,
    ) -> Result<OutcomeReader, ClientError> {
        let topics = settings.topics();
        let outcomes = topics.tx_outcomes();
        let confirmations = topics.tx_confirmations();
        let mut wanted = vec![outcomes.clone()];
        if options.confirmations {
            wanted.push(confirmations.clone());
        }
        let config = settings.kafka().assign_config();
        let kafka = |context: String| move |source| ClientError::Kafka { context, source };
        let partitions = {
            let config = config.clone();
            let wanted = wanted.clone();
            tokio::task::spawn_blocking(move || -> Result<Vec<(String, i32)>, ClientError> {
                let probe: BaseConsumer = config
                    .create()
                    .map_err(kafka("creating a metadata client".into()))?;
                let mut all = Vec::new();
                for t in &wanted {
                    let md = probe
                        .fetch_metadata(Some(t), Duration::from_secs(10))
                        .map_err(kafka(format!("reading the metadata of {t}")))?;
                    for topic in md.topics() {
                        for p in topic.partitions() {
                            all.push((t.clone(), p.id()));
                        }
                    }
                }
                Ok(all)
            })
            .await
            .map_err(|e| ClientError::Kafka {
                context: format!("reading topic metadata: {e}"),
                source: rdkafka::error::KafkaError::Canceled,
            })??
        };
        if partitions.is_empty() {
            return Err(ClientError::Kafka {
                context: format!("{} has no partition yet", outcomes),
                source: rdkafka::error::KafkaError::MetadataFetch(
                    rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition,
                ),
            });
        }
        let consumer: StreamConsumer = config
            .create()
            .map_err(kafka("creating the consumer".into()))?;
        let mut list = TopicPartitionList::new();
        for (t, p) in &partitions {
            list.add_partition_offset(t, *p, Offset::Beginning)
                .map_err(kafka(format!("assigning {t}/{p}")))?;
        }
        consumer
            .assign(&list)
            .map_err(kafka("assigning the partitions".into()))?;
        Ok(OutcomeReader {
            consumer,
            codec: RegistryCodec::new(&settings.schema_registry_url),
            outcomes,
            confirmations,
            book,
            unreadable: 0,
        })
    }

    /// Reads what arrives until `quiet` passes with nothing new; returns how many new events
    /// were applied (duplicates are not counted).
    pub async fn poll(&mut self, quiet: Duration) -> Result<usize, ClientError> {
        let mut applied = 0;
        while let Some(new) = self.next(quiet).await? {
            applied += usize::from(new);
        }
        Ok(applied)
    }

    /// Reads and applies one record: `None` when nothing came within `wait`, else whether it
    /// was a new event.
    async fn next(&mut self, wait: Duration) -> Result<Option<bool>, ClientError> {
        let m = match tokio::time::timeout(wait, self.consumer.recv()).await {
            Err(_) => return Ok(None),
            Ok(Err(source)) => {
                return Err(ClientError::Kafka {
                    context: "reading tx.outcomes".into(),
                    source,
                });
            }
            Ok(Ok(m)) => m,
        };
        match self.decode(&m).await? {
            Some((event_id, event)) => Ok(Some(self.book.apply(&event_id, event))),
            None => {
                self.unreadable += 1;
                Ok(Some(false))
            }
        }
    }

    /// Reads until it has read past each `(topic, partition, offset)` of `marks`, or `within`
    /// passes: `Ok(true)` once past all, `Ok(false)` when the deadline came first. With the
    /// offsets of records the caller produced itself as a barrier (one per partition, after
    /// something it wants to reconcile), the book then holds everything the broker had
    /// acknowledged on those partitions before them. (A broker's high watermarks would do
    /// without a barrier; the test broker, tansu, does not report them.)
    pub async fn read_through(
        &mut self,
        marks: &[(String, i32, i64)],
        within: Duration,
    ) -> Result<bool, ClientError> {
        let until = tokio::time::Instant::now() + within;
        loop {
            let position = self
                .consumer
                .position()
                .map_err(|source| ClientError::Kafka {
                    context: "reading the position".into(),
                    source,
                })?;
            let behind = marks.iter().any(|(t, p, mark)| {
                !matches!(
                    position.find_partition(t, *p).map(|e| e.offset()),
                    Some(Offset::Offset(at)) if at > *mark
                )
            });
            if !behind {
                return Ok(true);
            }
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            self.next(left.min(Duration::from_millis(100))).await?;
        }
    }

    async fn decode(
        &self,
        m: &BorrowedMessage<'_>,
    ) -> Result<Option<(String, Outcome)>, ClientError> {
        let event_id = m.headers().and_then(|h| {
            h.iter()
                .find(|x| x.key == "event_id")
                .and_then(|x| x.value)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        });
        let (Some(event_id), Some(bytes)) = (event_id, m.payload()) else {
            return Ok(None);
        };
        let event = if m.topic() == self.confirmations {
            decode_one::<TxConfirmationsUpdated>(&self.codec, bytes)
                .await?
                .map(Outcome::Confirmations)
        } else if m.topic() == self.outcomes {
            decode_outcome(&self.codec, bytes).await?
        } else {
            None
        };
        Ok(event.map(|e| (event_id, e)))
    }

    pub fn book(&self) -> &Book {
        &self.book
    }

    /// The book, to [`OutcomeReader::resume`] with after the reader is closed (a broker that
    /// lost its topics, a restart of the reading service).
    pub fn into_book(self) -> Book {
        self.book
    }
}

/// `Some` when `bytes` is an `E`; `None` when it is another record type or undecodable; an
/// error only when the registry cannot be asked (retry).
async fn decode_one<E: txflow_domain::events::Event>(
    codec: &RegistryCodec,
    bytes: &[u8],
) -> Result<Option<E>, ClientError> {
    use txflow_domain::retry::{Classify, Retry};
    match codec.decode::<E>(bytes).await {
        Ok(e) => Ok(Some(e)),
        Err(e) if e.retry() == Retry::Transient => Err(e.into()),
        Err(_) => Ok(None),
    }
}

/// The record types of `tx.outcomes`, most frequent first.
async fn decode_outcome(
    codec: &RegistryCodec,
    bytes: &[u8],
) -> Result<Option<Outcome>, ClientError> {
    if let Some(e) = decode_one::<TxSubmitted>(codec, bytes).await? {
        return Ok(Some(Outcome::Submitted(e)));
    }
    if let Some(e) = decode_one::<TxReceiptUpdated>(codec, bytes).await? {
        return Ok(Some(Outcome::Receipt(e)));
    }
    if let Some(e) = decode_one::<TxConfirmed>(codec, bytes).await? {
        return Ok(Some(Outcome::Confirmed(e)));
    }
    if let Some(e) = decode_one::<TxAccepted>(codec, bytes).await? {
        return Ok(Some(Outcome::Accepted(e)));
    }
    if let Some(e) = decode_one::<TxFailed>(codec, bytes).await? {
        return Ok(Some(Outcome::Failed(e)));
    }
    if let Some(e) = decode_one::<TxConfirmationReverted>(codec, bytes).await? {
        return Ok(Some(Outcome::ConfirmationReverted(e)));
    }
    Ok(None)
}
