"""Type stubs for skippy_wire.stage._backend — a 1:1 binding of skippy_wire/stage/_stage/skippy_stage.h.

No policy lives here (retries, token-count mirrors, one-at-a-time decisions belong to
skippy_wire.stage.runtime).  Every native status other than OK raises
skippy_wire.errors.StageRuntimeError (``status``, ``message``; with BUFFER_TOO_SMALL also
``required``: the output size native asked for, one per request for batches).  Execution
calls return result objects with named fields.  All execution calls release the GIL around
the native call.
"""

from collections.abc import Sequence
from typing import Any, Optional

STATUS_OK: int
STATUS_ERROR: int
STATUS_INVALID_ARGUMENT: int
STATUS_UNSUPPORTED: int
STATUS_BUFFER_TOO_SMALL: int
STATUS_IO_ERROR: int
STATUS_MODEL_ERROR: int
STATUS_RUNTIME_ERROR: int

FEATURE_RUNTIME_SLICE: int
FEATURE_TOKENIZE_DETOKENIZE: int
FEATURE_ACTIVATION_FRAME: int
FEATURE_SESSION_RESET: int
FEATURE_BATCH_VERIFY: int
FEATURE_SAMPLING_CONFIG: int
FEATURE_BATCH_VERIFY_FRAME: int
FEATURE_LOGIT_BIAS: int
FEATURE_SESSION_TRIM: int
FEATURE_NATIVE_MTP_N1: int
FEATURE_ITERATION_BATCH: int
FEATURE_ACTIVATION_BOUNDARY: int

ACTIVATION_DESC_BYTES: int  # 2120
ACTIVATION_PART_DESC_BYTES: int  # 128
ACTIVATION_BOUNDARY_DESC_BYTES: int  # 2088
SAMPLING_CONFIG_BYTES: int  # 2352
MTP_DRAFT_BYTES: int  # 56
ITERATION_REQUEST_BYTES: int  # 72
SESSION_BUSY: str  # the text of a call overlapping another thread's call on one session

# int32 buffer (bytes-like / array('i') / int32 ndarray) or a list of ints
_Int32s = Any

def abi_version() -> tuple[int, int, int]: ...
def abi_features() -> int: ...
def status_string(status: int) -> str: ...
def empty_activation_desc() -> bytes:
    """The Rust "empty" descriptor: version 0, producer -1, rest zero (2120 bytes)."""

class FrameResult:
    out_desc: bytes  # 2120-byte ActivationDesc
    out_payload: bytes  # out_bytes long
    out_bytes: int
    predicted_token: int  # -1 when nothing was sampled

class VerifyResult:
    out_desc: bytes
    out_payload: bytes
    out_bytes: int
    predicted_tokens: list[int]  # one per verified row (terminal stages)
    mtp_draft: bytes  # 56-byte native MTP draft

class BatchResult:
    out_descs: list[bytes]
    out_payloads: list[bytes]
    out_bytes: list[int]
    sampled_request_indexes: list[int]
    predicted_tokens: list[int]  # predicted_tokens[i] belongs to sampled_request_indexes[i]

class Model:
    path: str  # as given to the constructor
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx: int  # per-session capacity (= ctx_size)
    n_head: int
    n_head_kv: int
    n_threads: int
    n_batch: int
    lane_count: int
    architecture: str
    is_source: bool
    is_terminal: bool
    batched_activation_exports: bool
    layer_start: int
    layer_end: int
    stage_index: int
    def __init__(
        self,
        path: str,
        *,
        stage_index: int = 0,
        layer_start: int = 0,
        layer_end: int = -1,
        ctx_size: int = 512,
        lane_count: int = 1,
        n_threads: int = 0,
        n_batch: int = 512,
    ) -> None: ...
    def create_session(self) -> Session: ...
    def input_activation_boundary(self) -> Optional[bytes]: ...
    def output_activation_boundary(self) -> Optional[bytes]: ...
    def close(self) -> None:
        """Release the native model; open sessions keep it alive until they are closed."""

class Session:
    """A native session; made only by ``Model.create_session()`` (``Session()`` raises TypeError)."""

    def __init__(self, *args: object, **kwargs: object) -> None: ...  # raises TypeError, as said above
    @property
    def position(self) -> int: ...
    @property
    def model(self) -> Model: ...
    # Frame calls: ``input_desc``/``input_payload`` are the v2 input frame of a non-first
    # stage; ``capacity`` is the size of the output payload buffer (too small: BUFFER_TOO_SMALL).
    def prefill_chunk_frame(self, tokens: _Int32s, positions: Optional[_Int32s] = None,
                            sampling: Optional[bytes] = None, sample: bool = False,
                            input_desc: Optional[bytes] = None, input_payload: Optional[bytes] = None,
                            capacity: int = 0) -> FrameResult: ...
    def decode_step_frame_sampled(self, token: int, sampling: Optional[bytes] = None,
                                  input_desc: Optional[bytes] = None, input_payload: Optional[bytes] = None,
                                  capacity: int = 0) -> FrameResult: ...
    def verify_tokens_frame_sampled(self, tokens: _Int32s, sampling: Optional[bytes] = None,
                                    input_desc: Optional[bytes] = None, input_payload: Optional[bytes] = None,
                                    capacity: int = 0, token_capacity: Optional[int] = None,
                                    max_draft: int = 0) -> VerifyResult: ...
    def copy_output_activation_frame(self, token_count: int, capacity: int = 0) -> FrameResult: ...
    def sample_current(self, sampling: Optional[bytes] = None) -> int: ...
    def copy_logits(self) -> bytes:
        """float32 logits of the last execution (1 row, or one per verified token); terminal only."""
    def trim(self, token_count: int) -> None: ...
    def retire_verify_checkpoint(self, token_start: int, token_count: int) -> None: ...
    def reset(self) -> None: ...
    def close(self) -> None:
        """Free the native session and its lane (also done on garbage collection); during
        another thread's call on it, once that call returns."""

_IterationRequest = tuple[
    Optional[Session], _Int32s, Optional[_Int32s], Optional[bytes], Optional[bytes], Optional[bytes], bool
]

def iteration_batch_sampled(
    requests: Sequence[_IterationRequest], capacities: Sequence[int], sampled_capacity: int
) -> BatchResult: ...
def decode_step_frame_batch_sampled(
    sessions: Sequence[Optional[Session]],
    token_ids: Sequence[int],
    samplings: Sequence[Optional[bytes]],
    input_descs: Sequence[Optional[bytes]],
    input_payloads: Sequence[Optional[bytes]],
    capacities: Sequence[int],
    predicted_capacity: int,
) -> BatchResult: ...
def set_interrupted(interrupted: bool) -> None:
    """Process-wide: while True, a computation in progress (or the next one) stops at its
    next graph node, the flag is cleared, and its call raises: the pending signal's handler
    first (e.g. KeyboardInterrupt), else StageRuntimeError "computation interrupted"."""
    ...

def memory_available(root: str = "") -> Optional[int]:
    """Bytes this process can still allocate: the lesser of Linux's MemAvailable and what the
    memory limits of its cgroups leave (v2 memory.max, v1 memory.limit_in_bytes, less the
    working set); None when none can be read.  ``root`` prefixes every path read."""
    ...

def check_sampling(sampling: Optional[bytes]) -> None:
    """None when the sampler runs ``sampling`` (a packed config, or None: greedy); else the
    StageRuntimeError a prefill or decode step given it would raise."""
    ...

def set_log_callback(callback: Optional[Any]) -> None:
    """callback(level: int, text: str) receives ggml's log lines; None = drop (default)."""
