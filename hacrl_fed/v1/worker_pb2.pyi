from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("prompt_id", "messages", "reference")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    prompt_id: int
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    reference: str
    def __init__(self, prompt_id: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., reference: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "num_samples", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    num_samples: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., num_samples: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class RoundPlan(_message.Message):
    __slots__ = ("schema_version", "run_id", "round", "task", "prompts", "sampling", "challenges")
    class ChallengesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CHALLENGES_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    run_id: str
    round: int
    task: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    challenges: _containers.ScalarMap[str, bytes]
    def __init__(self, schema_version: _Optional[int] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., task: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., challenges: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("org_id", "round", "prompt_id", "sample_index", "response", "finish_reason", "reward", "logprob_sum", "token_count", "sealed_response")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_SUM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    SEALED_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    round: int
    prompt_id: int
    sample_index: int
    response: str
    finish_reason: FinishReason
    reward: float
    logprob_sum: float
    token_count: int
    sealed_response: bytes
    def __init__(self, org_id: _Optional[str] = ..., round: _Optional[int] = ..., prompt_id: _Optional[int] = ..., sample_index: _Optional[int] = ..., response: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., reward: _Optional[float] = ..., logprob_sum: _Optional[float] = ..., token_count: _Optional[int] = ..., sealed_response: _Optional[bytes] = ...) -> None: ...

class WrappedKey(_message.Message):
    __slots__ = ("recipient", "ephemeral_public", "wrapped")
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    WRAPPED_FIELD_NUMBER: _ClassVar[int]
    recipient: str
    ephemeral_public: bytes
    wrapped: bytes
    def __init__(self, recipient: _Optional[str] = ..., ephemeral_public: _Optional[bytes] = ..., wrapped: _Optional[bytes] = ...) -> None: ...

class RolloutBatch(_message.Message):
    __slots__ = ("schema_version", "run_id", "round", "org_id", "rollouts", "accuracy", "metrics", "signature", "wrapped_keys", "plan_digest", "version", "plan_challenges")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PlanChallengesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    WRAPPED_KEYS_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_CHALLENGES_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    run_id: str
    round: int
    org_id: str
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    accuracy: float
    metrics: _containers.ScalarMap[str, float]
    signature: bytes
    wrapped_keys: _containers.RepeatedCompositeFieldContainer[WrappedKey]
    plan_digest: bytes
    version: int
    plan_challenges: _containers.ScalarMap[str, bytes]
    def __init__(self, schema_version: _Optional[int] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., org_id: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ..., accuracy: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., signature: _Optional[bytes] = ..., wrapped_keys: _Optional[_Iterable[_Union[WrappedKey, _Mapping]]] = ..., plan_digest: _Optional[bytes] = ..., version: _Optional[int] = ..., plan_challenges: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("schema_version", "run_id", "round", "org_id", "prompts", "foreign", "capability", "source_batches", "round_capability", "tags", "version")
    class CapabilityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class RoundCapabilityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: CapabilityTable
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[CapabilityTable, _Mapping]] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    FOREIGN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_BATCHES_FIELD_NUMBER: _ClassVar[int]
    ROUND_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    run_id: str
    round: int
    org_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    foreign: _containers.RepeatedCompositeFieldContainer[Rollout]
    capability: _containers.ScalarMap[str, float]
    source_batches: _containers.RepeatedCompositeFieldContainer[RolloutBatch]
    round_capability: _containers.MessageMap[int, CapabilityTable]
    tags: _containers.RepeatedCompositeFieldContainer[BatchTag]
    version: int
    def __init__(self, schema_version: _Optional[int] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., org_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., foreign: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ..., capability: _Optional[_Mapping[str, float]] = ..., source_batches: _Optional[_Iterable[_Union[RolloutBatch, _Mapping]]] = ..., round_capability: _Optional[_Mapping[int, CapabilityTable]] = ..., tags: _Optional[_Iterable[_Union[BatchTag, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class CapabilityTable(_message.Message):
    __slots__ = ("capability",)
    class CapabilityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    capability: _containers.ScalarMap[str, float]
    def __init__(self, capability: _Optional[_Mapping[str, float]] = ...) -> None: ...

class BatchTag(_message.Message):
    __slots__ = ("source", "round", "version")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    source: str
    round: int
    version: int
    def __init__(self, source: _Optional[str] = ..., round: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class TrainReport(_message.Message):
    __slots__ = ("schema_version", "run_id", "round", "org_id", "metrics", "signature", "disclosed_keys", "challenge")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class DisclosedKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DISCLOSED_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    run_id: str
    round: int
    org_id: str
    metrics: _containers.ScalarMap[str, float]
    signature: bytes
    disclosed_keys: _containers.ScalarMap[str, bytes]
    challenge: bytes
    def __init__(self, schema_version: _Optional[int] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., org_id: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., signature: _Optional[bytes] = ..., disclosed_keys: _Optional[_Mapping[str, bytes]] = ..., challenge: _Optional[bytes] = ...) -> None: ...

class EvalRequest(_message.Message):
    __slots__ = ("schema_version", "run_id", "round", "task", "prompts", "max_new_tokens")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    run_id: str
    round: int
    task: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    max_new_tokens: int
    def __init__(self, schema_version: _Optional[int] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., task: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class EvalReport(_message.Message):
    __slots__ = ("schema_version", "run_id", "round", "org_id", "accuracy", "num_prompts", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    run_id: str
    round: int
    org_id: str
    accuracy: float
    num_prompts: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, schema_version: _Optional[int] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., org_id: _Optional[str] = ..., accuracy: _Optional[float] = ..., num_prompts: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ("schema_version",)
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    def __init__(self, schema_version: _Optional[int] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("schema_version", "info")
    class InfoEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    info: _containers.ScalarMap[str, str]
    def __init__(self, schema_version: _Optional[int] = ..., info: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("schema_version", "round")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    round: int
    def __init__(self, schema_version: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("schema_version", "path")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    path: str
    def __init__(self, schema_version: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("schema_version", "train", "plan", "evaluate", "checkpoint")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    EVALUATE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    train: TrainRequest
    plan: RoundPlan
    evaluate: EvalRequest
    checkpoint: CheckpointRequest
    def __init__(self, schema_version: _Optional[int] = ..., train: _Optional[_Union[TrainRequest, _Mapping]] = ..., plan: _Optional[_Union[RoundPlan, _Mapping]] = ..., evaluate: _Optional[_Union[EvalRequest, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointRequest, _Mapping]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("schema_version", "report", "train_error", "batch", "generate_error", "eval_report", "eval_error", "checkpoint", "checkpoint_error")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ERROR_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    GENERATE_ERROR_FIELD_NUMBER: _ClassVar[int]
    EVAL_REPORT_FIELD_NUMBER: _ClassVar[int]
    EVAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ERROR_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    report: TrainReport
    train_error: str
    batch: RolloutBatch
    generate_error: str
    eval_report: EvalReport
    eval_error: str
    checkpoint: CheckpointReply
    checkpoint_error: str
    def __init__(self, schema_version: _Optional[int] = ..., report: _Optional[_Union[TrainReport, _Mapping]] = ..., train_error: _Optional[str] = ..., batch: _Optional[_Union[RolloutBatch, _Mapping]] = ..., generate_error: _Optional[str] = ..., eval_report: _Optional[_Union[EvalReport, _Mapping]] = ..., eval_error: _Optional[str] = ..., checkpoint: _Optional[_Union[CheckpointReply, _Mapping]] = ..., checkpoint_error: _Optional[str] = ...) -> None: ...
