# One image for every agentruns service in docker-compose.yml: the library, celeryconfig.py
# and the example agents. Services run from /app, where Celery finds celeryconfig.py and
# the engine finds the agent modules named by AGENTRUNS_AGENTS.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app

# Dependencies first, so editing an agent does not reinstall them.
COPY pyproject.toml README.md ./
COPY agentruns ./agentruns
RUN pip install . "flower>=2.0"

COPY celeryconfig.py ./
COPY workers ./workers

# Celery warns against running workers as root.
RUN useradd --create-home --uid 10001 agentruns
USER agentruns

CMD ["celery", "-A", "agentruns", "worker", "-P", "threads", "-c", "64", "-E", "--loglevel=INFO"]
