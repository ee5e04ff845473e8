#!/usr/bin/env bash
# Advertise N nvidia.com/gpu on every node of the kind `gpu` pool (extended resource
# in node status, as the Kubernetes docs describe for devices without a plugin).
set -euo pipefail
count="${1:-8}"
for node in $(kubectl get nodes -l rollfleet.dev/pool=gpu -o name); do
  kubectl patch "$node" --subresource=status --type=json \
    -p "[{\"op\":\"add\",\"path\":\"/status/capacity/nvidia.com~1gpu\",\"value\":\"$count\"}]"
  echo "$node: nvidia.com/gpu=$count"
done
