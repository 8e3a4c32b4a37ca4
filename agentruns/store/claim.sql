-- Claim a queued run (Postgres), as ONE statement: queued -> running with a new
-- fencing epoch, and the stored transcript it continues from. A run waits while
-- an older run of its concurrency key is queued, or interrupted by a drain until
-- recover() requeues it (oldest first: a thread's runs keep their order); a
-- running run of its key makes the partial unique index refuse the update.
WITH run AS (
    UPDATE agentruns_runs AS r SET
        status = 'running',
        epoch = r.epoch + 1,
        claim_owner = %(owner)s,
        claim_expires_at = %(expires_at)s,
        started_at = COALESCE(r.started_at, %(now)s),
        updated_at = %(now)s
    -- By the id's unique index and the key's index, never the status index (see
    -- commit.sql): there may be many queued runs.
    WHERE r.id = %(run_id)s
      AND COALESCE(r.status, '') = 'queued'
      AND (r.concurrency_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM agentruns_runs AS older
            WHERE older.concurrency_key = r.concurrency_key
              AND COALESCE(older.status, '') IN ('queued', 'interrupted')
              AND (older.created_at, older.id) < (r.created_at, r.id)))
    RETURNING r.*
)
-- A new run has no messages: no lookup. (The message rows cannot change under
-- this statement: only the run's owner appends, and it has none until now.)
SELECT run.*,
       CASE WHEN run.message_count > 0 THEN (
           SELECT json_agg(m.body ORDER BY m.seq) FROM agentruns_messages AS m
           WHERE m.run_key = run.key)
       END AS messages
FROM run
