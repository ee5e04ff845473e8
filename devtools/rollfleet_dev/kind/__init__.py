"""kind on a machine that reaches no image registry: Rollfleet's e2e cluster in real containers.

- `tools`: the pinned programs a node needs (kind, containerd, runc, crictl, CNI plugins,
  CoreDNS, kindnetd, kubelet/kubeadm/kubectl/kube-proxy, pause), built from Go modules;
- `nodeimage`: the system images and the node image, assembled and preloaded with docker;
- `cluster`: `rollfleet kind up|down` (`make kind-up`, `make kind-down`) for the pools of
  e2e/kind/cluster.yaml, with GPUs advertised and Rollfleet's images loaded.

docs/kind.md says how this adapts to the machine (cgroup v1, no CAP_SYS_RESOURCE, no NFQUEUE).
"""
