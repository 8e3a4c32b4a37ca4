-- The appends of commit.sql for any number of steps and messages: each list is
-- one JSON array parameter, unpacked in order; indexes follow the run's counters
-- as the update left them.
new_steps AS (
    INSERT INTO agentruns_steps
        (run_key, idx, kind, name, input, output, error, started_at, finished_at)
    SELECT run.key, run.step_count - %(n_steps)s + s.ord - 1,
           s.kind, s.name, s.input, s.output, s.error, s.started_at, s.finished_at
    FROM run, ROWS FROM (
        json_to_recordset(%(steps)s::json) AS (
            kind text, name text, input json, output json, error json,
            started_at timestamptz, finished_at timestamptz)
    ) WITH ORDINALITY AS s(kind, name, input, output, error, started_at, finished_at, ord)
), new_messages AS (
    INSERT INTO agentruns_messages (run_key, seq, body)
    SELECT run.key, run.message_count - %(n_messages)s + m.ord - 1, m.body
    FROM run, json_array_elements(%(messages)s::json) WITH ORDINALITY AS m(body, ord)
)
