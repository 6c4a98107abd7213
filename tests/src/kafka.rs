use std::time::{Duration, Instant};

use rdkafka::Message;
use rdkafka::consumer::StreamConsumer;
use rdkafka::message::OwnedMessage;
use rdkafka::producer::FutureProducer;
use txflow_core::kafka::{KafkaSettings, delete_topics, ensure_topics};

use crate::unique;

/// Topics of the test's own on a broker, created through the admin API and deleted on drop.
pub struct TestTopics {
    pub names: Vec<String>,
    settings: KafkaSettings,
}

impl TestTopics {
    /// `count` topics named `{prefix}-{random}-{i}` with `partitions` partitions each.
    pub async fn create(
        settings: &KafkaSettings,
        prefix: &str,
        count: usize,
        partitions: i32,
    ) -> TestTopics {
        let base = unique(prefix);
        let names: Vec<String> = (0..count).map(|i| format!("{base}-{i}")).collect();
        ensure_topics(settings, &names, partitions)
            .await
            .unwrap_or_else(|e| panic!("create topics {names:?} on {}: {e:?}", settings.brokers));
        TestTopics {
            names,
            settings: settings.clone(),
        }
    }

    /// Topics created by someone else (a process under test), deleted on drop.
    pub fn delete_on_drop(settings: &KafkaSettings, names: Vec<String>) -> TestTopics {
        TestTopics {
            names,
            settings: settings.clone(),
        }
    }

    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }
}

impl Drop for TestTopics {
    fn drop(&mut self) {
        let names = std::mem::take(&mut self.names);
        let settings = self.settings.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(10), delete_topics(&settings, &names))
                    .await
                    .ok()
            })
        })
        .join();
    }
}

/// An idempotent producer with the pipeline's settings.
pub fn producer(settings: &KafkaSettings) -> FutureProducer {
    settings
        .producer_config()
        .create()
        .expect("create a producer")
}

/// A group consumer with the pipeline's settings (no automatic offset store or commit).
pub fn group_consumer(settings: &KafkaSettings, group: &str) -> StreamConsumer {
    settings
        .consumer_config(group)
        .create()
        .expect("create a consumer")
}

/// Receives until `n` messages have arrived, or panics after `timeout` saying how many did.
pub async fn collect(consumer: &StreamConsumer, n: usize, timeout: Duration) -> Vec<OwnedMessage> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, consumer.recv()).await {
            Ok(Ok(m)) => out.push(m.detach()),
            Ok(Err(e)) => panic!("consumer error after {} of {n} messages: {e}", out.len()),
            Err(_) => panic!("received {} of {n} messages within {timeout:?}", out.len()),
        }
    }
    out
}

/// The payload of a message as UTF-8 (test messages are text).
pub fn text(m: &OwnedMessage) -> String {
    String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned()
}
