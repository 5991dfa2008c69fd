# One image for every radixserve service. Minimal until the Kubernetes issue adds the
# CUDA base, the service entrypoints and the flashinfer wheel.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY services ./services
COPY operator ./operator
COPY proto ./proto
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir .
ENTRYPOINT ["python", "-m"]
