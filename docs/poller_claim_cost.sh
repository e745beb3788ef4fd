#!/bin/sh
# The poller's claim (docs/migrating.md, step 2) with nothing claimable, before and after
# outboxd has taken N rows of a type, on a scratch database: docs/migrating.md quotes its
# figures. Needs psql and an outboxd binary; the database must be empty and disposable.
#
#   docs/poller_claim_cost.sh postgres://postgres@127.0.0.1:5432/claim_cost [N=1000000] [MARK]
#
# MARK is the --mark-published assignment (default: outboxd's default for
# --published-column published_at); MARK=none attaches without one, as before migration 0025.
set -eu
URL=$1
N=${2:-1000000}
MARK=${3:-default}
OUTBOXD=${OUTBOXD:-outboxd}
P="psql $URL -v ON_ERROR_STOP=1 -qX"

"$OUTBOXD" migrate --database-url "$URL" >/dev/null
$P <<'SQL'
CREATE SCHEMA app;
CREATE TABLE app.outbox (
    seq           bigserial,
    id            uuid PRIMARY KEY,
    aggregatetype text NOT NULL,
    aggregateid   text NOT NULL,
    type          text NOT NULL,
    payload       jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz
);
-- The poller's own partial index: its claim reads only unpublished rows.
CREATE INDEX outbox_unpublished ON app.outbox (seq) WHERE published_at IS NULL;
SQL
case $MARK in
  default) "$OUTBOXD" migrate --database-url "$URL" --poller-table app.outbox --published-column published_at ;;
  none) "$OUTBOXD" migrate --database-url "$URL" --poller-table app.outbox --published-column published_at --no-mark-published ;;
  *) "$OUTBOXD" migrate --database-url "$URL" --poller-table app.outbox --published-column published_at --mark-published "$MARK" ;;
esac
# outboxd owns type audit (no poller runs here: the switch is set directly, as `share take`
# ends).
$P -c "SELECT outbox.set_dispatch_owner('audit', 'outboxd')" >/dev/null

claim() {
    # Five runs; the figure is the last (warm) one's execution time.
    for _ in 1 2 3 4 5; do
        $P -c "EXPLAIN (ANALYZE, BUFFERS, SUMMARY ON)
               SELECT id, aggregatetype, aggregateid, payload FROM app.outbox
                WHERE published_at IS NULL AND outbox.poller_may_claim(id)
                ORDER BY seq LIMIT 100 FOR UPDATE SKIP LOCKED" >/tmp/claim_cost.$$
    done
    printf '%s: %s; %s\n' "$1" "$(grep 'Execution Time' /tmp/claim_cost.$$ | sed 's/^ *//')" \
        "$(grep -m1 'Buffers' /tmp/claim_cost.$$ | sed 's/^ *//')"
    rm -f /tmp/claim_cost.$$
}

claim "claim with 0 rows taken"
i=0
while [ $i -lt "$N" ]; do
    b=$(( N - i < 100000 ? N - i : 100000 ))
    # Producers' rows of the taken type, through the capture trigger (enqueued for outboxd).
    $P -c "INSERT INTO app.outbox (id, aggregatetype, aggregateid, type, payload)
           SELECT gen_random_uuid(), 'audit', 'a-' || (g % 10000), 'Changed', jsonb_build_object('n', g)
           FROM generate_series(1, $b) g"
    i=$(( i + b ))
done
$P -c "SELECT count(*) AS taken, count(*) FILTER (WHERE published_at IS NULL) AS taken_and_unmarked FROM app.outbox"
claim "claim with $N rows taken, before any vacuum"
$P -c "VACUUM ANALYZE app.outbox"
claim "claim with $N rows taken, after VACUUM ANALYZE"
