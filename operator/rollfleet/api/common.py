"""Building blocks shared by every Rollfleet custom resource: the model base, the
Kubernetes condition, int-or-string types, CEL rules and the default images. The API
group, labels and annotations live in `rollfleet.contract`.

Pure: no I/O. `crdgen` turns models built from these into CRD schemas; the operator,
the gateway and the sync sidecar parse objects with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

from rollfleet.contract import GROUP, VERSION


def _image_tag() -> str:
    try:
        return metadata.version("rollfleet")
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        return "latest"


IMAGE_TAG = _image_tag()
# Every image the product ships (built by `make images`, hack/images.sh): manifests, samples,
# the workflow and the tests name these and no others.
DEFAULT_ENGINE_IMAGE = f"rollfleet/engine-cpu:{IMAGE_TAG}"
ENGINE_CUDA_IMAGE = f"rollfleet/engine-cuda:{IMAGE_TAG}"
DEFAULT_ROLLFLEET_IMAGE = f"rollfleet/rollfleet:{IMAGE_TAG}"
SHIPPED_IMAGES = (DEFAULT_ROLLFLEET_IMAGE, DEFAULT_ENGINE_IMAGE, ENGINE_CUDA_IMAGE)
# The control-plane image's user (Dockerfile: USER 65532:65532); pods running it as this user
# read their mounted Secrets through fsGroup.
ROLLFLEET_IMAGE_UID = 65532


class ApiModel(BaseModel):
    """Base of every schema model: camelCase on the wire, snake_case in Python.

    Unknown fields are ignored rather than refused: the API server already prunes
    what the schema does not declare, and a newer CRD must not break an older reader.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        extra="ignore",
        use_attribute_docstrings=False,
    )

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it (aliases, no unset optional fields)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def cel(
    rule: str,
    message: str | None = None,
    *,
    message_expression: str | None = None,
    field_path: str | None = None,
    reason: str | None = None,
    optional_old_self: bool = False,
) -> dict[str, str | bool]:
    """One `x-kubernetes-validations` entry; the message is what a person reads on refusal. `optional_old_self`: the
    rule runs on create too, with `oldSelf` unset (a rule naming `oldSelf` otherwise runs on updates only)."""
    entry: dict[str, str | bool] = {"rule": rule}
    if message is not None:
        entry["message"] = message
    if message_expression is not None:
        entry["messageExpression"] = message_expression
    if field_path is not None:
        entry["fieldPath"] = field_path
    if reason is not None:
        entry["reason"] = reason
    if optional_old_self:
        entry["optionalOldSelf"] = True
    return entry


def validations(*rules: dict[str, str | bool]) -> dict[str, Any]:
    """`json_schema_extra` for a model or field carrying CEL rules."""
    return {"x-kubernetes-validations": list(rules)}


# An integer or a string: the Kubernetes int-or-string pattern (quantities, percentages).
_INT_OR_STRING_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
}
IntOrString = Annotated[int | str, WithJsonSchema(_INT_OR_STRING_SCHEMA)]
# Validated by pattern and minimum (each applies to one of the two types), not CEL: CEL
# on an int-or-string value has no size bound and exceeds the API server's cost budget.
IntOrPercent = Annotated[
    int | str,
    WithJsonSchema({**_INT_OR_STRING_SCHEMA, "minimum": 0, "pattern": r"^(100|[1-9]?[0-9])%$"}),
]
# Free-form Kubernetes objects (affinity, valueFrom): kept as written, validated by the API server where used.
FreeForm = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]

ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(ApiModel):
    """The standard Kubernetes condition (metav1.Condition)."""

    type: str = Field(
        description="Kind of condition, for example Ready, Progressing, Degraded, Paused.", max_length=316
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        default="", max_length=1024, description="One CamelCase word saying why the condition has its status."
    )
    message: str = Field(default="", max_length=32768, description="What a person should know, in a sentence.")
    last_transition_time: datetime | None = Field(
        default=None, description="When the status last changed (not reason or message)."
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="The .metadata.generation the condition was computed for."
    )


class ResourceRequirements(ApiModel):
    """Compute resources of a container, as in a Pod (`cpu`, `memory`, ...)."""

    requests: dict[str, IntOrString] | None = Field(default=None, description="Minimum resources to schedule on.")
    limits: dict[str, IntOrString] | None = Field(default=None, description="Maximum resources the container may use.")


class EnvVar(ApiModel):
    """An environment variable of a container, as in a Pod."""

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256, description="Variable name.")
    value: str | None = Field(default=None, max_length=32768, description="Literal value.")
    value_from: FreeForm | None = Field(
        default=None, description="A source for the value (fieldRef, secretKeyRef, ...), as in a Pod's env."
    )


@dataclass(frozen=True)
class PrinterColumn:
    """An `additionalPrinterColumns` entry: what `kubectl get` shows."""

    name: str
    type: Literal["string", "integer", "number", "boolean", "date"]
    json_path: str
    description: str
    priority: int = 0  # 0: always shown; 1: only with -o wide


@dataclass(frozen=True)
class CrdInfo:
    """Everything about a custom resource that is not its spec and status schema."""

    kind: str
    plural: str
    short_names: tuple[str, ...]
    description: str
    spec_model: type[BaseModel]
    status_model: type[BaseModel]
    printer_columns: tuple[PrinterColumn, ...] = ()
    # Scale subresource from .spec.replicas, .status.replicas and .status.selector.
    scalable: bool = False
    # CEL rules on the whole object (the only place that can check metadata.name).
    root_validations: tuple[dict[str, str | bool], ...] = ()
    categories: tuple[str, ...] = ("rollfleet",)
    group: str = GROUP
    version: str = VERSION

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def name(self) -> str:
        return f"{self.plural}.{self.group}"
