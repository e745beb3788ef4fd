#!/usr/bin/env python3
"""A consumer of outboxd's events in Python, written only from docs/consumers.md.

confluent-kafka reads the topic; psycopg 3 holds the consumer's own PostgreSQL database, in
which docs/consumer_inbox.sql was installed and the effect table lives. Per message:

    BEGIN
      SELECT outbox.inbox_receive(...)    -- records the message, says what to do
      the effect, if it says 'apply'      -- in the same transaction
    COMMIT
    commit the Kafka offset               -- only now, synchronously

The test suite (tests/e2e/consumer_recipe.rs) runs it with crash points and with planted bugs:
  --crash-in-txn N        exit abruptly inside the N-th message's transaction, after its effect
  --crash-after-commit N  exit abruptly after the N-th message's COMMIT, before its offset commit
  --bug offset-first      commit the offset before the transaction (the recipe's order reversed)
  --bug no-inbox          apply every message without the inbox (no dedup)
It exits 0 once no message arrived for --idle-secs, printing `processed=N`.
"""

import argparse
import os
import sys
import time

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition


def header_map(msg):
    # outboxd's headers are UTF-8 text: id (a UUID), aggregate_type, aggregate_id,
    # aggregate_version (decimal), event_type, ...
    return {k: v.decode("utf-8") for k, v in (msg.headers() or []) if v is not None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--consumer-id", required=True)
    p.add_argument("--gap-policy", default="reject", choices=["reject", "report"])
    p.add_argument("--crash-in-txn", type=int, default=0)
    p.add_argument("--crash-after-commit", type=int, default=0)
    p.add_argument("--bug", choices=["offset-first", "no-inbox"], default=None)
    p.add_argument("--idle-secs", type=float, default=3.0)
    p.add_argument("--max-secs", type=float, default=120.0)
    a = p.parse_args()

    consumer = Consumer({
        "bootstrap.servers": a.bootstrap,
        "group.id": a.group,
        "enable.auto.commit": False,          # the offset moves only after the COMMIT
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
    })
    # Every partition of the topic, from the group's committed offsets (no rebalance wait).
    meta = consumer.list_topics(a.topic, timeout=30).topics[a.topic]
    if meta.error is not None:
        raise KafkaException(meta.error)
    parts = [TopicPartition(a.topic, i) for i in sorted(meta.partitions)]
    committed = consumer.committed(parts, timeout=30)
    for tp in committed:
        if tp.offset < 0:
            tp.offset = OFFSET_BEGINNING
    consumer.assign(committed)

    db = psycopg.connect(a.db, autocommit=True)   # transactions are explicit below
    processed = 0
    started = last_message = time.monotonic()
    while True:
        now = time.monotonic()
        if now - last_message > a.idle_secs or now - started > a.max_secs:
            break
        msg = consumer.poll(0.2)
        if msg is None:
            continue
        if msg.error():
            raise KafkaException(msg.error())
        last_message = time.monotonic()
        h = header_map(msg)
        processed += 1
        if a.bug == "offset-first":
            consumer.commit(message=msg, asynchronous=False)
        try:
            with db.transaction():
                if a.bug == "no-inbox":
                    decision = "apply"
                else:
                    decision = db.execute(
                        "SELECT outbox.inbox_receive(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                        (a.consumer_id, h["id"], h["aggregate_type"], h["aggregate_id"],
                         int(h["aggregate_version"]), h.get("event_type"), msg.topic(),
                         msg.partition(), msg.offset(), a.gap_policy),
                    ).fetchone()[0]
                if decision in ("apply", "apply_with_gap"):
                    db.execute(
                        "INSERT INTO effects (event_id, aggregate_id, version) VALUES (%s, %s, %s)",
                        (h["id"], h["aggregate_id"], int(h["aggregate_version"])),
                    )
                if a.crash_in_txn == processed:
                    os._exit(3)   # inside the transaction: it rolls back, the offset stays
        except psycopg.Error as e:
            if e.sqlstate == "OX001":
                # A version gap under policy reject: nothing was recorded and the offset is not
                # committed, so the message comes back; stop (or seek back and retry later).
                print(f"gap: {e}", file=sys.stderr)
                sys.exit(5)
            raise
        if a.crash_after_commit == processed:
            os._exit(4)       # after COMMIT, before the offset commit: redelivered, a duplicate
        if a.bug != "offset-first":
            consumer.commit(message=msg, asynchronous=False)
    consumer.close()
    print(f"processed={processed}")


if __name__ == "__main__":
    main()
