"""RolloutRequest: a batch of rollouts (prompts x samplesPerPrompt) run on a RolloutFleet.

The pydantic models here are the one source of truth for the RolloutRequest CRD
(`crdgen` generates `crds/rolloutrequest.yaml` and `docs/crds.md` from them), and the
operator's request controller parses objects with them. CEL rules carry the messages a
person reads when the API server refuses a request. Pure: talks to nobody.
"""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from rollfleet.api.common import ApiModel, Condition, CrdInfo, PrinterColumn, cel, validations
from rollfleet.contract import API_VERSION

KIND = "RolloutRequest"
PLURAL = "rolloutrequests"

RequestPhase = Literal["Pending", "Running", "Paused", "Succeeded", "Failed", "Aborted"]
TERMINAL_PHASES: frozenset[str] = frozenset({"Succeeded", "Failed", "Aborted"})
Stickiness = Literal["Prompt", "Request", "None"]

# Inline prompts are bounded: characters of text and message content plus token ids, summed
# over prompts. Not by etcd's 1.5 MiB but by `kubectl apply`, which copies the whole object
# into an annotation of at most 256 KiB (and then fails with a message about annotations).
INLINE_PROMPT_BUDGET = 131_072
MAX_INLINE_PROMPTS = 1024
MAX_SAMPLES = 1_000_000
# Results in ConfigMaps live in etcd, which is no place for data: past this, a request fails (ResultsTooLarge)
# and names spec.results.persistentVolumeClaim.
CONFIG_MAP_RESULTS_LIMIT = 16 * 2**20

ShortText = Annotated[str, StringConstraints(max_length=65_536)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class Message(ApiModel):
    """One chat message, as in the OpenAI chat API."""

    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description="Who speaks.")
    content: ShortText = Field(description="What is said.")


class Prompt(ApiModel):
    """One prompt: set exactly one of text (completions), messages (chat) or tokenIds (token-in); inline, the rule
    is on the list (`INLINE_PROMPTS_RULE`)."""

    text: ShortText | None = Field(default=None, description="A plain prompt, sent to /v1/completions.")
    messages: list[Message] | None = Field(
        default=None, min_length=1, max_length=256, description="Chat messages, sent to /v1/chat/completions."
    )
    token_ids: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None = Field(
        default=None,
        min_length=1,
        max_length=65_536,
        description="Prompt token ids, sent to the token-in/token-out route /inference/v1/generate.",
    )

    def size(self) -> int:
        """What the prompt counts against the inline budget (the same sum the CEL rule takes)."""
        return len(self.text or "") + sum(len(m.content) for m in self.messages or []) + len(self.token_ids or [])


class ConfigMapPrompts(ApiModel):
    """Prompts in a ConfigMap key of the request's namespace, one JSON prompt per line (JSONL).

    A line is a Prompt object (`{"text": ...}`, `{"messages": [...]}`, `{"tokenIds": [...]}`)
    or a bare JSON string (a text prompt). Prompts from several sources are numbered in order.
    """

    name: str = Field(min_length=1, max_length=253, description="ConfigMap name.")
    key: str = Field(default="prompts.jsonl", min_length=1, max_length=253, description="Key holding the JSONL.")


