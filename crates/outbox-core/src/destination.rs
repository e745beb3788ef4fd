//! `destination.v1`: where an event goes, frozen in its row, and the digest that proves what
//! reached the broker is what was committed. Its own module because both the envelope (an
//! event carries one) and the route policy (which resolves one) need it, and neither should
//! need the other for it.

use sha2::{Digest, Sha256};

/// What every digest of this crate starts with.
pub const DIGEST_PREFIX: &str = "sha256:";

/// `sha256:<hex>` of the given bytes.
pub fn sha256_digest(bytes: &[u8]) -> String {
    digest_text(Sha256::digest(bytes).into())
}

/// `sha256:<hex>` of a finished SHA-256.
fn digest_text(sha: [u8; 32]) -> String {
    // Into a buffer: `hex::encode` builds its String one char at a time, a few percent of
    // the relay's CPU per event (two digests each).
    let mut hex = [0u8; 64];
    hex::encode_to_slice(sha, &mut hex).expect("32 bytes are 64 hex digits");
    let mut out = String::with_capacity(DIGEST_PREFIX.len() + 64);
    out.push_str(DIGEST_PREFIX);
    out.push_str(std::str::from_utf8(&hex).expect("hex digits are ASCII"));
    out
}

/// `destination.v1`: where an event goes, resolved from the route policy at enqueue and
/// frozen in the row. Retries never re-resolve it (invariant 4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// Broker kind, e.g. `kafka`.
    pub kind: String,
    /// Broker cluster identity (a name the operator gives the cluster in the route policy).
    pub cluster: String,
    pub topic: String,
    /// Routing / partition key (the aggregate id by default).
    pub key: String,
    /// Partitioning algorithm, e.g. `murmur2_random` (Java-client compatible).
    pub partitioner: String,
    /// Generation of the route policy the destination was resolved from.
    pub route_generation: i64,
    pub serializer: String,
    /// Required acknowledgements, e.g. `all`.
    pub acks: String,
}

impl Destination {
    /// A Kafka destination as a first route generation freezes one (Java-compatible
    /// partitioner, JSON, `acks=all`): for tests, fixtures and the simulator.
    pub fn kafka(cluster: &str, topic: &str, key: &str) -> Destination {
        Destination {
            kind: "kafka".into(),
            cluster: cluster.into(),
            topic: topic.into(),
            key: key.into(),
            partitioner: "murmur2_random".into(),
            route_generation: 1,
            serializer: "json".into(),
            acks: "all".into(),
        }
    }

    /// The canonical text hashed into the destination digest. Must match
    /// `outbox.destination_canonical(...)` in the migrations byte for byte.
    pub fn canonical(&self) -> String {
        self.canonical_parts(&mut itoa::Buffer::new()).concat()
    }

    /// [`Destination::canonical`] in its parts, in order (`generation` holds the route
    /// generation's text): the one place the layout is written, for the text and the digest.
    fn canonical_parts<'a>(&'a self, generation: &'a mut itoa::Buffer) -> [&'a str; 16] {
        [
            "destination.v1\nkind=",
            &self.kind,
            "\ncluster=",
            &self.cluster,
            "\ntopic=",
            &self.topic,
            "\nkey=",
            &self.key,
            "\npartitioner=",
            &self.partitioner,
            "\nroute_generation=",
            generation.format(self.route_generation),
            "\nserializer=",
            &self.serializer,
            "\nacks=",
            &self.acks,
        ]
    }

    /// `sha256:<hex>` of [`Destination::canonical`], hashed part by part: the relay computes
    /// one per event, and formatting the canonical text first was most of its cost.
    pub fn digest(&self) -> String {
        let mut sha = Sha256::new();
        for part in self.canonical_parts(&mut itoa::Buffer::new()) {
            sha.update(part.as_bytes());
        }
        digest_text(sha.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest hashed part by part is the digest of the canonical text, whatever the
    /// fields hold, and the text is the layout `outbox.destination_canonical` writes (the
    /// ledger and `verify` compare the digest with it).
    #[test]
    fn the_digest_is_the_canonical_texts() {
        for generation in [0, 1, 7, 10, 99, 1_000_000, i64::MAX, -1, -42, i64::MIN] {
            let mut d = Destination::kafka("c1", "outbox.event.order", "order-1");
            d.route_generation = generation;
            assert_eq!(
                d.digest(),
                sha256_digest(d.canonical().as_bytes()),
                "{generation}"
            );
        }
        // The layout itself, written out (what `outbox.destination_canonical` returns).
        let mut d = Destination::kafka("c1", "outbox.event.order", "order-1");
        d.route_generation = -42;
        assert_eq!(
            d.canonical(),
            "destination.v1\nkind=kafka\ncluster=c1\ntopic=outbox.event.order\nkey=order-1\n\
             partitioner=murmur2_random\nroute_generation=-42\nserializer=json\nacks=all"
        );
        let mut odd = Destination::kafka("", "t\nkey=x", "");
        odd.acks = "1".into();
        assert_eq!(odd.digest(), sha256_digest(odd.canonical().as_bytes()));
    }
}
