//! idem's RabbitMQ adapter (being written).
