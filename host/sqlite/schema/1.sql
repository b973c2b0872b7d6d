-- Schema version 1: the record table, its unique key (the final arbiter of
-- who executes) and the indexes behind the sweeper and the reconciliation
-- scan.
CREATE TABLE idempotency_record (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        scope_key TEXT NOT NULL,
        biz_type TEXT NOT NULL,
        idem_key TEXT NOT NULL,
        request_hash TEXT NOT NULL,
        fingerprint_version INTEGER NOT NULL,
        status TEXT NOT NULL CHECK (status IN
            ('processing', 'succeeded', 'failed', 'released', 'outcome-unknown')),
        fencing_token INTEGER NOT NULL,
        revision INTEGER NOT NULL,
        attempts INTEGER NOT NULL,
        lease_until INTEGER,
        created_at INTEGER NOT NULL,
        updated_at INTEGER NOT NULL,
        expires_at INTEGER,
        result_ref TEXT,
        response BLOB,
        failure BLOB,
        UNIQUE (scope_key, biz_type, idem_key)
    );
    CREATE INDEX idempotency_record_sweep
        ON idempotency_record (expires_at)
        WHERE status IN ('succeeded', 'failed', 'released');
    CREATE INDEX idempotency_record_stale_processing
        ON idempotency_record (biz_type, lease_until)
        WHERE status = 'processing';
    CREATE INDEX idempotency_record_outcome_unknown
        ON idempotency_record (biz_type, updated_at)
        WHERE status = 'outcome-unknown';
