-- outboxd migration 0022: a row's values are data, never destination syntax.
--
-- A route's topic is a template: '{aggregate_type}' and '{aggregate_id}' are replaced at
-- enqueue, before the destination is frozen and hashed. They were pasted in as they are, so an
-- aggregate id chosen by a customer could change where the relay sends the event: on an HTTP
-- route '../../admin/delete' made the request go to /admin/delete (with the endpoint's
-- credentials), '%2e%2e/%2e%2e/metrics' to /metrics, 'x?token=steal#frag' added a query; on
-- a NATS route a '.' added subject tokens and '*' or '>' made wildcards; on Kafka an aggregate
-- type that cannot name a topic was accepted and failed only at the broker. Now each value is
-- encoded for the place it lands in, and what cannot be encoded is refused by outbox.enqueue,
-- in the producer's own transaction, with an error naming the value and the rule:
--
--   kind   a substituted value                                        the rendered destination
--   http   percent-encoded as one path segment: RFC 3986 unreserved    placeholders only after
--          characters (A-Z a-z 0-9 - . _ ~) kept, every other byte of   the authority (never in
--          its UTF-8 (including / ? # % and spaces) as %XX; '', '.'    the scheme, host, port
--          and '..' refused (a dot segment would climb the path)        or user info)
--   nats   one subject token: '', '.', '*', '>', white space and       no empty token, no '*'
--          control characters refused                                  or '>' token
--   kafka  Kafka's topic characters only: A-Z a-z 0-9 . _ -            1 to 249 characters,
--                                                                      not '.' or '..'
--
-- outbox.set_route, set_nats_route and set_http_route refuse a template that no value could
-- make legal: a placeholder in a URL's scheme, host, port or user info; a Kafka topic with
-- other characters or too long; a NATS subject with an empty or wildcard token. outbox.enqueue
-- checks the same of routes set before this migration. Both placeholders are replaced in one
-- pass, so a value that itself reads '{aggregate_id}' stays text.
--
-- Rows captured from a Debezium-style or a poller's table go through outbox.enqueue, so the
-- producer's INSERT is refused the same way. Destinations frozen before this migration are
-- not changed: outbox.destinations_breaking_rules (`outboxd check`) names the unpublished ones
-- these rules would encode differently or refuse.

-- One value made safe for a destination of `p_kind`, or refused. `p_name` names it in the
-- error ('aggregate_type', 'aggregate_id'), `p_template` is the route's template.
CREATE FUNCTION outbox.destination_value(p_kind text, p_name text, p_value text, p_template text)
RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    b   bytea;
    o   text := '';
    c   int;
    i   int;
BEGIN
    IF p_kind = 'http' THEN
        IF p_value IS NULL OR p_value IN ('', '.', '..') THEN
            RAISE EXCEPTION 'outbox.enqueue: % % cannot be placed in the URL of route template %: a value in a URL must not be empty, "." or ".." (a dot segment would climb the path)',
                p_name, quote_nullable(p_value), quote_literal(p_template)
                USING ERRCODE = '22023';
        END IF;
        IF p_value ~ '^[A-Za-z0-9._~-]+$' THEN
            RETURN p_value;
        END IF;
        b := convert_to(p_value, 'UTF8');
        FOR i IN 0 .. length(b) - 1 LOOP
            c := get_byte(b, i);
            IF (c BETWEEN 48 AND 57) OR (c BETWEEN 65 AND 90) OR (c BETWEEN 97 AND 122)
               OR c IN (45, 46, 95, 126) THEN
                o := o || chr(c);
            ELSE
                o := o || '%' || upper(lpad(to_hex(c), 2, '0'));
            END IF;
        END LOOP;
        RETURN o;
    ELSIF p_kind = 'nats' THEN
        IF p_value IS NULL OR p_value = '' OR p_value ~ '[.*>[:space:][:cntrl:]]' THEN
            RAISE EXCEPTION 'outbox.enqueue: % % cannot be a token of the NATS subject of route template %: a subject token must be non-empty and contain no ".", "*", ">", white space or control character (it would add tokens or wildcards)',
                p_name, quote_nullable(p_value), quote_literal(p_template)
                USING ERRCODE = '22023';
        END IF;
        RETURN p_value;
    ELSIF p_kind = 'kafka' THEN
        IF p_value IS NULL OR p_value !~ '^[A-Za-z0-9._-]+$' THEN
            RAISE EXCEPTION 'outbox.enqueue: % % cannot be part of the Kafka topic of route template %: a Kafka topic name may contain only ASCII letters, digits, ".", "_" and "-"',
                p_name, quote_nullable(p_value), quote_literal(p_template)
                USING ERRCODE = '22023';
        END IF;
        RETURN p_value;
    END IF;
    RETURN coalesce(p_value, '');
END
$$;

-- Why a route template is not usable for `p_kind`, or NULL when it is. The values of the
-- placeholders are checked at enqueue; this is the template's own part.
CREATE FUNCTION outbox.route_template_problem(p_kind text, p_template text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_sample    text;
    v_authority text;
BEGIN
    IF p_template IS NULL OR p_template = '' THEN
        RETURN 'the template is empty';
    END IF;
    v_sample := replace(replace(p_template, '{aggregate_type}', 'x'), '{aggregate_id}', 'x');
    IF p_kind = 'http' THEN
        v_authority := substring(p_template FROM '^[A-Za-z][A-Za-z0-9+.-]*:(?://[^/?#]*)?');
        IF v_authority IS NULL THEN
            RETURN 'it is not an absolute http:// or https:// URL';
        END IF;
        IF strpos(v_authority, '{aggregate_type}') > 0 OR strpos(v_authority, '{aggregate_id}') > 0 THEN
            RETURN format('a placeholder in the scheme, host, port or user info (%s) would let a value choose where the request goes; put {aggregate_type} and {aggregate_id} in the path, query or fragment only', v_authority);
        END IF;
    ELSIF p_kind = 'nats' THEN
        IF v_sample ~ '[[:space:][:cntrl:]]' THEN
            RETURN 'a NATS subject must contain no white space or control character';
        END IF;
        IF v_sample ~ '(^|\.)[*>]?(\.|$)' THEN
            RETURN 'a NATS subject to publish to must have no empty token and no "*" or ">" wildcard token';
        END IF;
    ELSIF p_kind = 'kafka' THEN
        IF v_sample !~ '^[A-Za-z0-9._-]+$' THEN
            RETURN 'a Kafka topic name may contain only ASCII letters, digits, ".", "_" and "-" (and the placeholders {aggregate_type}, {aggregate_id})';
        END IF;
        IF length(v_sample) > 249 THEN
            RETURN 'a Kafka topic name has at most 249 characters';
        END IF;
        IF v_sample IN ('.', '..') THEN
            RETURN 'a Kafka topic name cannot be "." or ".."';
        END IF;
    END IF;
    RETURN NULL;
END
$$;

-- The destination a route template gives an event: each placeholder replaced by its value,
-- encoded for `p_kind` (or refused), in one pass; then the whole checked.
CREATE FUNCTION outbox.render_destination(
    p_kind text, p_template text, p_aggregate_type text, p_aggregate_id text
) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_rest    text := p_template;
    v_out     text := '';
    v_problem text;
    v_at_type int;
    v_at_id   int;
BEGIN
    IF p_kind = 'http' OR (p_kind = 'nats' AND strpos(p_template, '{') > 0) THEN
        v_problem := outbox.route_template_problem(p_kind, p_template);
        IF v_problem IS NOT NULL THEN
            RAISE EXCEPTION 'outbox.enqueue: the route template % (%) cannot be used: %', quote_literal(p_template), p_kind, v_problem
                USING ERRCODE = '22023', HINT = 'set the route again with a template that passes (outbox.set_route, set_nats_route, set_http_route check it)';
        END IF;
    END IF;
    LOOP
        v_at_type := strpos(v_rest, '{aggregate_type}');
        v_at_id := strpos(v_rest, '{aggregate_id}');
        EXIT WHEN v_at_type = 0 AND v_at_id = 0;
        IF v_at_type > 0 AND (v_at_id = 0 OR v_at_type < v_at_id) THEN
            v_out := v_out || left(v_rest, v_at_type - 1)
                     || outbox.destination_value(p_kind, 'aggregate_type', p_aggregate_type, p_template);
            v_rest := substr(v_rest, v_at_type + 16);
        ELSE
            v_out := v_out || left(v_rest, v_at_id - 1)
                     || outbox.destination_value(p_kind, 'aggregate_id', p_aggregate_id, p_template);
            v_rest := substr(v_rest, v_at_id + 14);
        END IF;
    END LOOP;
    v_out := v_out || v_rest;
    IF p_kind = 'kafka' THEN
        IF v_out !~ '^[A-Za-z0-9._-]+$' OR length(v_out) > 249 OR v_out IN ('.', '..') THEN
            RAISE EXCEPTION 'outbox.enqueue: the Kafka topic % (route template %, aggregate type %) is not a legal topic name: 1 to 249 of the characters A-Z a-z 0-9 . _ -, not "." or ".."',
                quote_literal(v_out), quote_literal(p_template), quote_literal(p_aggregate_type)
                USING ERRCODE = '22023';
        END IF;
    ELSIF p_kind = 'nats' AND v_out ~ '((^|\.)[*>]?(\.|$))|[[:space:][:cntrl:]]' THEN
        RAISE EXCEPTION 'outbox.enqueue: the NATS subject % (route template %) has an empty or wildcard token, or white space',
            quote_literal(v_out), quote_literal(p_template)
            USING ERRCODE = '22023';
    END IF;
    RETURN v_out;
END
$$;

-- The route an event of this type goes to now, with its template as written (outbox.enqueue
-- renders it); resolve_route is this with '{aggregate_type}' replaced as text.
CREATE FUNCTION outbox.route_template(p_aggregate_type text, p_event_type text)
RETURNS TABLE (kind text, cluster text, topic text, partitioner text,
               generation bigint, serializer text, acks text)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT c.kind, c.cluster, c.topic, c.partitioner, c.generation, c.serializer, c.acks
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

CREATE OR REPLACE FUNCTION outbox.resolve_route(p_aggregate_type text, p_event_type text)
RETURNS TABLE (kind text, cluster text, topic text, partitioner text,
               generation bigint, serializer text, acks text)
LANGUAGE plpgsql STABLE AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT t.kind, t.cluster, replace(t.topic, '{aggregate_type}', p_aggregate_type),
           t.partitioner, t.generation, t.serializer, t.acks
    FROM outbox.route_template(p_aggregate_type, p_event_type) t;
END
$$;

-- As in migration 0016, with the destination rendered by outbox.render_destination (before
-- the aggregate's version is taken: a refused value takes nothing).
CREATE OR REPLACE FUNCTION outbox.enqueue(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    tenant         text  DEFAULT NULL,
    headers        jsonb DEFAULT NULL,
    payload_schema text  DEFAULT NULL,
    event_id       uuid  DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    v_id      uuid := coalesce(enqueue.event_id, outbox.uuid_v7());
    v_version bigint;
    r         record;
BEGIN
    IF coalesce(enqueue.aggregate_type, '') = '' THEN
        RAISE EXCEPTION 'outbox.enqueue: aggregate_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF coalesce(enqueue.aggregate_id, '') = '' THEN
        RAISE EXCEPTION 'outbox.enqueue: aggregate_id must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF coalesce(enqueue.event_type, '') = '' THEN
        RAISE EXCEPTION 'outbox.enqueue: event_type must be a non-empty text' USING ERRCODE = '22023';
    END IF;
    IF enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'outbox.enqueue: payload must not be NULL (use ''{}''::jsonb for an empty payload)' USING ERRCODE = '22004';
    END IF;
    IF enqueue.headers IS NOT NULL AND jsonb_typeof(enqueue.headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox.enqueue: headers must be a JSON object of strings, got %', jsonb_typeof(enqueue.headers) USING ERRCODE = '22023';
    END IF;

    SELECT * INTO r FROM outbox.route_template(enqueue.aggregate_type, enqueue.event_type);
    -- The placeholders are replaced here, each value encoded for its place (or refused),
    -- before the destination is frozen and hashed.
    r.topic := outbox.render_destination(r.kind, r.topic, enqueue.aggregate_type, enqueue.aggregate_id);

    INSERT INTO outbox.aggregate_versions AS v (aggregate_type, aggregate_id, last_version)
    VALUES (enqueue.aggregate_type, enqueue.aggregate_id, 1)
    ON CONFLICT ON CONSTRAINT aggregate_versions_pkey
    DO UPDATE SET last_version = v.last_version + 1
    RETURNING v.last_version INTO v_version;

    -- Not a row around outbox.enqueue (trigger events_row_around_enqueue).
    PERFORM set_config('outbox.enqueuing', v_id::text, true);
    INSERT INTO outbox.events (
        event_id, envelope_generation, aggregate_type, aggregate_id, aggregate_version,
        event_type, payload_schema, payload, payload_digest, tenant, headers,
        dest_kind, dest_cluster, dest_topic, dest_key, dest_partitioner,
        dest_route_generation, dest_serializer, dest_acks, destination_digest)
    VALUES (
        v_id, 1, enqueue.aggregate_type, enqueue.aggregate_id, v_version,
        enqueue.event_type, enqueue.payload_schema, enqueue.payload,
        outbox.sha256_text(enqueue.payload::text), enqueue.tenant, enqueue.headers,
        r.kind, r.cluster, r.topic, enqueue.aggregate_id, r.partitioner,
        r.generation, r.serializer, r.acks,
        outbox.sha256_text(outbox.destination_canonical(
            r.kind, r.cluster, r.topic, enqueue.aggregate_id, r.partitioner,
            r.generation, r.serializer, r.acks)));
    RETURN v_id;
END
$$;

-- Refuses a template no value could make legal, naming the function, template and rule.
CREATE FUNCTION outbox.check_route_template(p_function text, p_kind text, p_template text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_problem text := outbox.route_template_problem(p_kind, p_template);
BEGIN
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION '%: the % route template % is refused: %', p_function, p_kind, quote_nullable(p_template), v_problem
            USING ERRCODE = '22023';
    END IF;
END
$$;

-- As in migration 0001, with the template checked.
CREATE OR REPLACE FUNCTION outbox.set_route(
    p_aggregate_type text, p_event_type text, p_topic text,
    p_broker_cluster text DEFAULT 'default', p_broker_kind text DEFAULT 'kafka'
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    g bigint;
BEGIN
    PERFORM outbox.check_route_template('outbox.set_route', p_broker_kind, p_topic);
    UPDATE outbox.route_policy SET active = false
    WHERE active
      AND aggregate_type IS NOT DISTINCT FROM p_aggregate_type
      AND event_type IS NOT DISTINCT FROM p_event_type;
    INSERT INTO outbox.route_policy (aggregate_type, event_type, topic, broker_cluster, broker_kind)
    VALUES (p_aggregate_type, p_event_type, p_topic, p_broker_cluster, p_broker_kind)
    RETURNING generation INTO g;
    RETURN g;
END
$$;

-- As in migration 0010, with the template checked.
CREATE OR REPLACE FUNCTION outbox.set_nats_route(
    p_aggregate_type text, p_event_type text, p_cluster text,
    p_subject text DEFAULT 'outbox.{aggregate_type}.{aggregate_id}'
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    g bigint;
BEGIN
    IF coalesce(p_cluster, '') = '' THEN
        RAISE EXCEPTION 'outbox.set_nats_route: cluster must name the NATS cluster (or server) the relay serves' USING ERRCODE = '22023';
    END IF;
    PERFORM outbox.check_route_template('outbox.set_nats_route', 'nats', p_subject);
    UPDATE outbox.route_policy SET active = false
    WHERE active
      AND aggregate_type IS NOT DISTINCT FROM p_aggregate_type
      AND event_type IS NOT DISTINCT FROM p_event_type;
    INSERT INTO outbox.route_policy (aggregate_type, event_type, topic, broker_cluster, broker_kind,
                                     partitioner)
    VALUES (p_aggregate_type, p_event_type, p_subject, p_cluster, 'nats', 'none')
    RETURNING generation INTO g;
    RETURN g;
END
$$;

-- As in migration 0020, with the template checked.
CREATE OR REPLACE FUNCTION outbox.set_http_route(
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
    PERFORM outbox.check_route_template('outbox.set_http_route', 'http', p_url);
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

-- Unpublished events (the first p_limit found) whose frozen destination these rules would not
-- give them: frozen before this migration from a value the rules now encode (`rendered` is what
-- they give) or refuse (`rendered` is NULL, `reason` the refusal), and not moved by an operator
-- since. `outboxd check` and `outboxd reconcile` name them (docs/security.md).
CREATE FUNCTION outbox.destinations_breaking_rules(p_limit int DEFAULT 20)
RETURNS TABLE (event_id uuid, frozen text, rendered text, reason text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    e record;
    v text;
    n int := 0;
BEGIN
    FOR e IN
        SELECT ev.event_id AS id, ev.aggregate_type, ev.aggregate_id, ev.dest_kind, ev.dest_topic,
               coalesce(rp.topic, CASE WHEN ev.dest_route_generation = 0
                                       THEN 'outbox.event.{aggregate_type}' END) AS template
        FROM outbox.events ev
        LEFT JOIN outbox.route_policy rp ON rp.generation = ev.dest_route_generation
        WHERE ev.dest_kind IN ('http', 'nats', 'kafka')
          AND ev.delivery_set_id IS NULL
          AND NOT EXISTS (SELECT 1 FROM outbox.receipts r WHERE r.event_id = ev.event_id)
          AND NOT EXISTS (SELECT 1 FROM outbox.quarantine q
                          WHERE q.event_id = ev.event_id AND q.resolution = 'skipped')
          -- Moved by an operator (outboxd migrate-destination): their choice stands.
          AND NOT EXISTS (SELECT 1 FROM outbox.destination_migrations dm
                          WHERE dm.event_id = ev.event_id)
    LOOP
        CONTINUE WHEN e.template IS NULL;
        BEGIN
            v := outbox.render_destination(e.dest_kind, e.template, e.aggregate_type, e.aggregate_id);
            IF v IS DISTINCT FROM e.dest_topic THEN
                event_id := e.id; frozen := e.dest_topic; rendered := v;
                reason := 'the rules of migration 0022 encode its values differently';
                RETURN NEXT;
                n := n + 1;
            END IF;
        EXCEPTION WHEN invalid_parameter_value THEN
            event_id := e.id; frozen := e.dest_topic; rendered := NULL; reason := SQLERRM;
            RETURN NEXT;
            n := n + 1;
        END;
        EXIT WHEN n >= p_limit;
    END LOOP;
END
$$;
