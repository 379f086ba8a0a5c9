"""The pack's GPU guardrails, each alone on hand-made resources: GPU nodes tainted (Karpenter
NodePools and managed node groups), which NodePools can launch GPU nodes at all, GPU pods
refused by admission unless they tolerate and limit, and the GPU ceiling over NodePools' GPU
limits, node groups and instances. tests/test_guardrails.py runs them over the program."""

from __future__ import annotations

import pytest
from guardrails_harness import NODE_POOL, check_resource, check_stack, guard, policy_resource
from pulumi_policy import PolicyResource
from pulumi_policy.proxy import unknown_checking_proxy

NG = "aws:eks/nodeGroup:NodeGroup"
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}


def test_gpu_node_groups_tainted() -> None:
    policy = guard.gpu_node_groups_tainted
    assert check_resource(policy, NG, {"instanceTypes": ["m6i.large"], "amiType": "AL2023_x86_64_STANDARD"}) == []
    assert check_resource(policy, NG, {"instanceTypes": ["g5.xlarge"], "taints": [TAINT]}) == []
    (message,) = check_resource(
        policy,
        NG,
        {
            "nodeGroupName": "gpu",
            "amiType": "AL2023_x86_64_NVIDIA",
            "taints": [{**TAINT, "effect": "PREFER_NO_SCHEDULE"}],
        },
    )
    assert "GPU node group gpu must carry the taint nvidia.com/gpu=present:NO_SCHEDULE" in message
    assert "got nvidia.com/gpu=present:PREFER_NO_SCHEDULE" in message


def _node_pool(requirements: list[dict], taints: list[dict] | None = None, limits: dict | None = None, **spec) -> dict:
    """A karpenter.sh/v1 NodePool's props, as the program applies one (tests/test_karpenter.py
    checks the program's against the CRD schema)."""
    template = {"nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu"}}
    template |= {"requirements": requirements, "taints": taints or [], **spec}
    return {
        "apiVersion": "karpenter.sh/v1",
        "kind": "NodePool",
        "metadata": {"name": "gpu"},
        "spec": {"template": {"spec": template}, "limits": limits or {}},
    }


POOL_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
MODEL_TAINT = {"key": "fleet.io/model-node", "value": "true", "effect": "NoSchedule"}


def _types(*types: str) -> dict:
    return {"key": "node.kubernetes.io/instance-type", "operator": "In", "values": list(types)}


def test_gpu_node_pools_tainted() -> None:
    policy = guard.gpu_node_groups_tainted
    assert check_resource(policy, NODE_POOL, _node_pool([_types("g5.xlarge")], [POOL_TAINT, MODEL_TAINT])) == []
    assert check_resource(policy, NODE_POOL, _node_pool([_types("m6i.large")], [MODEL_TAINT])) == []  # CPU only
    (message,) = check_resource(policy, NODE_POOL, _node_pool([_types("g5.xlarge", "g5.2xlarge")], [MODEL_TAINT]))
    assert message.startswith(
        "GPU NodePool gpu must carry the taint nvidia.com/gpu=present:NoSchedule in spec.template.spec.taints "
        "(got fleet.io/model-node=true:NoSchedule)"
    )
    # a startup taint is lifted once the node is up: it keeps nothing off
    assert check_resource(policy, NODE_POOL, _node_pool([_types("p4d.24xlarge")], startupTaints=[POOL_TAINT]))
    assert check_resource(
        policy, NODE_POOL, _node_pool([_types("g5.xlarge")], [{**POOL_TAINT, "effect": "PreferNoSchedule"}])
    )
    # a GPU limit alone does not make a CPU pool a GPU pool, nor taint a GPU one
    assert check_resource(policy, NODE_POOL, _node_pool([_types("m6i.large")], limits={"nvidia.com/gpu": "8"})) == []
    assert check_resource(policy, NODE_POOL, _node_pool([], limits={"nvidia.com/gpu": "8"}))


