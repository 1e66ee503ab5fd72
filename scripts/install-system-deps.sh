#!/bin/sh
# System packages the tests need that pip cannot provide: the Prometheus server (Debian package
# `prometheus`, which also ships `promtool`). Idempotent: does nothing when both are on PATH.
# Used by `make test` (tests/cpu/test_serve_e2e.py starts its own Prometheus on 127.0.0.1).
set -eu
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus
# Debian starts the packaged service on :9090 where systemd runs; the tests never use it.
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1
