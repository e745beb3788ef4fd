package outboxd.bench;

import java.io.FileInputStream;
import java.io.InputStream;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.Future;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.header.internals.RecordHeaders;
import org.apache.kafka.common.serialization.ByteArraySerializer;
import org.apache.kafka.connect.header.Header;
import org.apache.kafka.connect.source.SourceRecord;

import io.debezium.embedded.Connect;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.ChangeEvent;

/**
 * The Debezium side of {@code outbox-embedded bench}: what a team runs instead of outboxd when it
 * uses Debezium's outbox support without a Kafka Connect cluster. The Debezium embedded engine
 * (PostgreSQL connector, pgoutput, the outbox EventRouter SMT) hands batches of routed records to
 * {@link Sender}, which produces each one with a {@link KafkaProducer} ({@code acks=all},
 * idempotence on) and marks a record processed only after the broker acknowledged it. Debezium
 * commits offsets of processed records only, and confirms an LSN to the replication slot only
 * after committing the offset that holds it: so the slot's {@code confirmed_flush_lsn} passes an
 * event only after the broker has it, as outboxd's does after the receipt is accepted.
 *
 * <p>Usage: {@code java -cp ... outboxd.bench.DebeziumRelay relay.properties}. Keys starting
 * with {@code engine.} configure the engine (the prefix removed), {@code producer.} the Kafka
 * producer; {@code bench.send-topic-prefix} names the topics records are produced to (others,
 * such as heartbeats, are marked processed without being sent). Prints {@code started} and, every
 * second, {@code sent N} on stdout; an error ends the process with exit code 2.
 */
public final class DebeziumRelay {

    private DebeziumRelay() {
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: DebeziumRelay relay.properties");
            System.exit(64);
        }
        Properties all = new Properties();
        try (InputStream in = new FileInputStream(args[0])) {
            all.load(in);
        }
        Properties engineProps = subset(all, "engine.");
        Properties producerProps = subset(all, "producer.");
        String sendPrefix = all.getProperty("bench.send-topic-prefix", "outbox.event.");

        KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(producerProps,
                new ByteArraySerializer(), new ByteArraySerializer());
        Sender sender = new Sender(producer, sendPrefix);
        CountDownLatch stopped = new CountDownLatch(1);
        DebeziumEngine<ChangeEvent<SourceRecord, SourceRecord>> engine = DebeziumEngine.create(Connect.class)
                .using(engineProps)
                .notifying(sender)
                .using((success, message, error) -> {
                    if (!success) {
                        System.err.println("debezium engine stopped: " + message);
                        if (error != null) {
                            error.printStackTrace();
                        }
                        System.err.flush();
                        Runtime.getRuntime().halt(2);
                    }
                    stopped.countDown();
                })
                .build();
        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            try {
                engine.close();
                stopped.await();
            }
            catch (Exception e) {
                e.printStackTrace();
            }
            producer.close();
        }, "shutdown"));
        Thread runner = new Thread(engine, "debezium-engine");
        runner.start();
        System.out.println("started");
        System.out.flush();
        long last = -1;
        while (runner.isAlive()) {
            runner.join(1000);
            long n = sender.sent.get();
            if (n != last) {
                System.out.println("sent " + n);
                System.out.flush();
                last = n;
            }
        }
    }

    private static Properties subset(Properties all, String prefix) {
        Properties p = new Properties();
        for (String k : all.stringPropertyNames()) {
            if (k.startsWith(prefix)) {
                p.setProperty(k.substring(prefix.length()), all.getProperty(k));
            }
        }
        return p;
    }

    /**
     * Produces a batch, waits for every acknowledgement, then marks the records processed in
     * order: what Debezium Server's Kafka sink does. A failed send ends the process (the bench
     * must never count an event that was not delivered).
     */
    static final class Sender implements DebeziumEngine.ChangeConsumer<ChangeEvent<SourceRecord, SourceRecord>> {
        private final KafkaProducer<byte[], byte[]> producer;
        private final String sendPrefix;
        final AtomicLong sent = new AtomicLong();

        Sender(KafkaProducer<byte[], byte[]> producer, String sendPrefix) {
            this.producer = producer;
            this.sendPrefix = sendPrefix;
        }

        @Override
        public void handleBatch(List<ChangeEvent<SourceRecord, SourceRecord>> records,
                                DebeziumEngine.RecordCommitter<ChangeEvent<SourceRecord, SourceRecord>> committer)
                throws InterruptedException {
            List<Future<RecordMetadata>> acks = new ArrayList<>(records.size());
            for (ChangeEvent<SourceRecord, SourceRecord> r : records) {
                SourceRecord sr = r.value();
                if (sr.topic() == null || !sr.topic().startsWith(sendPrefix)) {
                    acks.add(null);
                    continue;
                }
                RecordHeaders headers = new RecordHeaders();
                for (Header h : sr.headers()) {
                    headers.add(h.key(), bytes(h.value()));
                }
                acks.add(producer.send(new ProducerRecord<>(sr.topic(), null, null,
                        bytes(sr.key()), bytes(sr.value()), headers)));
            }
            for (int i = 0; i < records.size(); i++) {
                Future<RecordMetadata> ack = acks.get(i);
                if (ack != null) {
                    try {
                        ack.get();
                    }
                    catch (ExecutionException e) {
                        System.err.println("send failed: " + e.getCause());
                        e.getCause().printStackTrace();
                        System.err.flush();
                        Runtime.getRuntime().halt(2);
                    }
                    sent.incrementAndGet();
                }
                committer.markProcessed(records.get(i));
            }
            committer.markBatchFinished();
        }

        /**
         * Connect values as the bytes a {@code StringConverter} would write: the EventRouter's
         * key is the aggregate id (text), its value the {@code jsonb} payload (JSON text), its
         * {@code id} header the event's UUID.
         */
        private static byte[] bytes(Object v) {
            if (v == null) {
                return null;
            }
            if (v instanceof byte[] b) {
                return b;
            }
            return v.toString().getBytes(StandardCharsets.UTF_8);
        }
    }
}
