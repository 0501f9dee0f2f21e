-- Recovery points of multi-step operations (`idempotency_core::phases`): the operation's
-- name, the phase reached, the token that wrote its first point (its origin) and the state the
-- next phase takes. Nullable, without defaults: adding them rewrites nothing, and statements
-- of an older crate, which never name them, keep working beside a newer one.
ALTER TABLE {records}
    ADD COLUMN IF NOT EXISTS op_name text,
    ADD COLUMN IF NOT EXISTS op_phase integer,
    ADD COLUMN IF NOT EXISTS op_origin bigint,
    ADD COLUMN IF NOT EXISTS op_state bytea;
ALTER TABLE {records}
    ADD CONSTRAINT idempotency_op_phase_range CHECK (op_phase BETWEEN 0 AND 65535) NOT VALID;
