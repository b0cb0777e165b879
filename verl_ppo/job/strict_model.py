"""The one pydantic base of verl_ppo's configuration sections."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A configuration section: unknown keys are refused (pydantic names them), assignments
    are validated, and field names may start with ``model_`` (``model_config_`` below)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())
