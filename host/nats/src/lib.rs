//! idem's NATS JetStream adapter (being written).
