# The code-repository domain's image for the docker sandbox backend: git, Python and pytest.
FROM python:3.11-slim-bookworm
RUN apt-get update \
 && apt-get install -y --no-install-recommends git procps \
 && rm -rf /var/lib/apt/lists/* \
 && pip install --no-cache-dir "pytest>=8,<10"
RUN useradd --uid 1000 --create-home --shell /bin/bash agent
WORKDIR /work
CMD ["sleep", "infinity"]
