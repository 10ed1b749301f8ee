from protos.pagedserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("swap", "copy", "chunked_prefill", "max_num_steps", "max_logprobs", "seeded_sampling", "max_num_batched_tokens", "max_num_seqs", "max_num_lookahead_slots", "token_bitmask", "max_num_draft_tokens", "max_num_model_draft_tokens", "deferred_token_bitmask", "kv_window_groups", "kv_window", "kv_window_ring", "kv_window_only", "prompt_logprobs")
    SWAP_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEEDED_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_LOOKAHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_MODEL_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_GROUPS_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_RING_FIELD_NUMBER: _ClassVar[int]
    KV_WINDOW_ONLY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    swap: bool
    copy: bool
    chunked_prefill: bool
    max_num_steps: int
    max_logprobs: int
    seeded_sampling: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    max_num_lookahead_slots: int
    token_bitmask: bool
    max_num_draft_tokens: int
    max_num_model_draft_tokens: int
    deferred_token_bitmask: bool
    kv_window_groups: int
    kv_window: int
    kv_window_ring: bool
    kv_window_only: bool
    prompt_logprobs: bool
    def __init__(self, swap: _Optional[bool] = ..., copy: _Optional[bool] = ..., chunked_prefill: _Optional[bool] = ..., max_num_steps: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., seeded_sampling: _Optional[bool] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_lookahead_slots: _Optional[int] = ..., token_bitmask: _Optional[bool] = ..., max_num_draft_tokens: _Optional[int] = ..., max_num_model_draft_tokens: _Optional[int] = ..., deferred_token_bitmask: _Optional[bool] = ..., kv_window_groups: _Optional[int] = ..., kv_window: _Optional[int] = ..., kv_window_ring: _Optional[bool] = ..., kv_window_only: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("model_id", "vocab_size", "eos_token_ids", "max_model_len", "block_size", "num_device_blocks", "num_swap_blocks", "dtype", "device", "capabilities", "tokenizer_json", "executor_version", "bos_token_id", "add_bos_token", "chat_template", "startup_seconds", "startup_phases", "architecture", "sliding_windows")
    class StartupPhasesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    STARTUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STARTUP_PHASES_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    block_size: int
    num_device_blocks: int
    num_swap_blocks: int
    dtype: str
    device: str
    capabilities: Capabilities
    tokenizer_json: str
    executor_version: str
    bos_token_id: int
    add_bos_token: bool
    chat_template: str
    startup_seconds: float
    startup_phases: _containers.ScalarMap[str, float]
    architecture: str
    sliding_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_device_blocks: _Optional[int] = ..., num_swap_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., tokenizer_json: _Optional[str] = ..., executor_version: _Optional[str] = ..., bos_token_id: _Optional[int] = ..., add_bos_token: _Optional[bool] = ..., chat_template: _Optional[str] = ..., startup_seconds: _Optional[float] = ..., startup_phases: _Optional[_Mapping[str, float]] = ..., architecture: _Optional[str] = ..., sliding_windows: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_scheduled_tokens", "block_ids", "sampling", "window_block_ids", "window_block_start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    window_block_ids: _containers.RepeatedScalarFieldContainer[int]
    window_block_start: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., window_block_ids: _Optional[_Iterable[int]] = ..., window_block_start: _Optional[int] = ...) -> None: ...

class RunningRequests(_message.Message):
    __slots__ = ("request_ids", "num_scheduled_tokens", "num_new_blocks", "new_block_ids", "resumed", "num_draft_tokens", "draft_token_ids", "num_new_window_blocks", "new_window_block_ids", "window_block_start", "num_model_draft_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_WINDOW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_WINDOW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    NUM_MODEL_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    resumed: _containers.RepeatedScalarFieldContainer[bool]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_window_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_window_block_ids: _containers.RepeatedScalarFieldContainer[int]
    window_block_start: _containers.RepeatedScalarFieldContainer[int]
    num_model_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., resumed: _Optional[_Iterable[bool]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., num_new_window_blocks: _Optional[_Iterable[int]] = ..., new_window_block_ids: _Optional[_Iterable[int]] = ..., window_block_start: _Optional[_Iterable[int]] = ..., num_model_draft_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockMapping(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_requests", "running", "finished_ids", "swapped_out_ids", "swap_out", "swap_in", "copy", "num_steps", "num_lookahead_slots", "token_bitmasks", "token_bitmasks_follow")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_OUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASKS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    running: RunningRequests
    finished_ids: _containers.RepeatedScalarFieldContainer[str]
    swapped_out_ids: _containers.RepeatedScalarFieldContainer[str]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockMapping]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockMapping]
    copy: _containers.RepeatedCompositeFieldContainer[BlockMapping]
    num_steps: int
    num_lookahead_slots: int
    token_bitmasks: TokenBitmasks
    token_bitmasks_follow: bool
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., running: _Optional[_Union[RunningRequests, _Mapping]] = ..., finished_ids: _Optional[_Iterable[str]] = ..., swapped_out_ids: _Optional[_Iterable[str]] = ..., swap_out: _Optional[_Iterable[_Union[BlockMapping, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockMapping, _Mapping]]] = ..., copy: _Optional[_Iterable[_Union[BlockMapping, _Mapping]]] = ..., num_steps: _Optional[int] = ..., num_lookahead_slots: _Optional[int] = ..., token_bitmasks: _Optional[_Union[TokenBitmasks, _Mapping]] = ..., token_bitmasks_follow: _Optional[bool] = ...) -> None: ...

class TokenBitmasks(_message.Message):
    __slots__ = ("request_ids", "words_per_row", "bitmask")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    WORDS_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    words_per_row: int
    bitmask: bytes
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., words_per_row: _Optional[int] = ..., bitmask: _Optional[bytes] = ...) -> None: ...

class SampledTokens(_message.Message):
    __slots__ = ("request_ids", "num_tokens", "token_ids")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestLogprobs(_message.Message):
    __slots__ = ("request_id", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("request_id", "first_position", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_position: int
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., first_position: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    message: str
    def __init__(self, request_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("swap_ns", "prepare_ns", "forward_ns", "sample_ns", "total_ns")
    SWAP_NS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    swap_ns: int
    prepare_ns: int
    forward_ns: int
    sample_ns: int
    total_ns: int
    def __init__(self, swap_ns: _Optional[int] = ..., prepare_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., sample_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "logprobs", "errors", "timings", "error", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: SampledTokens
    logprobs: _containers.RepeatedCompositeFieldContainer[RequestLogprobs]
    errors: _containers.RepeatedCompositeFieldContainer[RequestError]
    timings: StepTimings
    error: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Union[SampledTokens, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[RequestLogprobs, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[RequestError, _Mapping]]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., error: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...
