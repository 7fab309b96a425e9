#!/usr/bin/env bash
# Set the number of prefill or decode containers of the compose deployment (deploy/docker-compose.yml).
#   scripts/scale.sh {prefill|decode} N
# Existing containers of the stage are kept (--no-recreate); only the difference starts or stops, and
# new workers register with the router on their own. Uses `docker compose`, else `docker-compose`.
set -euo pipefail

usage_text() {
    echo "usage: $(basename -- "$0") {prefill|decode} N"
    echo "  N: number of containers (a whole number; at least 1 for decode, 0 allowed for prefill)"
}
usage() {
    usage_text >&2
    exit 2
}

case "${1:-}" in
    -h | --help) usage_text; exit 0 ;;
esac
[ "$#" -eq 2 ] || usage
stage=$1
case "$stage" in
    prefill | decode) ;;
    *) echo "scale.sh: unknown stage '$stage'" >&2; usage ;;
esac
case "$2" in
    '' | *[!0-9]*) echo "scale.sh: N must be a whole number, got '$2'" >&2; usage ;;
esac
[ "${#2}" -le 4 ] || { echo "scale.sh: N too large: $2" >&2; usage; }
count=$((10#$2))  # base 10: "08" is eight, not a bad octal
if [ "$stage" = decode ] && [ "$count" -lt 1 ]; then
    echo "scale.sh: decode needs at least 1 container (requests are decoded there)" >&2
    usage
fi

# The compose file paths below are relative to the repository root.
cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.."
files=(-f deploy/docker-compose.yml)
# New replicas must get the same settings as the running ones, override included.
if [ -f deploy/docker-compose.override.yml ]; then
    files+=(-f deploy/docker-compose.override.yml)
fi

if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    compose=(docker-compose)
else
    echo "scale.sh: neither 'docker compose' nor 'docker-compose' found" >&2
    exit 1
fi

exec "${compose[@]}" "${files[@]}" up -d --no-recreate --scale "$stage=$count" "$stage"
