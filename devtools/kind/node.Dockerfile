# A kind node image assembled from locally built parts (rollfleet_dev.kind.nodeimage), the
# way kind v0.33.0's images/base/Dockerfile lays one out: systemd, containerd + runc, the CNI
# plugins, crictl, kubeadm/kubelet/kubectl, kind's own files. Preloaded images are added after
# this build by importing them into the node's containerd and committing (as kind does).
# The context is assembled by rollfleet_dev.kind.nodeimage; it is not this directory.
ARG DEBIAN_IMAGE=debian:bookworm-slim
FROM ${DEBIAN_IMAGE}
COPY files/usr/local/bin/ /usr/local/bin/
COPY files/kind/ /kind/
COPY files/etc/ /etc/
RUN chmod 755 /kind /kind/bin /kind/bin/* /usr/local/bin/* \
 && DEBIAN_FRONTEND=noninteractive clean-install systemd conntrack iptables nftables iproute2 ethtool \
      util-linux mount kmod libseccomp2 pigz e2fsprogs bash ca-certificates curl jq procps \
 && find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete \
 && rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
      /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
      /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/* \
 && echo "ReadKMsg=no" >> /etc/systemd/journald.conf \
 && ln -sf /usr/lib/systemd/systemd /sbin/init
COPY bin/containerd bin/ctr bin/containerd-shim-runc-v2 bin/crictl /usr/local/bin/
COPY bin/runc /usr/local/sbin/runc
COPY cni/ /opt/cni/bin/
COPY bin/kubeadm bin/kubelet bin/kubectl /usr/bin/
COPY manifests/ /kind/manifests/
COPY version /kind/version
RUN ctr oci spec \
      | jq '.hooks.createContainer[.hooks.createContainer|length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' \
      | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json \
 && systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
 && systemctl mask systemd-binfmt.service \
 && mkdir -p /etc/kubernetes/manifests \
 && containerd --version && runc --version && kubelet --version && kubeadm version -o short
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
