-- The appends of commit.sql for the commonest write, one step and one message (a
-- model response, or the result of a single tool call): plain parameters, with
-- no JSON array to unpack. Postgres spends about a quarter less on such a write.
new_steps AS (
    INSERT INTO agentruns_steps
        (run_key, idx, kind, name, input, output, error, started_at, finished_at)
    SELECT run.key, run.step_count - 1, %(step_kind)s, %(step_name)s, %(step_input)s::json,
           %(step_output)s::json, %(step_error)s::json, %(step_started_at)s,
           %(step_finished_at)s
    FROM run
), new_messages AS (
    INSERT INTO agentruns_messages (run_key, seq, body)
    SELECT run.key, run.message_count - 1, %(message)s::json FROM run
)
