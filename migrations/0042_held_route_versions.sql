-- outboxd migration 0042: a held row written without a version keeps the route the relay
-- gave it.
--
-- Why (issue 27, docs/versions_by_relay.md): a row inserted plainly has its version and, when
-- it names no route and stores no destination, its route from the relay, which numbers and
-- routes it in the stream's commit order. When its aggregate is held, the relay records the
-- row in outbox.held_events with the version it gave it (aggregate_version); the release
-- republishes it from SQL, where the row has neither. Before this column the release could
-- not route such a row. Now the held record keeps the route version too (NULL for a row that
-- names its own route or stores its destination, and for every row written with a version).

ALTER TABLE outbox.held_events ADD COLUMN relay_route_version bigint;

COMMENT ON COLUMN outbox.held_events.relay_route_version IS
    'for a row written without a version or route: the route version the relay routed it by (the policy in force at its commit)';

-- The same for the row that blocks a held aggregate, which a release may publish
-- (`publish_blocking`): the hold keeps its route version beside its version.
ALTER TABLE outbox.holds ADD COLUMN blocking_route_version bigint;

COMMENT ON COLUMN outbox.holds.blocking_route_version IS
    'for a blocking row written without a version or route: the route version the relay routed it by';
