"""The trajectory log: every sandbox operation, numbered gap-free per sandbox, persisted in durable batches.

See :mod:`dsec.trajlog.log` for the numbering, crash-detection and loss-bound guarantees.
"""

from dsec.models import Entry
from dsec.trajlog.log import TrajectoryLog
from dsec.trajlog.rows import StepTag, action_hash, canonical_json

__all__ = ["Entry", "StepTag", "TrajectoryLog", "action_hash", "canonical_json"]
