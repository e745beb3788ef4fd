-- outboxd migration 0020: routes to HTTP endpoints (webhooks).
--
-- destination.v1 is unchanged (no new envelope generation): for an HTTP endpoint, kind =
-- 'http', cluster = the endpoint's name (the relay serves one endpoint and refuses events
-- frozen for another), topic = the URL (its template may name '{aggregate_type}' and
-- '{aggregate_id}', replaced at enqueue like a topic's), partitioner = 'none' (an endpoint has
-- no partitions; order is per aggregate, one request in flight each).
--
-- A receipt of an HTTP endpoint has no broker position: partition 0, offset 0. What proves it
-- is the endpoint's 2xx answer to a request carrying the event id as its idempotency key, kept
-- in the receipt's `evidence`: {"status": 201, "response_id": "...", "body_sha256": "..."}.
-- Brokers' receipts leave it NULL (their position is the proof).

ALTER TABLE outbox.receipts ADD COLUMN evidence jsonb;
ALTER TABLE outbox.duplicate_receipts ADD COLUMN evidence jsonb;

CREATE FUNCTION outbox.set_http_route(
    p_aggregate_type text, p_event_type text, p_endpoint text, p_url text
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    g bigint;
BEGIN
    IF coalesce(p_endpoint, '') = '' THEN
        RAISE EXCEPTION 'outbox.set_http_route: endpoint must name the HTTP endpoint the relay serves ([http] endpoint)' USING ERRCODE = '22023';
    END IF;
    IF p_url IS NULL OR p_url !~ '^https?://[^/]+' THEN
        RAISE EXCEPTION 'outbox.set_http_route: url must be an http:// or https:// URL, got %', coalesce(p_url, 'NULL') USING ERRCODE = '22023';
    END IF;
    UPDATE outbox.route_policy SET active = false
    WHERE active
      AND aggregate_type IS NOT DISTINCT FROM p_aggregate_type
      AND event_type IS NOT DISTINCT FROM p_event_type;
    INSERT INTO outbox.route_policy (aggregate_type, event_type, topic, broker_cluster, broker_kind,
                                     partitioner)
    VALUES (p_aggregate_type, p_event_type, p_url, p_endpoint, 'http', 'none')
    RETURNING generation INTO g;
    RETURN g;
END
$$;
