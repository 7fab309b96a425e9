#!/usr/bin/env bash
# Set the number of prefill or decode workers, or of routers, of the compose deployment
# (deploy/docker-compose.yml, the default) or of the Kubernetes one (deploy/k8s):
#   scripts/scale.sh [--compose] {prefill|decode|router} N
#   scripts/scale.sh --k8s [-n NAMESPACE] {prefill|decode|router} N
# Compose: existing containers of the stage are kept (--no-recreate); only the difference starts or
# stops. Uses `docker compose`, else `docker-compose`.
# Kubernetes: `kubectl scale deployment/pdserve-<stage> --replicas=N` in NAMESPACE (default pdserve;
# kubectl's current context). Removed pods drain first (their grace period covers it).
# Either way new workers register with every router on their own, and workers find new routers
# (their --router names a DNS name that resolves to every router) within seconds.
set -euo pipefail

usage_text() {
    echo "usage: $(basename -- "$0") [--compose] {prefill|decode|router} N"
    echo "       $(basename -- "$0") --k8s [-n NAMESPACE] {prefill|decode|router} N"
    echo "  N: number of workers or routers (a whole number; at least 1 for decode and router,"
    echo "     0 allowed for prefill)"
    echo "  --k8s: scale the Kubernetes Deployment pdserve-<stage> (namespace default: pdserve)"
}
usage() {
    usage_text >&2
    exit 2
}

target=compose
namespace=pdserve
while [ "$#" -gt 0 ]; do
    case "$1" in
        -h | --help) usage_text; exit 0 ;;
        --compose) target=compose; shift ;;
        --k8s | --kubernetes) target=k8s; shift ;;
        -n | --namespace)
            [ "$#" -ge 2 ] && [ -n "$2" ] || { echo "scale.sh: $1 needs a namespace" >&2; usage; }
            namespace=$2
            shift 2
            ;;
        --) shift; break ;;
        -*) echo "scale.sh: unknown option '$1'" >&2; usage ;;
        *) break ;;
    esac
done
if [ "$namespace" != pdserve ] && [ "$target" != k8s ]; then
    echo "scale.sh: --namespace goes with --k8s" >&2
    usage
fi
[ "$#" -eq 2 ] || usage
stage=$1
case "$stage" in
    prefill | decode | router) ;;
    *) echo "scale.sh: unknown stage '$stage'" >&2; usage ;;
esac
case "$2" in
    '' | *[!0-9]*) echo "scale.sh: N must be a whole number, got '$2'" >&2; usage ;;
esac
[ "${#2}" -le 4 ] || { echo "scale.sh: N too large: $2" >&2; usage; }
count=$((10#$2))  # base 10: "08" is eight, not a bad octal
if [ "$stage" = decode ] && [ "$count" -lt 1 ]; then
    echo "scale.sh: decode needs at least 1 worker (requests are decoded there)" >&2
    usage
fi
if [ "$stage" = router ] && [ "$count" -lt 1 ]; then
    echo "scale.sh: at least 1 router (it serves the API)" >&2
    usage
fi

if [ "$target" = k8s ]; then
    command -v kubectl >/dev/null 2>&1 || { echo "scale.sh: kubectl not found" >&2; exit 1; }
    # An HPA on the Deployment (deploy/k8s/autoscaling) would undo a manual scale.
    if kubectl -n "$namespace" get "hpa/pdserve-$stage" >/dev/null 2>&1; then
        echo "scale.sh: note: hpa/pdserve-$stage manages this Deployment and will rescale it;" \
            "change its minReplicas/maxReplicas instead" >&2
    fi
    if [ "$stage" = router ] && [ "$count" -lt 2 ]; then
        echo "scale.sh: note: with one router its PodDisruptionBudget (minAvailable 1) blocks" \
            "node drains, and a router restart fails every stream" >&2
    fi
    exec kubectl -n "$namespace" scale "deployment/pdserve-$stage" --replicas="$count"
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
