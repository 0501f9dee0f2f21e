-- The completer's listing of abandoned operations (`RecoveryPoints::abandoned`) reads this
-- index, not the table: only records of multi-step operations are in it. It names no column
-- that a one-step record's writes change, so their updates stay heap-only (HOT): an index on
-- `updated_at` or `status` would make every heartbeat and settle write index entries, and
-- at SERIALIZABLE turn into serialization failures of unrelated claims.
-- {abandoned_index} is its name (quoted).
CREATE INDEX IF NOT EXISTS {abandoned_index} ON {records} (op_name)
    WHERE op_name IS NOT NULL;
