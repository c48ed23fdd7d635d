# One image for producer, worker, simulator, monitor and CLI: `docker run budgetq:local status -c ...`.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 1000 --user-group budgetq
WORKDIR /app

# Dependencies first, from pyproject.toml alone and an empty package skeleton: this layer is
# rebuilt only when pyproject.toml changes, not on every code edit.
COPY pyproject.toml README.md ./
RUN mkdir -p shared producer worker simulator budgetq \
 && pip install . \
 && pip uninstall -y budgetq \
 && rm -rf build ./*.egg-info shared producer worker simulator budgetq

# Then the code (see .dockerignore for what stays out).
COPY . .
RUN pip install --no-deps . \
 && rm -rf build ./*.egg-info \
 && mkdir -p /out \
 && chown budgetq:budgetq /out

USER budgetq
# Workers stop taking jobs on SIGTERM and finish what is in flight (worker.grace_s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["budgetq"]
CMD ["--help"]
