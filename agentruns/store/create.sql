-- Store a new run (Postgres): queued, or already claimed by the worker that stores
-- it and executes it at once (running, epoch 1). A run with the same idempotency
-- key already stored makes this return nothing (the caller then reads that one).
-- Its created_at is the database's clock, not the sender's: a concurrency key's
-- (and a thread's) queued runs go in that order, whichever host sent them.
INSERT INTO agentruns_runs
    (id, agent, status, trigger, idempotency_key, concurrency_key, thread, budget,
     epoch, claim_owner, claim_expires_at, created_at, updated_at, started_at)
VALUES
    (%(id)s, %(agent)s, %(status)s, %(trigger)s::json, %(idempotency_key)s,
     %(concurrency_key)s, %(thread)s, %(budget)s::json,
     %(epoch)s, %(claim_owner)s, %(claim_expires_at)s, statement_timestamp(), %(updated_at)s,
     %(started_at)s)
ON CONFLICT (idempotency_key) DO NOTHING
-- The columns this release knows, named ({columns}): not *, which a later release's
-- migration adding a column would change under this release's prepared statement.
RETURNING {columns}
