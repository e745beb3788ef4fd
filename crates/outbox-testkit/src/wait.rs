//! Wait for a state with a deadline instead of sleeping and hoping.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `check` every `every` until it returns `Some`, or panics with `what` and the last
/// observation after `timeout`. For tests only: a timeout is a failed assertion.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let start = Instant::now();
    loop {
        let last = match check().await {
            Ok(v) => return v,
            Err(observed) => observed,
        };
        if start.elapsed() > timeout {
            panic!("timed out after {timeout:?} waiting for {what}; last observation: {last}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
