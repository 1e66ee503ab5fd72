#!/bin/sh
# System packages the tests need that pip cannot provide: the Prometheus server (Debian package
# `prometheus`, which also ships `promtool`) and kubectl (`kubernetes-client`, for `kubectl kustomize`
# of k8s/). Idempotent: installs only what is missing from PATH.
# Used by `make test` (tests/e2e/test_serve_e2e.py starts its own Prometheus on 127.0.0.1).
set -eu
PKGS=""
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    PKGS="prometheus"
fi
if ! command -v kubectl >/dev/null 2>&1 && ! command -v kustomize >/dev/null 2>&1; then
    PKGS="$PKGS kubernetes-client"
fi
if [ -z "$PKGS" ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $PKGS
# Debian starts the packaged service on :9090 where systemd runs; the tests never use it.
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1
command -v kubectl >/dev/null 2>&1 || command -v kustomize >/dev/null 2>&1
