# The image of the opsd controller and agent (helm/opsd runs it): the project without torch, which only the
# training ranks need (the `trainer` extra). Build from the repository root:
#   docker build -t REGISTRY/opsd:0.1.0 .
FROM python:3.11.7-slim-bookworm

# The root filesystem is read-only in the chart, where /tmp is an emptyDir.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib

WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY opsd ./opsd
COPY opsd_agent ./opsd_agent
COPY trainer_hooks ./trainer_hooks
# The same pins as `make` (constraints.txt); the agent's and the controller's extras, not the trainer's (torch).
RUN pip install --no-cache-dir -c constraints.txt ".[agent,controller]" \
    && rm -rf /src \
    && groupadd --system --gid 10001 opsd \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin opsd \
    && install -d -o 10001 -g 10001 /var/lib/opsd

WORKDIR /var/lib/opsd
# Numeric, so that Kubernetes can verify runAsNonRoot.
USER 10001:10001
EXPOSE 8470 9464
ENTRYPOINT ["opsd"]
CMD ["--help"]
