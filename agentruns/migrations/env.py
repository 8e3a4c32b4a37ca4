"""Alembic environment: migrations ship inside the package and run via ``agentruns migrate``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from agentruns.migrations import VERSION_TABLE
from agentruns.store.schema import metadata

config = context.config
connectable = config.attributes.get("connection")
# Where the revision is recorded: agentruns' own table (tests pass Alembic's
# default to build a database as releases before it left one).
version_table = config.attributes.get("version_table", VERSION_TABLE)

if connectable is None:
    engine = engine_from_config(
        config.get_section(config.config_ini_section) or {},
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with engine.connect() as connection:
        context.configure(
            connection=connection, target_metadata=metadata, version_table=version_table
        )
        with context.begin_transaction():
            context.run_migrations()
else:
    context.configure(connection=connectable, target_metadata=metadata, version_table=version_table)
    with context.begin_transaction():
        context.run_migrations()
