-- One guarded write to a run, as ONE statement (Postgres): the run row update
-- and the appended steps and messages happen together or not at all, and cost
-- one round trip. Appends get their indexes from the run's counters, under the
-- row lock the update takes. A guard that matches no row inserts nothing.
WITH run AS (
    UPDATE agentruns_runs SET
        updated_at = %(now)s,
        step_count = step_count + %(n_steps)s,
        message_count = message_count + %(n_messages)s,
        steps_used = steps_used + %(model_calls)s,
        input_tokens = input_tokens + %(input_tokens)s,
        output_tokens = output_tokens + %(output_tokens)s,
        cache_creation_input_tokens = cache_creation_input_tokens + %(cache_creation)s,
        cache_read_input_tokens = cache_read_input_tokens + %(cache_read)s,
        checkpoint_step = CASE WHEN %(checkpoint)s THEN %(checkpoint_step)s ELSE checkpoint_step END,
        checkpoint_reason = CASE WHEN %(checkpoint)s THEN %(checkpoint_reason)s ELSE checkpoint_reason END,
        checkpoint_messages = CASE WHEN %(checkpoint)s THEN message_count + %(n_messages)s
                                   ELSE checkpoint_messages END,
        checkpoint_at = CASE WHEN %(checkpoint)s THEN %(now)s ELSE checkpoint_at END,
        state = CASE WHEN %(set_state)s THEN %(state)s::json ELSE state END,
        pending = CASE WHEN %(set_pending)s THEN %(pending)s::json ELSE pending END,
        -- A cancel asked for while the run ran wins over its final answer, which
        -- came before the owner heard of it (kept in the transcript, not as output).
        status = CASE WHEN cancel_requested AND %(status)s::text = 'completed' THEN 'cancelled'
                      ELSE COALESCE(%(status)s, status) END,
        -- Postgres' clock, as created_at's: a thread continues the run that finished
        -- last, and a worker whose clock is behind must not make its run look older.
        finished_at = CASE WHEN %(final)s THEN statement_timestamp() ELSE finished_at END,
        output = CASE WHEN cancel_requested AND %(status)s::text = 'completed' THEN output
                      ELSE COALESCE(%(output)s, output) END,
        error = CASE WHEN %(set_error)s THEN %(error)s::json ELSE error END,
        waiting = CASE WHEN %(set_waiting)s THEN %(waiting)s::json ELSE waiting END,
        waiting_token = CASE WHEN %(set_waiting)s THEN %(waiting_token)s ELSE waiting_token END,
        claim_owner = CASE WHEN %(release)s THEN NULL ELSE claim_owner END,
        claim_expires_at = CASE WHEN %(release)s THEN NULL ELSE claim_expires_at END
    -- The run is found by its id's unique index; the guard is a filter. (As
    -- COALESCE, the status cannot pick the status index instead: with a prepared
    -- statement's generic plan, that index could scan every running run.)
    WHERE id = %(run_id)s
      AND COALESCE(status, '') = %(guard_status)s
      AND (%(guard_epoch)s::int IS NULL OR epoch = %(guard_epoch)s::int)
      AND (%(guard_token)s::text IS NULL OR waiting_token = %(guard_token)s::text)
    RETURNING *
), {appends}, lazy AS (
    -- A write marked not durable (the tool results of a step: a recovery repeats
    -- them) commits without waiting for its WAL flush. Only a crash of Postgres
    -- itself can lose it, and then also nothing written after it; the run's next
    -- durable write flushes it. set_config(..., true) lasts for this statement's
    -- own transaction, i.e. until its commit. A durable write leaves this CTE
    -- unreferenced, so it is not evaluated at all.
    SELECT set_config('synchronous_commit', 'off', true) AS synchronous_commit
)
-- Only what a write can change: the caller already holds the rest of the run.
-- (The column list is store/postgres.py's WRITE_RETURNS; {lazy} is ", lazy" in
-- the statement for writes that are not durable, else empty; {appends} is
-- append_many.sql, or append_one.sql for a write of one step and one message.)
SELECT {returns} FROM run{lazy}
