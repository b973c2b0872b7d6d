-- Schema version 3: the status checks as = chains, not IN lists. SQLite
-- evaluates an IN list of more than two constants by building a temporary
-- b-tree, and the CHECK and the sweep index's WHERE made it build two per
-- insert and three per swap: about half of the CPU of an insert and a swap,
-- measured. A CHECK cannot be altered, so the table is rebuilt, rows and
-- ids kept. The AUTOINCREMENT counter is carried over, so that an id is
-- still never reused.
CREATE TABLE idempotency_record_v3 (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        scope_key TEXT NOT NULL,
        biz_type TEXT NOT NULL,
        idem_key TEXT NOT NULL,
        request_hash TEXT NOT NULL,
        fingerprint_version INTEGER NOT NULL,
        status TEXT NOT NULL CHECK (status = 'processing' OR status = 'succeeded'
            OR status = 'failed' OR status = 'released' OR status = 'outcome-unknown'),
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
    INSERT INTO idempotency_record_v3 (id, scope_key, biz_type, idem_key, request_hash,
            fingerprint_version, status, fencing_token, revision, attempts, lease_until,
            created_at, updated_at, expires_at, result_ref, response, failure)
        SELECT id, scope_key, biz_type, idem_key, request_hash,
            fingerprint_version, status, fencing_token, revision, attempts, lease_until,
            created_at, updated_at, expires_at, result_ref, response, failure
        FROM idempotency_record ORDER BY id;
    DELETE FROM sqlite_sequence WHERE name = 'idempotency_record_v3';
    INSERT INTO sqlite_sequence (name, seq)
        SELECT 'idempotency_record_v3', seq FROM sqlite_sequence
        WHERE name = 'idempotency_record';
    DROP TABLE idempotency_record;
    ALTER TABLE idempotency_record_v3 RENAME TO idempotency_record;
    CREATE INDEX idempotency_record_sweep
        ON idempotency_record (expires_at)
        WHERE (status = 'succeeded' OR status = 'failed' OR status = 'released');
    CREATE INDEX idempotency_record_stale_processing
        ON idempotency_record (biz_type, lease_until)
        WHERE status = 'processing';
    CREATE INDEX idempotency_record_outcome_unknown
        ON idempotency_record (biz_type, updated_at)
        WHERE status = 'outcome-unknown';
