#!/usr/bin/env sh
# Generates the Go stubs of proto/rollout/v1/rollout.proto into OUT/rolloutv1 (default:
# next to this script). Needs protoc, protoc-gen-go and protoc-gen-go-grpc on PATH.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
mkdir -p "$out"
protoc -I "$here/../../proto" \
  --go_out="$out" --go_opt=module=rolloutclient \
  --go-grpc_out="$out" --go-grpc_opt=module=rolloutclient \
  "$here/../../proto/rollout/v1/rollout.proto"
