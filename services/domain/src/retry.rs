//! Every error says whether to retry (CONVENTIONS 8).

/// What a caller should do with an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// A transient condition (network, timeout, unavailable dependency): try again later, the
    /// state is unchanged.
    Transient,
    /// The input or the request is wrong and will stay wrong: dead-letter it or report it.
    Permanent,
}

/// Implemented by the error types of txflow.
pub trait Classify {
    fn retry(&self) -> Retry;
    fn is_transient(&self) -> bool {
        self.retry() == Retry::Transient
    }
}
