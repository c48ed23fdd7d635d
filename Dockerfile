# One image for producer, worker, simulator and CLI.
FROM python:3.11-slim
RUN useradd --create-home --uid 1000 budgetq
WORKDIR /app
# Dependencies first so code edits do not reinstall them.
COPY pyproject.toml README.md ./
RUN mkdir -p shared producer worker simulator budgetq && pip install --no-cache-dir . && pip uninstall -y budgetq
COPY . .
RUN pip install --no-cache-dir --no-deps . && mkdir -p /out && chown budgetq /out
USER budgetq
ENTRYPOINT ["budgetq"]
