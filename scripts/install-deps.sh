#!/usr/bin/env bash
# Installs what the test suite needs on a fresh machine, and nothing when it is already there:
# Debian packages (protoc for etcd-client, etcd for the etcd backend, iproute2 for netns hosts)
# and a Python virtualenv with PyTorch from PyPI (the interoperability peer) in .venv/.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
# protoc's well-known types (google/protobuf/*.proto), which etcd-client's protos import
[ -f /usr/include/google/protobuf/descriptor.proto ] || need_apt+=(libprotobuf-dev)
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v python3 >/dev/null || need_apt+=(python3 python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

VENV=${RLAUNCH_VENV:-.venv}
if ! "$VENV/bin/python" -c 'import torch, numpy' 2>/dev/null; then
  echo "install-deps: creating $VENV with torch from PyPI (large download, once)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch numpy matplotlib
fi
"$VENV/bin/python" -c 'import torch; print("install-deps: torch", torch.__version__)'
