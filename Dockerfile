# One image for producer, worker, simulator, monitor and CLI: `docker run budgetq:local status -c ...`.
# `docker run --rm budgetq:local demo` runs the whole demo inside the container (its own redis-server).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# redis-server only for `budgetq demo` (a private one on a free port, as `make demo` starts);
# docker compose runs Redis as its own service and never uses this one.
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 --user-group budgetq
WORKDIR /app

# Dependencies first, from pyproject.toml alone and an empty package skeleton: this layer is
# rebuilt only when pyproject.toml changes, not on every code edit.
COPY pyproject.toml README.md ./
RUN mkdir -p budgetq \
 && pip install . \
 && pip uninstall -y budgetq \
 && rm -rf build ./*.egg-info budgetq

# Then the code (see .dockerignore for what stays out), installed as the same wheel users get
# (tests/test_packaging.py builds that wheel and runs `budgetq demo` from it). The source tree
# is removed, so nothing at run time can import it instead of the installed package: the demo's
# config and datasets come from the wheel (importlib.resources).
COPY . .
RUN pip wheel --no-deps . -w /tmp/wheels \
 && pip install --no-deps /tmp/wheels/budgetq-*.whl \
 && cd / && rm -rf /app /tmp/wheels \
 && mkdir -p /out \
 && chown budgetq:budgetq /out

WORKDIR /home/budgetq
USER budgetq
# Workers stop taking jobs on SIGTERM and finish what is in flight (worker.grace_s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["budgetq"]
CMD ["--help"]
