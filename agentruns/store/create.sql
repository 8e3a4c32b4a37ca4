-- Store a new queued run (Postgres); a run with the same idempotency key already
-- stored makes this return nothing (the caller then reads that one).
INSERT INTO agentruns_runs
    (id, agent, status, trigger, idempotency_key, concurrency_key, thread, budget,
     created_at, updated_at)
VALUES
    (%(id)s, %(agent)s, 'queued', %(trigger)s::json, %(idempotency_key)s, %(concurrency_key)s,
     %(thread)s, %(budget)s::json, %(now)s, %(now)s)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING *
