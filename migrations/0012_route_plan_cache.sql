-- outboxd migration 0012: the route lookup keeps its plan.
--
-- outbox.resolve_route was a SQL-language function returning a table. PostgreSQL does not
-- inline such a function, and does not cache the plan of a SQL function's body across calls:
-- every outbox.enqueue planned the route query again (UNION ALL, sort, limit). Measured with
-- pgbench (4 clients, one event per transaction), the lookup alone ran at 16,000 calls/s as
-- SQL and 65,000 calls/s as PL/pgSQL, whose statements are prepared once per session;
-- outbox.enqueue went from about 17,000 to about 19,000 transactions/s. Same signature, same
-- answer (docs/benchmarks.md, "Producer").

CREATE OR REPLACE FUNCTION outbox.resolve_route(p_aggregate_type text, p_event_type text)
RETURNS TABLE (kind text, cluster text, topic text, partitioner text,
               generation bigint, serializer text, acks text)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT c.kind, c.cluster, replace(c.topic, '{aggregate_type}', p_aggregate_type),
           c.partitioner, c.generation, c.serializer, c.acks
    FROM (
        SELECT rp.broker_kind AS kind, rp.broker_cluster AS cluster, rp.topic, rp.partitioner,
               rp.generation, rp.serializer, rp.required_acks AS acks,
               0 AS fallback,
               (rp.aggregate_type IS NOT NULL)::int AS s1, (rp.event_type IS NOT NULL)::int AS s2,
               rp.priority
        FROM outbox.route_policy rp
        WHERE rp.active
          AND (rp.aggregate_type IS NULL OR rp.aggregate_type = p_aggregate_type)
          AND (rp.event_type IS NULL OR rp.event_type = p_event_type)
        UNION ALL
        SELECT 'kafka', 'default', 'outbox.event.{aggregate_type}', 'murmur2_random',
               0::bigint, 'json', 'all', 1, 0, 0, 0
    ) c
    ORDER BY c.fallback, c.s1 DESC, c.s2 DESC, c.priority DESC, c.generation DESC
    LIMIT 1;
END
$$;
