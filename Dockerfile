# rlaunch as images, built FROM scratch: no base image is pulled. `docker/build.sh` stages the
# binaries with the shared libraries they load into docker/rootfs-*/ first; the build context
# is docker/ (`docker build -f Dockerfile --target rendezvous docker`).
#
#   docker/build.sh                      # release binaries, images rlaunch-rendezvous and rlaunch
#   docker run -p 29400:29400 rlaunch-rendezvous --store etcd --etcd-endpoints http://etcd:2379
#
# Several replicas of the rendezvous on one etcd serve the same jobs: run two or more behind
# the agents' `--rdzv-endpoint a:29400,b:29400` and none of them is a single point of failure.

FROM scratch AS rendezvous
COPY rootfs-rendezvous/ /
USER 65534:65534
EXPOSE 29400
ENV RLAUNCH_RDZV_LISTEN=0.0.0.0:29400
ENTRYPOINT ["/usr/local/bin/rlaunch-rendezvous"]

FROM scratch AS launcher
COPY rootfs-launcher/ /
ENTRYPOINT ["/usr/local/bin/rlaunch"]
