# rust:1-bookworm already has libssl-dev (TLS to PostgreSQL and librdkafka SSL/SASL).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p outboxd

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/outboxd /usr/local/bin/outboxd
ENTRYPOINT ["/usr/local/bin/outboxd"]