class SamplingParams(ApiModel):
    """Sampling settings of every sample (vLLM's names; unset ones take the engine's defaults)."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": validations(
            cel(
                "!has(self.topP) || self.topP > 0.0",
                "sampling.topP must be in (0, 1]: 0 would allow no token",
                field_path=".topP",
            ),
            cel(
                "!has(self.topK) || self.topK == -1 || self.topK >= 1",
                "sampling.topK must be -1 (all tokens) or at least 1",
                field_path=".topK",
            ),
            cel(
                "!has(self.repetitionPenalty) || self.repetitionPenalty > 0.0",
                "sampling.repetitionPenalty must be above 0 (1 means no penalty)",
                field_path=".repetitionPenalty",
            ),
            cel(
                "!has(self.minTokens) || self.minTokens <= self.maxTokens",
                "sampling.minTokens must not exceed sampling.maxTokens",
                field_path=".minTokens",
            ),
        )
    }

    max_tokens: int = Field(default=256, ge=1, le=1_048_576, description="Tokens to generate at most per sample.")
    min_tokens: int | None = Field(default=None, ge=0, le=1_048_576, description="Tokens to generate at least.")
    temperature: float = Field(default=1.0, ge=0, le=100, description="Sampling temperature (0: greedy).")
    top_p: float | None = Field(default=None, le=1, description="Nucleus sampling mass, in (0, 1].")
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000, description="Top-k cutoff (-1: none).")
    min_p: float | None = Field(default=None, ge=0, le=1, description="Minimum token probability relative to the top.")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, description="OpenAI presence penalty.")
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, description="OpenAI frequency penalty.")
    repetition_penalty: float | None = Field(default=None, le=100, description="vLLM repetition penalty (> 0).")
    seed: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1 - 1024,
        description="Base seed: sample s of a prompt uses seed + s, so samples differ and reruns reproduce.",
    )
    stop: list[StopString] | None = Field(default=None, max_length=16, description="Stop strings.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=64, description="Stop token ids."
    )
    ignore_eos: bool | None = Field(default=None, description="Keep generating past the end-of-sequence token.")
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="Ask for log-probabilities (this many top tokens per output token; 0: only the sampled one). "
        "Each result then keeps the sampled token's logprob for every token (`logprobs` in `rollfleet results`).",
    )

    @functools.cached_property
    def vllm_fields(self) -> dict[str, Any]:
        """vLLM request fields (snake_case), dumped once: a request's every sample is sent with them."""
        return self.model_dump(mode="json", by_alias=False, exclude_none=True)

    def body(self, sample: int) -> dict[str, Any]:
        """vLLM request fields (snake_case), with this sample's seed."""
        out = dict(self.vllm_fields)
        if self.seed is not None:
            out["seed"] = self.seed + sample
        return out


class PersistentVolumeClaimResults(ApiModel):
    """Results as JSONL in a file on a PersistentVolumeClaim: `<subPath>/<request>-<uid[:8]>/samples.jsonl`."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": validations(
            cel(
                "!has(self.subPath) || (!self.subPath.startsWith('/') && !('..' in self.subPath.split('/')))",
                "results.persistentVolumeClaim.subPath must be a relative path without '..'",
                field_path=".subPath",
            ),
        )
    }

    claim_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="The PersistentVolumeClaim (same namespace); it must exist when the request starts.",
    )
    sub_path: str | None = Field(
        default=None, min_length=1, max_length=1024, description="A directory inside the volume (default: its root)."
    )


class ResultsSpec(ApiModel):
    """Where a request's results go."""

    persistent_volume_claim: PersistentVolumeClaimResults | None = Field(
        default=None,
        description="A volume made for data: what large batches (thousands of samples, logprobs) need. "
        "Unset: ConfigMaps owned by the request, in etcd, for small requests only.",
    )


_ONE_INPUT = "(has(p.text) ? 1 : 0) + (has(p.messages) ? 1 : 0) + (has(p.tokenIds) ? 1 : 0) == 1"
_SIZE = (
    "(has(p.text) ? size(p.text) : 0) + (has(p.messages) ? p.messages.map(m, size(m.content)).sum() : 0)"
    " + (has(p.tokenIds) ? size(p.tokenIds) : 0)"
)
# Checked on create only: the spec cannot change (the root rule), and the API server runs every rule on every
# write of the object, status patches included, where walking every prompt cost 20-25 ms of its CPU per write of
# a request of 512 prompts.
INLINE_PROMPTS_RULE = validations(
    cel(
        f"oldSelf.hasValue() || (self.all(p, {_ONE_INPUT}) && self.map(p, {_SIZE}).sum() <= {INLINE_PROMPT_BUDGET})",
        message_expression=f"self.all(p, {_ONE_INPUT}) ? 'inline prompts hold at most {INLINE_PROMPT_BUDGET} "
        "characters and token ids in all: put larger sets in a ConfigMap (spec.promptsFrom)' : 'every prompt sets "
        "exactly one of text, messages or tokenIds'",
        optional_old_self=True,
    )
)


