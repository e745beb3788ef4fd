//! Kafka client properties can hold secrets (`sasl.password`, `ssl.key.password`,
//! `ssl.key.pem`, OAuth client secrets). They reach librdkafka and nothing else: the sink
//! configuration's `Debug` prints their keys with the value hidden, so a config dumped in a
//! log line or an error never carries them.

use std::fmt;

use crate::KafkaSinkConfig;

/// Whether the value of librdkafka property `key` is a secret.
pub fn is_secret_property(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k.contains("password")
        || k.contains("secret")
        || k == "ssl.key.pem"
        || k == "ssl_key"
        || k == "sasl.oauthbearer.config"
        || k == "sasl.jaas.config"
}

/// `(key, value)` pairs as they may be printed.
pub fn printable_properties(props: &[(String, String)]) -> Vec<(String, String)> {
    props
        .iter()
        .map(|(k, v)| {
            let v = if is_secret_property(k) {
                "***".to_string()
            } else {
                v.clone()
            };
            (k.clone(), v)
        })
        .collect()
}

impl fmt::Debug for KafkaSinkConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSinkConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("cluster_name", &self.cluster_name)
            .field("partitioner", &self.partitioner)
            .field("message_timeout", &self.message_timeout)
            .field("linger", &self.linger)
            .field("express_max_in_flight", &self.express_max_in_flight)
            .field("properties", &printable_properties(&self.properties))
            .field("headers", &self.headers)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_values_never_print() {
        let cfg = KafkaSinkConfig {
            properties: vec![
                ("security.protocol".into(), "SASL_SSL".into()),
                ("sasl.mechanism".into(), "SCRAM-SHA-512".into()),
                ("sasl.username".into(), "relay".into()),
                ("sasl.password".into(), "hunter2".into()),
                ("ssl.key.password".into(), "hunter3".into()),
            ],
            ..KafkaSinkConfig::default()
        };
        let s = format!("{cfg:?}");
        assert!(!s.contains("hunter2") && !s.contains("hunter3"), "{s}");
        assert!(s.contains("SCRAM-SHA-512") && s.contains("relay"), "{s}");
    }

    /// librdkafka is built with TLS and SASL/SCRAM (the `ssl` feature): a SASL_SSL SCRAM
    /// producer can be configured. Without the feature librdkafka refuses
    /// `security.protocol=SASL_SSL` at creation.
    #[test]
    fn sasl_ssl_scram_is_supported() {
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let cfg = KafkaSinkConfig {
            bootstrap_servers: "127.0.0.1:1".into(),
            properties: vec![
                ("security.protocol".into(), "SASL_SSL".into()),
                ("sasl.mechanism".into(), "SCRAM-SHA-512".into()),
                ("sasl.username".into(), "relay".into()),
                ("sasl.password".into(), "pw".into()),
            ],
            ..KafkaSinkConfig::default()
        };
        if let Err(e) = crate::KafkaSink::new(cfg, tx) {
            panic!("SASL_SSL/SCRAM producer refused: {e}");
        }
    }
}
