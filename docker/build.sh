#!/usr/bin/env bash
# Builds the rlaunch images without pulling anything: stages each binary, the shared libraries
# `ldd` says it loads, and a minimal /etc into docker/rootfs-*/, then `docker build`s the
# root Dockerfile's targets from scratch (build context docker/).
#
# usage: docker/build.sh [--profile release|debug] [--tag-prefix PREFIX]
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
prefix=""
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --tag-prefix) prefix=$2; shift 2 ;;
    *) echo "usage: $0 [--profile release|debug] [--tag-prefix PREFIX]" >&2; exit 2 ;;
  esac
done
if [ "$profile" = release ]; then
  cargo build --release -p rlaunch-rendezvous -p rlaunch-launcher
  cargo build --release -p rlaunch --example train
else
  cargo build -p rlaunch-rendezvous -p rlaunch-launcher
  cargo build -p rlaunch --example train
fi

stage() { # stage ROOTFS BINARY... (paths under target/PROFILE)
  local root=$1
  shift
  rm -rf "$root"
  mkdir -p "$root/usr/local/bin" "$root/etc" "$root/tmp"
  chmod 1777 "$root/tmp"
  for bin in "$@"; do
    cp "target/$profile/$bin" "$root/usr/local/bin/"
    ldd "target/$profile/$bin" | awk '/=> \// {print $3} /^[ \t]*\// {print $1}' | while read -r lib; do
      mkdir -p "$root$(dirname "$lib")"
      cp -L "$lib" "$root$lib"
    done
  done
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n' > "$root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
  printf 'hosts: files dns\n' > "$root/etc/nsswitch.conf"
}
stage docker/rootfs-rendezvous rlaunch-rendezvous
# The launcher image carries the Rust `train` example too (deploy/kubernetes runs it).
stage docker/rootfs-launcher rlaunch examples/train

docker build -q --target rendezvous -t "${prefix}rlaunch-rendezvous" -f Dockerfile docker
docker build -q --target launcher -t "${prefix}rlaunch" -f Dockerfile docker
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^${prefix}rlaunch" || true