@pytest.mark.parametrize(
    ("requirements", "limits", "gpus"),
    [
        ([], {}, True),  # no requirements: Karpenter may pick any type a pod asks for
        ([_types("m6i.large", "c7i.xlarge")], {}, False),
        ([_types("m6i.large", "g6.xlarge")], {}, True),
        ([_types("p9.96xlarge")], {}, True),  # a GPU family the pack does not know still counts as GPU
        ([_types("g5.xlarge")], {"nvidia.com/gpu": "0"}, False),  # no GPU node fits a limit of 0
        ([{"key": "karpenter.k8s.aws/instance-family", "operator": "In", "values": ["m7i", "r7i"]}], {}, False),
        ([{"key": "karpenter.k8s.aws/instance-family", "operator": "In", "values": ["m7i", "gr6"]}], {}, True),
        ([{"key": "karpenter.k8s.aws/instance-category", "operator": "In", "values": ["c", "m", "r"]}], {}, False),
        ([{"key": "karpenter.k8s.aws/instance-category", "operator": "In", "values": ["m", "g"]}], {}, True),
        ([{"key": "karpenter.k8s.aws/instance-category", "operator": "NotIn", "values": ["g", "p"]}], {}, False),
        ([{"key": "karpenter.k8s.aws/instance-category", "operator": "NotIn", "values": ["g"]}], {}, True),
        ([{"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "DoesNotExist"}], {}, False),
        ([{"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "Gt", "values": ["0"]}], {}, True),
        ([{"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "Lt", "values": ["1"]}], {}, False),
        ([{"key": "karpenter.k8s.aws/instance-gpu-manufacturer", "operator": "In", "values": ["nvidia"]}], {}, True),
        ([{"key": "karpenter.k8s.aws/instance-gpu-manufacturer", "operator": "DoesNotExist"}], {}, False),
        ([{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}], {}, True),
        ([{"key": "node.kubernetes.io/instance-type", "operator": "NotIn", "values": ["p5.48xlarge"]}], {}, True),
    ],
)
def test_which_node_pools_can_launch_gpu_nodes(requirements: list[dict], limits: dict, gpus: bool) -> None:
    from fleet_guardrails.karpenter import launches_gpus

    assert launches_gpus(unknown_checking_proxy(_node_pool(requirements, limits=limits))) is gpus


def test_resource_quantities() -> None:
    from decimal import Decimal

    from fleet_guardrails.karpenter import quantity

    assert [quantity(v) for v in ("16", 16, 16.0, "1500m", "2k", "1Ki", "1e3")] == [
        Decimal(16),
        Decimal(16),
        Decimal(16),
        Decimal("1.5"),
        Decimal(2000),
        Decimal(1024),
        Decimal(1000),
    ]
    assert quantity("lots") is None and quantity(True) is None and quantity("16 GPUs") is None


def test_gpu_pods_admission() -> None:
    from infra.admission import NAME, gpu_pod_policy

    policy, deploy = guard.gpu_pods_admission, "kubernetes:apps/v1:Deployment"
    spec, binding = gpu_pod_policy()
    vap = policy_resource(
        "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicy",
        "p",
        {"metadata": {"name": NAME}, "spec": spec},
    )
    bound = policy_resource(
        "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicyBinding",
        "b",
        {"metadata": {"name": NAME}, "spec": binding},
    )
    assert check_stack(policy, [vap, bound]) == []
    (missing,) = check_stack(policy, [vap])
    assert "no ValidatingAdmissionPolicy bound with Deny" in missing
    warn_only = policy_resource(bound.resource_type, "b", {"spec": {**binding, "validationActions": ["Warn", "Audit"]}})
    assert check_stack(policy, [vap, warn_only])
    toothless = policy_resource(
        vap.resource_type, "p", {"metadata": {"name": NAME}, "spec": {**spec, "validations": []}}
    )  # no rule
    assert check_stack(policy, [toothless, bound])

    def workload(resources: dict, tolerations: list) -> PolicyResource:
        return policy_resource(
            deploy,
            "w",
            {
                "metadata": {"name": "w"},
                "spec": {
                    "template": {
                        "spec": {"containers": [{"name": "c", "resources": resources}], "tolerations": tolerations}
                    }
                },
            },
        )

    exists = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert check_stack(policy, [vap, bound, workload({"limits": {"cpu": "1"}}, [])]) == []  # no GPUs, no demands
    assert check_stack(policy, [vap, bound, workload({"limits": {"nvidia.com/gpu": "2"}}, exists)]) == []
    assert (
        check_stack(policy, [vap, bound, workload({"limits": {"nvidia.com/gpu": 1}}, [{"operator": "Exists"}])]) == []
    )
    (no_limit,) = check_stack(policy, [vap, bound, workload({"requests": {"nvidia.com/gpu": "1"}}, exists)])
    assert "Deployment w: container c requests nvidia.com/gpu without a limit" in no_limit
    (unequal,) = check_stack(
        policy, [vap, bound, workload({"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "2"}}, exists)]
    )
    assert "requests 1 GPUs but limits 2" in unequal
    wrong_value = [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}]
    (untolerated,) = check_stack(policy, [vap, bound, workload({"limits": {"nvidia.com/gpu": "1"}}, wrong_value)])
    assert "does not tolerate the nvidia.com/gpu:NoSchedule taint" in untolerated


def test_the_admission_policys_cel_states_the_python_rule() -> None:
    """The CEL runs in the API server, not here; what can be checked is that each rule the
    Python check knows has its expression, over every container kind, with a message."""
    from infra import admission

    spec, binding = admission.gpu_pod_policy()
    assert spec["failurePolicy"] == "Fail" and binding["validationActions"] == ["Deny"]
    assert "initContainers" in admission.CONTAINERS
    (condition,) = spec["matchConditions"]  # only pods that ask for GPUs are evaluated
    assert "variables." not in condition["expression"] and "nvidia.com/gpu" in condition["expression"]
    assert "limits" in condition["expression"] and "requests" in condition["expression"]
    (rule,) = spec["validations"]
    assert (
        "tolerations" in rule["expression"] and "'present'" in rule["expression"] and "NoSchedule" in rule["expression"]
    )
    assert rule["message"]


def test_gpu_ceiling() -> None:
    groups = [
        policy_resource(
            NG, "a", {"instanceTypes": ["g5.12xlarge"], "scalingConfig": {"maxSize": 2.0}, "taints": [TAINT]}
        ),
        policy_resource(NG, "cpu", {"instanceTypes": ["m6i.large"], "scalingConfig": {"maxSize": 50}}),
        policy_resource("aws:ec2/instance:Instance", "box", {"instanceType": "p4d.24xlarge"}),
    ]
    assert check_stack(guard.gpu_ceiling, groups, {"maxGpus": 16}) == []  # 2 × 4 + 8; CPU nodes do not count
    (over,) = check_stack(guard.gpu_ceiling, groups, {"maxGpus": 15})
    assert "can scale to 16 GPUs (a 2 × 4; box 1 × 8); its ceiling maxGpus is 15" in over


def _pool(name: str, requirements: list[dict], limits: dict) -> PolicyResource:
    props = _node_pool(requirements, [POOL_TAINT], limits)
    props["metadata"]["name"] = name
    return policy_resource(NODE_POOL, f"stack-karpenter-{name}", props)


def test_gpu_ceiling_counts_node_pools() -> None:
    pools = [
        _pool("big", [_types("g5.12xlarge")], {"nvidia.com/gpu": "4", "nodes": "2"}),  # 4 < 2 × 4: the limit
        _pool("a100", [_types("p4d.24xlarge")], {"nvidia.com/gpu": "64", "nodes": "2"}),  # 2 × 8 < 64: the nodes
        _pool("any", [], {"nvidia.com/gpu": 3}),  # any type: its GPU limit bounds it
        _pool("cpu", [_types("m6i.large")], {"cpu": "100", "nodes": "50"}),  # no GPUs: not counted
        policy_resource(
            NG, "a", {"instanceTypes": ["g5.xlarge"], "scalingConfig": {"maxSize": 1.0}, "taints": [TAINT]}
        ),
    ]
    assert check_stack(guard.gpu_ceiling, pools, {"maxGpus": 24}) == []  # 4 + 16 + 3 + 1
    (over,) = check_stack(guard.gpu_ceiling, pools, {"maxGpus": 23})
    assert over == (
        "this stack can scale to 24 GPUs (NodePool a100 2 × 8 by its node limit; NodePool any 3 by its "
        "nvidia.com/gpu limit; NodePool big 4 by its nvidia.com/gpu limit; a 1 × 1); its ceiling maxGpus is 23"
    )
    (unbounded,) = check_stack(guard.gpu_ceiling, [_pool("g", [_types("g5.xlarge")], {"nodes": "4"})], {"maxGpus": 99})
    assert unbounded.startswith("NodePool g can launch GPU nodes but has no spec.limits['nvidia.com/gpu']")
    assert "maxGpus 99" in unbounded
    (unknown,) = check_stack(guard.gpu_ceiling, [_pool("new", [_types("p9.96xlarge")], {})], {"maxGpus": 99})
    assert "cannot count the GPUs of instance type(s) p9.96xlarge" in unknown
    assert (
        check_stack(guard.gpu_ceiling, [_pool("new", [_types("p9.96xlarge")], {"nvidia.com/gpu": "8"})], {"maxGpus": 8})
        == []
    )
    (garbled,) = check_stack(
        guard.gpu_ceiling, [_pool("g", [_types("g5.xlarge")], {"nvidia.com/gpu": "lots"})], {"maxGpus": 9}
    )
    assert "NodePool g: spec.limits['nvidia.com/gpu'] is 'lots'; expected a whole number of GPUs" in garbled
