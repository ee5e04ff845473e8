# The images a kind node runs besides Rollfleet's own (rollfleet_dev.kind.nodeimage builds each
# stage with --target and tags it as kubeadm and kind's manifests name it): the control plane,
# kube-proxy, etcd, CoreDNS, pause, kindnetd and kube-router, from binaries built from Go modules
# (and one C file for pause). Upstream ships them on distroless (kube-router on Alpine); here the
# base is Debian, the one base image this machine can make. The context is assembled by nodeimage; it is not this directory.
ARG DEBIAN_IMAGE=debian:bookworm-slim
FROM ${DEBIAN_IMAGE} AS debian

# iptables in the backend the node uses (iptables-wrapper picks it at first use).
FROM debian AS iptables
COPY iptables-wrapper /usr/sbin/iptables-wrapper
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends iptables nftables conntrack ipset \
 && rm -rf /var/lib/apt/lists/* \
 && chmod 755 /usr/sbin/iptables-wrapper \
 && for n in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do \
      ln -sf /usr/sbin/iptables-wrapper /usr/sbin/$n; done

FROM debian AS kube-apiserver
COPY bin/kube-apiserver /usr/local/bin/

FROM debian AS kube-controller-manager
COPY bin/kube-controller-manager /usr/local/bin/

FROM debian AS kube-scheduler
COPY bin/kube-scheduler /usr/local/bin/

FROM iptables AS kube-proxy
COPY bin/kube-proxy /usr/local/bin/

FROM debian AS etcd
COPY bin/etcd /usr/local/bin/

FROM debian AS coredns
COPY bin/coredns /coredns
ENTRYPOINT ["/coredns"]

FROM scratch AS pause
COPY bin/pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]

FROM iptables AS kindnetd
COPY bin/kindnetd /bin/kindnetd
CMD ["/bin/kindnetd"]

# The NetworkPolicy enforcer: kube-router (github.com/cloudnativelabs/kube-router/v2) running its
# firewall only, beside kindnetd (devtools/kind/kube-router.yaml). It drives iptables, iptables-save,
# iptables-restore and ipset by name: the iptables stage gives all four, in the node's backend.
FROM iptables AS kube-router
COPY bin/kube-router /usr/local/bin/kube-router
ENTRYPOINT ["/usr/local/bin/kube-router"]
