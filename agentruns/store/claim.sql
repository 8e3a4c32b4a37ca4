-- Claim a queued run (Postgres), as ONE statement: queued -> running with a new
-- fencing epoch, and the stored transcript it continues from. A run waits while
-- an older run of its concurrency key is queued, running, or interrupted by a
-- drain until recover() requeues it (oldest first, by the database's clock:
-- a thread's runs keep their order, whatever the senders' clocks said), and in
-- its thread's own line, while an older run of the line waits on an approval. Any
-- running run of its key also makes the partial unique index refuse the update;
-- the older running one is named here too because the index checks the row as
-- committed, this as this statement's snapshot saw it: an older run leaving
-- running (for interrupted) as this claims must not let it through.
WITH RECURSIVE run AS (
    UPDATE agentruns_runs AS r SET
        status = 'running',
        epoch = r.epoch + 1,
        claim_owner = %(owner)s,
        claim_expires_at = %(expires_at)s,
        started_at = COALESCE(r.started_at, %(now)s),
        updated_at = %(now)s
    -- The run by the id's unique index, never the status index (see commit.sql):
    -- there may be many queued runs. The older ones by the index of the key's line
    -- (agentruns_runs_key_line), whose predicate this repeats: not the key's whole
    -- history, which a long-lived thread makes long.
    WHERE r.id = %(run_id)s
      -- Or the run this very claim already has: a first try that committed before
      -- its connection went, whose owner and expiry the claim sent again repeats
      -- (the owner holds the run's lease, so none other claimed it since).
      AND ((COALESCE(r.status, '') = 'running' AND r.claim_owner = %(owner)s
            AND r.claim_expires_at = %(expires_at)s)
      OR (COALESCE(r.status, '') = 'queued'
      AND (r.concurrency_key IS NULL OR (NOT EXISTS (
            SELECT 1 FROM agentruns_runs AS older
            WHERE older.concurrency_key = r.concurrency_key
              AND older.status IN ('queued', 'running', 'interrupted')
              AND (older.created_at, older.id) < (r.created_at, r.id))
      -- A run in its thread's own line (its key is the thread's, as dispatch makes
      -- it) also waits while an older run of the line waits on an approval: it
      -- continues that run's conversation, once it has ended. By the thread's index,
      -- its unfinished runs (a waiting run has no finished_at); not the status index
      -- nor the key's (hence COALESCE), which hold every waiting run and the key's
      -- whole history.
      AND (r.thread IS NULL OR r.concurrency_key <> '{thread_key}' || r.thread OR NOT EXISTS (
            SELECT 1 FROM agentruns_runs AS held
            WHERE held.thread = r.thread
              AND held.finished_at IS NULL
              AND COALESCE(held.status, '') = 'waiting'
              AND COALESCE(held.concurrency_key, '') = r.concurrency_key
              AND (held.created_at, held.id) < (r.created_at, r.id)))))))
    RETURNING r.*
)
-- A new run has no messages: no lookup. (The message rows cannot change under
-- this statement: only the run's owner appends, and it has none until now.) The
-- transcript is the run's own messages after those of the runs it continues, as
-- store/history.py reads it.
, chain(run_key, base_key, lo, hi) AS (
    SELECT run.key, run.base_key, COALESCE(run.base_count, 0), run.message_count
    FROM run WHERE run.message_count > 0
    UNION
    SELECT p.key, p.base_key, COALESCE(p.base_count, 0), c.lo
    FROM agentruns_runs AS p JOIN chain AS c ON p.key = c.base_key
)
-- The run's columns this release knows, named (as create.sql's).
SELECT {run_columns},
       CASE WHEN run.message_count > 0 THEN (
           SELECT json_agg(m.body ORDER BY m.seq) FROM chain AS c
           JOIN agentruns_messages AS m
             ON m.run_key = c.run_key AND m.seq >= c.lo AND m.seq < c.hi)
       END AS messages
FROM run
