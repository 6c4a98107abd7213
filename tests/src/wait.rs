use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `check` until it returns `Some`, and returns that value; panics with `what` and the
/// elapsed time if `timeout` passes first. The only way tests wait: never a bare sleep.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if started.elapsed() >= timeout {
            panic!(
                "timed out after {:?} waiting until {what}",
                started.elapsed()
            );
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Polls `check` until it returns true; panics with `what` if `timeout` passes first.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(what, timeout, || {
        let f = check();
        async move { f.await.then_some(()) }
    })
    .await
}