class RolloutRequestSpec(ApiModel):
    """The rollouts to run: which fleet, which prompts, how many samples, how, and for how long."""

    model_config = ApiModel.model_config | {
        "json_schema_extra": validations(
            cel(
                "has(self.prompts) != has(self.promptsFrom)",
                "set exactly one of prompts (inline) or promptsFrom (ConfigMaps, for larger sets)",
            ),
            cel(
                f"!has(self.prompts) || size(self.prompts) * self.samplesPerPrompt <= {MAX_SAMPLES}",
                f"prompts x samplesPerPrompt must be at most {MAX_SAMPLES} samples: split the request",
                field_path=".prompts",
            ),
        )
    }

    fleet: str = Field(
        min_length=1,
        max_length=40,
        pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        description="Name of the RolloutFleet (same namespace) that runs the samples.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="Model name sent to the gateway (default: the fleet's servedName).",
    )
    prompts: list[Prompt] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_INLINE_PROMPTS,
        description=f"Inline prompts (at most {MAX_INLINE_PROMPTS}, {INLINE_PROMPT_BUDGET} characters and token "
        "ids in all).",
        json_schema_extra=INLINE_PROMPTS_RULE,
    )
    prompts_from: list[ConfigMapPrompts] | None = Field(
        default=None, min_length=1, max_length=64, description="ConfigMaps holding the prompts as JSONL, in order."
    )
    # Not `n`: YAML 1.1 parsers (kubectl's among them) read the key `n` as the boolean false.
    samples_per_prompt: int = Field(default=1, ge=1, le=1024, description="Samples per prompt (OpenAI's n).")
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Sampling settings.")
    stickiness: Stickiness = Field(
        default="Prompt",
        description="Prompt: the samples of a prompt (a GRPO group) go to one engine, sharing its prefix cache; "
        "Request: the whole request goes to one engine; None: every sample is routed on its own.",
    )
    parallelism: int = Field(default=64, ge=1, le=4096, description="Samples in flight at once, at most.")
    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        le=2_592_000,
        description="Seconds from the start after which in-flight samples are aborted and the request Fails "
        "(reason DeadlineExceeded). Completed samples are kept.",
    )
    max_weight_staleness: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="Fleet weight updates a sample may lag: a sample produced by weights more than this many "
        "updates older than the fleet's current version is discarded and run again. Samples are sent with it "
        "(X-Rollfleet-Max-Weight-Lag): routed to engines within it, and aborted at a push past it.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        le=31_536_000,
        description="Seconds after the request finishes (Succeeded, Failed or Aborted) when it is deleted, with "
        "its results (results on a PersistentVolumeClaim stay on the volume).",
    )
    results: ResultsSpec = Field(
        default_factory=ResultsSpec,
        description="Where results go: a PersistentVolumeClaim for large batches; by default ConfigMaps "
        f"(at most {CONFIG_MAP_RESULTS_LIMIT // 2**20} MiB).",
    )


class Counts(ApiModel):
    """Samples by outcome."""

    total: int = Field(default=0, ge=0, description="prompts x samplesPerPrompt.")
    completed: int = Field(default=0, ge=0, description="Samples that finished (stop or length).")
    aborted: int = Field(
        default=0, ge=0, description="Samples stopped by an abort or the deadline (partial output kept)."
    )
    failed: int = Field(default=0, ge=0, description="Samples the gateway refused or that errored.")
    in_flight: int = Field(default=0, ge=0, description="Samples running now.")


class ResultsRef(ApiModel):
    """Where the results are."""

    config_maps: list[str] = Field(default_factory=list, description="ConfigMaps holding results as JSONL, in order.")
    persistent_volume_claim: str | None = Field(default=None, description="The PersistentVolumeClaim holding them.")
    path: str | None = Field(default=None, description="The JSONL file inside that volume.")
    samples: int = Field(default=0, ge=0, description="Samples stored.")
    bytes: int = Field(default=0, ge=0, description="Bytes of JSONL stored.")
    command: str = Field(default="", description="The command that prints them.")


