# The gateway image: `fleet gateway` as a non-root numeric user, this project installed from
# the lock. infra/gateway.py runs it with runAsUser/runAsGroup 10001, a read-only root file
# system and /tmp as an emptyDir (tests/test_gateway_image.py checks that they agree).
#
#   docker build -t <gateway repository>:<gatewayImageTag> . && docker push <gateway repository>:<gatewayImageTag>
#
# torch is not installed: the gateway never imports it (the models run in their Bentos).
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp FLEET_POLICIES=/etc/fleet/policies

RUN groupadd --system --gid 10001 fleet \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin fleet

WORKDIR /opt/serving-fleet
# the lock first, so a code change does not reinstall the dependencies
COPY requirements.lock ./
RUN python -m pip install --upgrade pip && python -m pip install -r requirements.lock
COPY pyproject.toml README.md ./
COPY fleet ./fleet
COPY bentos ./bentos
COPY flows ./flows
COPY policies ./policies
RUN python -m pip install --no-deps . && fleet --help >/dev/null

USER 10001:10001
EXPOSE 8000 8001
ENTRYPOINT ["fleet", "gateway"]
CMD ["--host", "0.0.0.0", "--port", "8000", "--grpc-port", "8001"]
