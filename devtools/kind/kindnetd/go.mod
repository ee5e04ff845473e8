// kind's kindnetd (sigs.k8s.io/kind images/kindnetd at kind commit 69b56db7, Apache-2.0),
// vendored because the Go proxy does not serve its module, minus its NetworkPolicy block.
module rollfleet.dev/kindnetd

go 1.26.0

require (
	github.com/coreos/go-iptables v0.8.0
	github.com/vishvananda/netlink v1.3.1
	golang.org/x/sys v0.45.0
	k8s.io/api v0.37.1
	k8s.io/apimachinery v0.37.1
	k8s.io/client-go v0.37.1
	k8s.io/klog/v2 v2.140.0
)
