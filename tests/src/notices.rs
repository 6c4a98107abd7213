//! Capturing PostgreSQL NOTICEs in a test, e.g. `auto_explain`'s plans.

use std::sync::{Arc, Mutex};

/// The NOTICEs sqlx receives (it logs each as a `tracing` event, target
/// `sqlx::postgres::notice`): here, `auto_explain`'s plans.
#[derive(Clone, Default)]
pub struct Notices(Arc<Mutex<Vec<String>>>);

impl Notices {
    /// The notices received since the last call.
    pub fn take(&self) -> Vec<String> {
        self.0
            .lock()
            .map(|mut n| std::mem::take(&mut *n))
            .unwrap_or_default()
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Notices {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(Option<String>);
        impl tracing::field::Visit for Message {
            fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
                if f.name() == "message" {
                    self.0 = Some(v.to_string());
                }
            }
            fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
                if f.name() == "message" && self.0.is_none() {
                    self.0 = Some(format!("{v:?}"));
                }
            }
        }
        if event.metadata().target() == "sqlx::postgres::notice" {
            let mut m = Message(None);
            event.record(&mut m);
            if let (Some(m), Ok(mut all)) = (m.0, self.0.lock()) {
                all.push(m);
            }
        }
    }
}
