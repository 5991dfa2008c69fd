# One image for every radixserve service. Minimal until the Kubernetes issue adds the
# CUDA base and the flashinfer wheel. Pods run e.g. `radixserve.scheduler --model ...`;
# setup.py generates the gRPC stubs from proto/ during `pip install .`.
FROM python:3.11-slim
WORKDIR /app
COPY setup.py pyproject.toml README.md ./
COPY services ./services
COPY operator ./operator
COPY proto ./proto
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir .
ENTRYPOINT ["python", "-m"]