class AbortRecord(ApiModel):
    """The last abort acted on."""

    token: str = Field(description="The rollfleet.dev/abort value (or `deadline`) acted on.")
    time: datetime = Field(description="When it was acted on.")
    stopped: int = Field(default=0, ge=0, description="Engine requests it stopped (finish_reason abort).")


class RolloutRequestStatus(ApiModel):
    """What the operator last observed; only the operator writes it."""

    observed_generation: int | None = Field(default=None, description="The .metadata.generation last acted on.")
    phase: RequestPhase = Field(
        default="Pending", description="Pending, Running, Paused, Succeeded, Failed or Aborted."
    )
    reason: str | None = Field(default=None, description="One CamelCase word: why the request is in its phase.")
    message: str | None = Field(default=None, description="What a person should know, in a sentence.")
    progress: str = Field(default="0/0", description="Finished samples / total, for kubectl get.")
    counts: Counts = Field(default_factory=Counts, description="Samples by outcome.")
    tokens: int = Field(default=0, ge=0, description="Output tokens generated by stored samples.")
    weight_versions: list[str] = Field(
        default_factory=list, max_length=64, description="Weight versions that produced stored samples, oldest first."
    )
    prompts_digest: str | None = Field(default=None, description="sha256 of the prompts the run started with.")
    start_time: datetime | None = Field(default=None, description="When the first sample was sent.")
    completion_time: datetime | None = Field(default=None, description="When the request finished.")
    results: ResultsRef = Field(default_factory=ResultsRef, description="Where the results are.")
    abort: AbortRecord | None = Field(default=None, description="The abort acted on, if any.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Running, Paused, Complete, Failed and Aborted.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class RolloutRequest(ApiModel):
    """A RolloutRequest as read from the API server."""

    api_version: str = Field(default=API_VERSION)
    kind: str = Field(default=KIND)
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: RolloutRequestSpec
    status: RolloutRequestStatus | None = None


CRD = CrdInfo(
    kind=KIND,
    plural=PLURAL,
    short_names=("rr",),
    description="A batch of rollouts on a RolloutFleet: prompts x samplesPerPrompt samples with sampling settings "
    "and a deadline. "
    "`kubectl get rr -w` shows progress; `kubectl annotate rr/NAME rollfleet.dev/abort=<token>` stops it on the "
    "engines; `rollfleet results rr/NAME` prints the samples as JSONL.",
    spec_model=RolloutRequestSpec,
    status_model=RolloutRequestStatus,
    printer_columns=(
        PrinterColumn("Phase", "string", ".status.phase", "Pending, Running, Paused, Succeeded, Failed or Aborted."),
        PrinterColumn("Progress", "string", ".status.progress", "Finished samples / total."),
        PrinterColumn("Tokens", "integer", ".status.tokens", "Output tokens generated."),
        PrinterColumn("Fleet", "string", ".spec.fleet", "The RolloutFleet."),
        PrinterColumn("Age", "date", ".metadata.creationTimestamp", "Time since creation."),
        PrinterColumn("Reason", "string", ".status.reason", "Why the request is in its phase.", priority=1),
        PrinterColumn("Aborted", "integer", ".status.counts.aborted", "Samples aborted.", priority=1),
        PrinterColumn("Failed", "integer", ".status.counts.failed", "Samples failed.", priority=1),
    ),
    root_validations=(
        cel(
            "self.metadata.name.size() <= 63",
            "RolloutRequest names are at most 63 characters: result ConfigMaps are labelled with the name",
            field_path=".metadata.name",
        ),
        cel(
            "oldSelf.spec == self.spec",
            "the spec of a RolloutRequest cannot change: delete it and create a new one (like a Job's template)",
            field_path=".spec",
            reason="FieldValueForbidden",
        ),
    ),
)
