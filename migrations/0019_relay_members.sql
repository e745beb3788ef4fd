-- outboxd migration 0019: the members of a relay fleet (`outboxd run --fleet`).
--
-- A fleet shares the shards of a sharded outbox (migration-free publications, see
-- `outboxd migrate --shards`) through the shards' leases. Each member writes its row every
-- half second; a member is live while its row is younger than its lease TTL. A member holds
-- at most its fair share of the shards (the shard count over the live members, rounded up):
-- it takes free shards (a lease expired, released, or held by a relay that is not a live
-- member) while under its share, and hands shards back (a graceful stop: drained, confirmed,
-- lease released) while over it. Nothing here decides who sends: the leases do.
CREATE TABLE outbox.relay_members (
    relay_id   text PRIMARY KEY,
    seen_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    joined_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
