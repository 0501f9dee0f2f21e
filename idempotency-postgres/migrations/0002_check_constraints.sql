-- The same CHECK constraints as the SQLite table: a row no correct store writes is refused at
-- write time, not only when it is read. NOT VALID: rows written before this migration are not
-- scanned (a row that breaks a rule is still reported as corrupt when it is read), so the
-- migration takes no long lock on a large table.
ALTER TABLE {records}
    ADD CONSTRAINT idempotency_fingerprint_length CHECK (length(fingerprint) = 32) NOT VALID,
    ADD CONSTRAINT idempotency_attempts_positive CHECK (attempts >= 1) NOT VALID,
    ADD CONSTRAINT idempotency_hits_non_negative CHECK (hits >= 0) NOT VALID;
