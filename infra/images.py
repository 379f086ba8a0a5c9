"""ImageRegistry: one ECR repository per model family, one for the gateway and one for the
flows (Dockerfile.flows: the gateway image plus torch and prefect-kubernetes, run by the
Prefect worker as flow-run Jobs).

Tags are immutable, so a version tag always names the image that was tested; every push is
scanned for vulnerabilities; untagged images (superseded build layers) expire after a week.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

GATEWAY_REPOSITORY = "gateway"
FLOWS_REPOSITORY = "flows"
UNTAGGED_DAYS = 7

LIFECYCLE = json.dumps(
    {
        "rules": [
            {
                "rulePriority": 1,
                "description": f"expire untagged images after {UNTAGGED_DAYS} days",
                "selection": {
                    "tagStatus": "untagged",
                    "countType": "sinceImagePushed",
                    "countUnit": "days",
                    "countNumber": UNTAGGED_DAYS,
                },
                "action": {"type": "expire"},
            }
        ],
    }
)


@dataclass
class ImageRegistryArgs:
    prefix: str  # repository names are <prefix>/<family>
    families: tuple[str, ...]
    tags: dict[str, str]


class ImageRegistry(pulumi.ComponentResource):
    urls: dict[str, pulumi.Output[str]]  # family (or "gateway", "flows") → repository URL

    def __init__(self, name: str, args: ImageRegistryArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:ImageRegistry", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.urls = {}
        for family in (*args.families, GATEWAY_REPOSITORY, FLOWS_REPOSITORY):
            repo = aws.ecr.Repository(
                f"{name}-{family}",
                name=f"{args.prefix}/{family}",
                image_tag_mutability="IMMUTABLE",
                image_scanning_configuration={"scan_on_push": True},
                encryption_configurations=[{"encryption_type": "AES256"}],
                tags={**args.tags, "model": family},
                opts=child,
            )
            aws.ecr.LifecyclePolicy(f"{name}-{family}", repository=repo.name, policy=LIFECYCLE, opts=child)
            self.urls[family] = repo.repository_url
        self.register_outputs({"urls": self.urls})
