"""The NetworkPolicy agent's decisions: which sources and ports a node admits to its policed pods."""

from __future__ import annotations

from typing import Any

from rollfleet_dev.kind.netpol_agent import CHAIN, render, restore_input, selects


def pod(name: str, ip: str, labels: dict[str, str], ns: str = "ml", node: str = "n1", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"nodeName": node, **spec},
        "status": {"podIP": ip, "phase": "Running"},
    }


NAMESPACES = {
    "ml": {"metadata": {"name": "ml", "labels": {"kubernetes.io/metadata.name": "ml"}}},
    "ops": {"metadata": {"name": "ops", "labels": {"kubernetes.io/metadata.name": "ops"}}},
}
ENGINE = pod(
    "engine-0",
    "10.0.1.5",
    {"component": "engine"},
    containers=[{"name": "vllm", "ports": [{"name": "http", "containerPort": 8000}]}],
)
GATEWAY = pod("gw", "10.0.2.7", {"component": "gateway"}, node="n2")
OPERATOR = pod("op", "10.0.3.9", {"component": "operator"}, ns="ops", node="n2")
OTHER = pod("curl", "10.0.1.6", {"app": "curl"})
POLICY = {
    "metadata": {"name": "engine", "namespace": "ml"},
    "spec": {
        "podSelector": {"matchLabels": {"component": "engine"}},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [
                    {"podSelector": {"matchLabels": {"component": "gateway"}}},
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                        "podSelector": {"matchLabels": {"component": "operator"}},
                    },
                ],
                "ports": [{"protocol": "TCP", "port": 8000}],
            }
        ],
    },
}
PODS = [ENGINE, GATEWAY, OPERATOR, OTHER]


def test_selectors_follow_label_selector_semantics() -> None:
    assert selects({}, {"a": "1"}) and selects(None, {})
    assert selects({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}) and not selects({"matchLabels": {"a": "1"}}, {})
    expr = {
        "matchExpressions": [
            {"key": "a", "operator": "In", "values": ["1", "2"]},
            {"key": "b", "operator": "DoesNotExist"},
        ]
    }
    assert selects(expr, {"a": "2"}) and not selects(expr, {"a": "2", "b": "x"}) and not selects(expr, {"a": "3"})


def test_a_policed_pod_admits_its_peers_on_its_port_and_rejects_the_rest() -> None:
    rules = render("n1", PODS, NAMESPACES, [POLICY])
    assert rules[0] == "-m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"
    admits = [r for r in rules if r.endswith("-j RETURN") and "10.0.1.5/32" in r]
    assert [r.split()[3] for r in admits] == ["10.0.2.7/32", "10.0.3.9/32"]  # gateway, then the operator
    assert all("-p tcp -m tcp --dport 8000" in r for r in admits)
    assert rules[-2:] == [
        '-d 10.0.1.5/32 -p tcp -m comment --comment "ml/engine-0" -j REJECT --reject-with tcp-reset',
        '-d 10.0.1.5/32 -m comment --comment "ml/engine-0" -j REJECT',
    ]
    # The operator's pod selector alone (no namespace selector) would look in the policy's namespace only.
    local_only = {
        **POLICY,
        "spec": {
            **POLICY["spec"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"component": "operator"}}}]}],
        },
    }
    assert not [r for r in render("n1", PODS, NAMESPACES, [local_only]) if "10.0.3.9" in r]


def test_unpoliced_pods_and_other_nodes_get_no_rules() -> None:
    assert render("n2", PODS, NAMESPACES, [POLICY]) == ["-m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"]
    assert render("n1", PODS, NAMESPACES, []) == ["-m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"]


def test_empty_ingress_denies_all_and_an_empty_rule_admits_all() -> None:
    deny = {"metadata": {"name": "deny", "namespace": "ml"}, "spec": {"podSelector": {}}}
    rules = render("n1", PODS, NAMESPACES, [deny])
    assert not [r for r in rules if r.endswith("RETURN") and "-d" in r]
    assert sum("REJECT" in r for r in rules) == 4  # two rules for each of the node's two pods
    allow_all = {"metadata": {"name": "all", "namespace": "ml"}, "spec": {"podSelector": {}, "ingress": [{}]}}
    assert '-d 10.0.1.5/32 -m comment --comment "ml/engine-0" -j RETURN' in render("n1", PODS, NAMESPACES, [allow_all])


def test_named_ports_resolve_per_pod_and_ip_blocks_with_except_admit_nothing() -> None:
    named = {
        "metadata": {"name": "n", "namespace": "ml"},
        "spec": {
            "podSelector": {"matchLabels": {"component": "engine"}},
            "ingress": [
                {
                    "from": [
                        {"ipBlock": {"cidr": "192.168.0.0/16"}},
                        {"ipBlock": {"cidr": "10.9.0.0/16", "except": ["10.9.1.0/24"]}},
                    ],
                    "ports": [{"port": "http"}, {"port": "metrics"}],
                }
            ],
        },
    }
    admits = [r for r in render("n1", PODS, NAMESPACES, [named]) if r.endswith("RETURN") and "-d" in r]
    assert admits == [
        '-d 10.0.1.5/32 -s 192.168.0.0/16 -p tcp -m tcp --dport 8000 -m comment --comment "ml/engine-0" -j RETURN'
    ]


def test_restore_input_replaces_the_chain_whole() -> None:
    text = restore_input(["-j RETURN"])
    assert text == f"*filter\n:{CHAIN} - [0:0]\n-A {CHAIN} -j RETURN\nCOMMIT\n"
