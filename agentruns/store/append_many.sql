-- The appends of commit.sql for any number of steps and messages: each list is
-- one JSON array parameter, unpacked in order; indexes follow the run's counters
-- as the update left them.
new_steps AS (
    -- One JSON array per column, zipped by ROWS FROM. Not an array of step
    -- objects: reading a field out of JSON makes Postgres decode the whole
    -- object, and it refuses one holding "\u0000" anywhere (a tool's input may);
    -- json_array_elements hands each element over as it is.
    INSERT INTO agentruns_steps
        (run_key, idx, kind, name, input, output, error, started_at, finished_at)
    SELECT run.key, run.step_count - %(n_steps)s + s.ord - 1, s.kind, s.name,
           CASE WHEN s.input::text <> 'null' THEN s.input END,
           CASE WHEN s.output::text <> 'null' THEN s.output END,
           CASE WHEN s.error::text <> 'null' THEN s.error END,
           s.started_at::timestamptz, s.finished_at::timestamptz
    FROM run, ROWS FROM (
        json_array_elements_text(%(step_kinds)s::json),
        json_array_elements_text(%(step_names)s::json),
        json_array_elements(%(step_inputs)s::json),
        json_array_elements(%(step_outputs)s::json),
        json_array_elements(%(step_errors)s::json),
        json_array_elements_text(%(step_started_at)s::json),
        json_array_elements_text(%(step_finished_at)s::json)
    ) WITH ORDINALITY AS s(kind, name, input, output, error, started_at, finished_at, ord)
), new_messages AS (
    INSERT INTO agentruns_messages (run_key, seq, body)
    SELECT run.key, run.message_count - %(n_messages)s + m.ord - 1, m.body
    FROM run, json_array_elements(%(messages)s::json) WITH ORDINALITY AS m(body, ord)
)
