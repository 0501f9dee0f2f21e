-- The records table and its expiry index.
-- {records} is the schema-qualified table, {expires_index} the index name (both quoted).
CREATE TABLE IF NOT EXISTS {records} (
    scope             text        NOT NULL,
    key               text        NOT NULL,
    fingerprint       bytea       NOT NULL,
    status            text        NOT NULL CHECK (status IN ('pending', 'completed', 'failed')),
    token             bigint      NOT NULL CHECK (token > 0),
    lease_until       timestamptz,
    outcome           bytea,
    attempts          integer     NOT NULL,
    failure_retryable boolean,
    failure_message   text,
    hits              bigint      NOT NULL DEFAULT 0,
    created_at        timestamptz NOT NULL,
    updated_at        timestamptz NOT NULL,
    expires_at        timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
) WITH (fillfactor = 80);

-- Finds expired records in order for the batched purge.
CREATE INDEX IF NOT EXISTS {expires_index} ON {records} (expires_at);
