"""The base class of every model of the ``SpeculativeModel`` resource."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, WithJsonSchema
from pydantic.alias_generators import to_camel

FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
"""An object passed through to a Kubernetes core type unchanged (``env[].valueFrom``)."""


class ApiModel(BaseModel):
    """camelCase on the wire (and in the CRD), snake_case in Python; unknown fields
    rejected; attribute docstrings become the CRD's field descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )

    def to_k8s(self) -> dict[str, Any]:
        """The object as Kubernetes stores it: camelCase keys, unset optionals omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
