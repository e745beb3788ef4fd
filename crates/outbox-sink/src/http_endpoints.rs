//! One relay, several webhook endpoints.
//!
//! A team with several partners routes each partner's events to an endpoint of its own
//! (`outbox.set_http_route(aggregate_type, event_type, '<endpoint>', '<url>')`), and each
//! endpoint has its own secrets, concurrency, deadline and headers. [`HttpEndpoints`] holds one
//! [`HttpSink`] per endpoint and hands each event to the one its frozen destination names
//! (`dest_cluster`, the endpoint's name). The endpoints share nothing but the delivery-report
//! channel: each has its own permits (a slow endpoint fills only its own), its own `410 Gone`
//! switch, its own keys. An endpoint that fails holds only its own aggregates (the relay's
//! unclear-answer rule holds an aggregate, never the run), so the others keep flowing.
//!
//! What the relay serves is the set of names ([`Served::clusters`]): an event frozen for an
//! endpoint this relay does not serve is refused by the route stage before any send, as for a
//! broker cluster.

use std::time::Duration;

use outbox_core::OutboxEvent;
use tokio::sync::mpsc::UnboundedSender;

use crate::{Delivery, HttpSink, HttpSinkConfig, Lookup, Served, Sink, SinkError, UnknownLookup};

/// The relay's HTTP sink: one [`HttpSink`] per endpoint, chosen by each event's frozen
/// `dest_cluster`.
#[derive(Debug, Clone)]
pub struct HttpEndpoints {
    /// Sorted by name; names are unique.
    sinks: Vec<HttpSink>,
}

impl HttpEndpoints {
    /// One client per endpoint; every delivery report goes to `reports`. Refuses an empty list
    /// and a name given twice.
    pub fn new(
        configs: Vec<HttpSinkConfig>,
        reports: UnboundedSender<Delivery>,
    ) -> Result<HttpEndpoints, SinkError> {
        let mut sinks = configs
            .into_iter()
            .map(|c| HttpSink::new(c, reports.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        sinks.sort_by(|a, b| a.config().endpoint.cmp(&b.config().endpoint));
        let fail = |endpoint: &str, message: &str| SinkError::Http {
            endpoint: endpoint.to_string(),
            what: "configuring the relay's endpoints".into(),
            message: message.into(),
        };
        if sinks.is_empty() {
            return Err(fail("(none)", "no endpoint is configured"));
        }
        if let Some(w) = sinks
            .windows(2)
            .find(|w| w[0].config().endpoint == w[1].config().endpoint)
        {
            return Err(fail(
                &w[0].config().endpoint,
                "the name is given to two endpoints; each endpoint needs its own name",
            ));
        }
        Ok(HttpEndpoints { sinks })
    }

    /// The endpoints, sorted by name.
    pub fn endpoints(&self) -> &[HttpSink] {
        &self.sinks
    }

    /// The endpoint named `name`.
    pub fn endpoint(&self, name: &str) -> Option<&HttpSink> {
        self.sinks
            .binary_search_by(|s| s.config().endpoint.as_str().cmp(name))
            .ok()
            .map(|i| &self.sinks[i])
    }

    /// The endpoint `ev` is frozen for. The route stage refuses other events before a send, so
    /// an error here is a relay bug; it is reported as a permanent refusal naming the event.
    fn for_event(&self, ev: &OutboxEvent) -> Result<&HttpSink, SinkError> {
        self.endpoint(&ev.destination.cluster)
            .ok_or_else(|| SinkError::Http {
                endpoint: ev.destination.cluster.clone(),
                what: format!("sending event {}", ev.event_id),
                message: format!(
                    "this relay serves no endpoint of that name (it serves {}); the route stage should have refused the event",
                    self.names().join(", ")
                ),
            })
    }

    fn names(&self) -> Vec<String> {
        self.sinks
            .iter()
            .map(|s| s.config().endpoint.clone())
            .collect()
    }
}

impl Sink for HttpEndpoints {
    fn served(&self) -> Served {
        Served {
            kind: "http",
            clusters: self.names(),
            partitioner: None,
        }
    }

    async fn send(&self, ev: &OutboxEvent, token: u64) -> Result<(), SinkError> {
        self.for_event(ev)?.send(ev, token).await
    }

    /// The longest of the endpoints' deadlines: the pipeline's one bound on a send must not cut
    /// short an endpoint that is allowed to keep asking longer.
    fn ack_timeout(&self) -> Duration {
        self.sinks
            .iter()
            .map(|s| s.ack_timeout())
            .max()
            .unwrap_or_default()
    }

    async fn lookup(&self, q: UnknownLookup<'_>) -> Result<Lookup, SinkError> {
        self.for_event(q.event)?.lookup(q).await
    }

    fn lookup_resends(&self, _sent_ago: Duration) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(name: &str, deadline_s: u64) -> HttpSinkConfig {
        HttpSinkConfig {
            endpoint: name.into(),
            deadline: Duration::from_secs(deadline_s),
            ..HttpSinkConfig::default()
        }
    }

    #[tokio::test]
    async fn endpoints_are_found_by_name_and_serve_every_name() {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let e = HttpEndpoints::new(vec![config("b", 30), config("a", 90)], tx).unwrap();
        assert_eq!(e.served().clusters, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(e.endpoint("b").unwrap().config().endpoint, "b");
        assert!(e.endpoint("c").is_none());
        assert_eq!(e.ack_timeout(), Duration::from_secs(90));
    }

    #[tokio::test]
    async fn a_name_given_twice_or_no_endpoint_is_refused() {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let err = HttpEndpoints::new(vec![config("a", 30), config("a", 30)], tx.clone())
            .unwrap_err()
            .to_string();
        assert!(err.contains("two endpoints"), "{err}");
        let err = HttpEndpoints::new(vec![], tx).unwrap_err().to_string();
        assert!(err.contains("no endpoint"), "{err}");
    }
}
