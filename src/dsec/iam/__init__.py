"""Identity and access management: projects, principals, API tokens and quota admission."""

from dsec.iam.store import IAM, Principal, Project, Quota, Usage

__all__ = ["IAM", "Principal", "Project", "Quota", "Usage"]
