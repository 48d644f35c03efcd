#!/usr/bin/env bash
# Regenerate the committed protobuf / gRPC modules from proto/ with a pinned protoc.
#
#   scripts/gen_proto.sh           write hacrl_fed/v1/worker_pb2.py, worker_pb2.pyi, worker_pb2_grpc.py
#   scripts/gen_proto.sh --check   regenerate into a temp dir and diff against the files in the tree;
#                                  exit 1 on drift, 2 when the generator venv cannot be built
#
# Why a separate venv: grpcio-tools==1.70.0 emits gencode for protobuf 5.29, which runs on protobuf 5.29 .. 6.x.
# Newer grpcio-tools emit gencode that needs protobuf 7, which flwr 1.42 cannot use. The venv lives in
# .cache/protoc-venv (git-ignored; override with HACRL_PROTOC_VENV) and is reused while it holds the pinned version.
set -euo pipefail

TOOLS_VERSION="1.70.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HACRL_PROTOC_VENV:-$ROOT/.cache/protoc-venv}"
PYTHON="${PYTHON:-python3}"
PROTO_DIR="$ROOT/proto"
PROTOS=("hacrl_fed/v1/worker.proto")
GENERATED=("hacrl_fed/v1/worker_pb2.py" "hacrl_fed/v1/worker_pb2.pyi" "hacrl_fed/v1/worker_pb2_grpc.py")

die() { echo "gen_proto: $1" >&2; exit "${2:-1}"; }

venv_ok() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$TOOLS_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata, sys
sys.exit(importlib.metadata.version("grpcio-tools") != sys.argv[1])
EOF
}

ensure_venv() {
  venv_ok && return 0
  local tmp="$VENV.building.$$"
  rm -rf "$tmp"
  mkdir -p "$(dirname "$VENV")"
  echo "gen_proto: building $VENV with grpcio-tools==$TOOLS_VERSION" >&2
  "$PYTHON" -m venv "$tmp" || die "cannot create a venv with $PYTHON" 2
  if ! "$tmp/bin/python" -m pip install --quiet --disable-pip-version-check "grpcio-tools==$TOOLS_VERSION" >&2; then
    rm -rf "$tmp"
    die "pip could not install grpcio-tools==$TOOLS_VERSION (needs the package index)" 2
  fi
  rm -rf "$VENV"
  mv "$tmp" "$VENV"
  venv_ok || die "$VENV does not hold grpcio-tools==$TOOLS_VERSION after install" 2
}

generate_into() {  # $1: output root; files land in $1/hacrl_fed/v1/
  local out="$1"
  (cd "$PROTO_DIR" && "$VENV/bin/python" -m grpc_tools.protoc -I . \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "${PROTOS[@]}")
}

main() {
  local mode="${1:-write}"
  case "$mode" in
    write|--check) ;;
    *) die "usage: $0 [--check]" 2 ;;
  esac
  ensure_venv
  if [ "$mode" = "write" ]; then
    generate_into "$ROOT"
    echo "gen_proto: wrote ${GENERATED[*]}"
    return 0
  fi
  CHECK_DIR="$(mktemp -d)"
  trap 'rm -rf "$CHECK_DIR"' EXIT
  local tmp="$CHECK_DIR"
  generate_into "$tmp"
  local drift=0 f
  for f in "${GENERATED[@]}"; do
    if [ ! -f "$ROOT/$f" ]; then
      echo "gen_proto: missing $f (run scripts/gen_proto.sh)" >&2
      drift=1
    elif ! diff -u "$ROOT/$f" "$tmp/$f" >&2; then
      drift=1
    fi
  done
  [ "$drift" -eq 0 ] || die "generated code is out of date with proto/ (run scripts/gen_proto.sh and commit)" 1
  echo "gen_proto: generated code matches proto/"
}

main "$@"
