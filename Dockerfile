# kvgate: one image for every role (gateway, agent, simulated replica); the command picks it.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY cachecore ./cachecore
COPY gateway ./gateway
COPY policies ./policies
COPY loadtest ./loadtest
RUN pip install --no-cache-dir .
EXPOSE 8000
ENTRYPOINT ["kvgate"]
# The gateway refuses to start without tenants: mount a key file and set
# KVGATE_API_KEYS_FILE=/path (or KVGATE_API_KEYS_REDIS with KVGATE_REDIS_URL); pass --open
# only on a trusted network, as docker-compose.yml does. Other roles: `agent`, `replica`.
CMD ["serve", "--host", "0.0.0.0"]
