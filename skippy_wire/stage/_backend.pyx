# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""1:1 binding of the C stage backend (skippy_wire/_stage/skippy_stage.h).

No policy: execution calls return the native status, message and outputs as tuples
(see _backend.pyi); only Model(...) and Model.create_session() raise NativeError.  Packed C
structs (ActivationDesc, SamplingConfig) travel as bytes.  The GIL is released around
every native execution call.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset
from libcpp cimport bool as cbool
from libcpp.vector cimport vector


cdef extern from "skippy_stage.h" nogil:
    int SKIPPY_STATUS_OK
    int SKIPPY_STATUS_ERROR
    int SKIPPY_STATUS_INVALID_ARGUMENT
    int SKIPPY_STATUS_UNSUPPORTED
    int SKIPPY_STATUS_BUFFER_TOO_SMALL
    int SKIPPY_STATUS_IO_ERROR
    int SKIPPY_STATUS_MODEL_ERROR
    int SKIPPY_STATUS_RUNTIME_ERROR

    uint64_t SKIPPY_FEATURE_RUNTIME_SLICE
    uint64_t SKIPPY_FEATURE_TOKENIZE_DETOKENIZE
    uint64_t SKIPPY_FEATURE_ACTIVATION_FRAME
    uint64_t SKIPPY_FEATURE_SESSION_RESET
    uint64_t SKIPPY_FEATURE_BATCH_VERIFY
    uint64_t SKIPPY_FEATURE_SAMPLING_CONFIG
    uint64_t SKIPPY_FEATURE_BATCH_VERIFY_FRAME
    uint64_t SKIPPY_FEATURE_LOGIT_BIAS
    uint64_t SKIPPY_FEATURE_SESSION_TRIM
    uint64_t SKIPPY_FEATURE_NATIVE_MTP_N1
    uint64_t SKIPPY_FEATURE_ITERATION_BATCH
    uint64_t SKIPPY_FEATURE_ACTIVATION_BOUNDARY

    ctypedef int skippy_status "enum skippy_status"

    struct skippy_error:
        int32_t status
        const char * message

    struct skippy_abi_version:
        uint32_t major
        uint32_t minor
        uint32_t patch

    struct skippy_activation_part_desc:
        pass

    struct skippy_activation_desc:
        uint64_t payload_bytes

    struct skippy_activation_boundary_desc:
        pass

    struct skippy_sampling_config:
        pass

    struct skippy_native_mtp_draft:
        pass

    ctypedef struct skippy_model_t:
        pass

    ctypedef struct skippy_session_t:
        pass

    struct skippy_iteration_request:
        skippy_session_t * session
        const int32_t * token_ids
        size_t token_count
        const int32_t * positions
        size_t position_count
        const skippy_sampling_config * sampling
        const skippy_activation_desc * input_desc
        const void * input_payload
        cbool sample_last

    struct skippy_stage_config:
        uint32_t struct_size
        int32_t stage_index
        int32_t layer_start
        int32_t layer_end
        uint32_t ctx_size
        uint32_t lane_count
        int32_t n_threads
        uint32_t n_batch

    struct skippy_model_info:
        int32_t n_layer
        int32_t n_embd
        int32_t n_vocab
        int32_t n_ctx
        int32_t n_head
        int32_t n_head_kv
        int32_t layer_start
        int32_t layer_end
        int32_t stage_index
        int32_t lane_count
        int32_t n_threads
        int32_t n_batch
        cbool is_source
        cbool is_terminal
        cbool batched_activation_exports
        char architecture[64]

    ctypedef void (*skippy_stage_log_callback)(int level, const char * text, void * user_data)

    skippy_abi_version c_abi_version "skippy_abi_version"()
    uint64_t skippy_abi_features()
    const char * skippy_status_string(int32_t status)
    void skippy_error_free(skippy_error * error)
    void skippy_stage_log_set(skippy_stage_log_callback callback, void * user_data)

    skippy_status skippy_model_open(const char * path, const skippy_stage_config * config,
                                    skippy_model_t ** out_model, skippy_error ** out_error)
    void skippy_model_free(skippy_model_t * model)
    void skippy_model_get_info(const skippy_model_t * model, skippy_model_info * out_info)
    cbool skippy_model_output_activation_boundary(const skippy_model_t * model, skippy_activation_boundary_desc * out)
    cbool skippy_model_input_activation_boundary(const skippy_model_t * model, skippy_activation_boundary_desc * out)

    skippy_status skippy_session_create(skippy_model_t * model, skippy_session_t ** out, skippy_error ** err)
    skippy_status skippy_session_free(skippy_session_t * session, skippy_error ** err)
    int32_t skippy_session_position(const skippy_session_t * session)
    skippy_status skippy_session_reset(skippy_session_t * session, skippy_error ** err)
    skippy_status skippy_trim_session(skippy_session_t * session, uint64_t token_count, skippy_error ** err)
    skippy_status skippy_retire_verify_checkpoint(skippy_session_t * session, uint64_t token_start,
                                                  uint64_t token_count, skippy_error ** err)
    skippy_status skippy_session_sample_current(skippy_session_t * session, const skippy_sampling_config * sampling,
                                                int32_t * out_token, skippy_error ** err)

    skippy_status skippy_session_copy_logits(skippy_session_t * session, float * out, size_t capacity,
                                             size_t * out_count, skippy_error ** err)
    skippy_status skippy_prefill_chunk_frame_with_positions(
        skippy_session_t * session, const int32_t * token_ids, size_t token_count,
        const int32_t * positions, size_t position_count,
        const skippy_activation_desc * input_desc, const void * input_payload,
        skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
        size_t * out_bytes, skippy_error ** err)
    skippy_status skippy_prefill_chunk_frame_sampled_with_positions(
        skippy_session_t * session, const int32_t * token_ids, size_t token_count,
        const int32_t * positions, size_t position_count, const skippy_sampling_config * sampling,
        const skippy_activation_desc * input_desc, const void * input_payload,
        skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
        size_t * out_bytes, int32_t * out_predicted_token, skippy_error ** err)
    skippy_status skippy_decode_step_frame_sampled(
        skippy_session_t * session, int32_t token_id, const skippy_sampling_config * sampling,
        const skippy_activation_desc * input_desc, const void * input_payload,
        skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
        size_t * out_bytes, int32_t * out_predicted_token, skippy_error ** err)
    skippy_status skippy_verify_tokens_frame_sampled(
        skippy_session_t * session, const int32_t * token_ids, size_t token_count,
        const skippy_sampling_config * sampling,
        const skippy_activation_desc * input_desc, const void * input_payload,
        skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
        size_t * out_bytes, int32_t * output_tokens, size_t output_token_capacity,
        size_t * out_token_count, size_t max_draft_tokens, skippy_native_mtp_draft * out_mtp_draft,
        skippy_error ** err)
    skippy_status skippy_session_copy_output_activation_frame(
        skippy_session_t * session, size_t token_count, skippy_activation_desc * output_desc,
        void * output_payload, size_t output_capacity, size_t * out_bytes, skippy_error ** err)
    skippy_status skippy_decode_step_frame_batch_sampled(
        skippy_session_t * const * sessions, const int32_t * token_ids,
        const skippy_sampling_config * const * sampling,
        const skippy_activation_desc * const * input_descs, const void * const * input_payloads,
        skippy_activation_desc * output_descs, void * const * output_payloads,
        const size_t * output_capacities, size_t * out_bytes,
        int32_t * out_predicted_tokens, size_t predicted_capacity, size_t request_count,
        skippy_error ** err)
    skippy_status skippy_iteration_batch_sampled(
        const skippy_iteration_request * requests, size_t request_count,
        skippy_activation_desc * output_descs, void * const * output_payloads,
        const size_t * output_capacities, size_t * out_bytes,
        size_t * out_sampled_request_indexes, int32_t * out_predicted_tokens, size_t sampled_capacity,
        size_t * out_sampled_output_count, skippy_error ** err)


STATUS_OK = SKIPPY_STATUS_OK
STATUS_ERROR = SKIPPY_STATUS_ERROR
STATUS_INVALID_ARGUMENT = SKIPPY_STATUS_INVALID_ARGUMENT
STATUS_UNSUPPORTED = SKIPPY_STATUS_UNSUPPORTED
STATUS_BUFFER_TOO_SMALL = SKIPPY_STATUS_BUFFER_TOO_SMALL
STATUS_IO_ERROR = SKIPPY_STATUS_IO_ERROR
STATUS_MODEL_ERROR = SKIPPY_STATUS_MODEL_ERROR
STATUS_RUNTIME_ERROR = SKIPPY_STATUS_RUNTIME_ERROR

FEATURE_RUNTIME_SLICE = SKIPPY_FEATURE_RUNTIME_SLICE
FEATURE_TOKENIZE_DETOKENIZE = SKIPPY_FEATURE_TOKENIZE_DETOKENIZE
FEATURE_ACTIVATION_FRAME = SKIPPY_FEATURE_ACTIVATION_FRAME
FEATURE_SESSION_RESET = SKIPPY_FEATURE_SESSION_RESET
FEATURE_BATCH_VERIFY = SKIPPY_FEATURE_BATCH_VERIFY
FEATURE_SAMPLING_CONFIG = SKIPPY_FEATURE_SAMPLING_CONFIG
FEATURE_BATCH_VERIFY_FRAME = SKIPPY_FEATURE_BATCH_VERIFY_FRAME
FEATURE_LOGIT_BIAS = SKIPPY_FEATURE_LOGIT_BIAS
FEATURE_SESSION_TRIM = SKIPPY_FEATURE_SESSION_TRIM
FEATURE_NATIVE_MTP_N1 = SKIPPY_FEATURE_NATIVE_MTP_N1
FEATURE_ITERATION_BATCH = SKIPPY_FEATURE_ITERATION_BATCH
FEATURE_ACTIVATION_BOUNDARY = SKIPPY_FEATURE_ACTIVATION_BOUNDARY

ACTIVATION_DESC_BYTES = sizeof(skippy_activation_desc)
ACTIVATION_PART_DESC_BYTES = sizeof(skippy_activation_part_desc)
ACTIVATION_BOUNDARY_DESC_BYTES = sizeof(skippy_activation_boundary_desc)
SAMPLING_CONFIG_BYTES = sizeof(skippy_sampling_config)
MTP_DRAFT_BYTES = sizeof(skippy_native_mtp_draft)
ITERATION_REQUEST_BYTES = sizeof(skippy_iteration_request)


class NativeError(Exception):
    """A native status other than OK from Model(...) or Model.create_session()."""

    def __init__(self, status, message):
        super().__init__(f"{status_string(status)}: {message}")
        self.status = status
        self.message = message


def abi_version():
    cdef skippy_abi_version v = c_abi_version()
    return (v.major, v.minor, v.patch)


def abi_features():
    return skippy_abi_features()


def status_string(int status):
    return skippy_status_string(status).decode()


cdef object _take_message(skippy_error * e):
    """The error's message (None when there is none) and free it."""
    if e == NULL:
        return None
    msg = e.message.decode("utf-8", "replace") if e.message != NULL else None
    skippy_error_free(e)
    return msg


cdef bytes _empty_desc_bytes():
    cdef skippy_activation_desc d
    memset(&d, 0, sizeof(d))
    (<int32_t *> ((<char *> &d) + 4))[0] = -1
    return PyBytes_FromStringAndSize(<char *> &d, sizeof(d))


def empty_activation_desc():
    return _empty_desc_bytes()


# ---- argument conversion --------------------------------------------------------------

cdef vector[int32_t] _int32s(object obj, str what) except *:
    """Copy a list of ints or any int32 buffer (raw bytes are read as int32 little-endian)."""
    cdef vector[int32_t] out
    cdef const unsigned char[::1] raw
    if isinstance(obj, (list, tuple)):
        out.reserve(len(obj))
        for x in obj:
            out.push_back(x)
        return out
    mv = memoryview(obj)
    if mv.format not in ("i", "<i", "=i", "B", "b", "c") and not (mv.format in ("l", "<l", "=l") and mv.itemsize == 4):
        raise TypeError(f"{what} must be a list of ints or an int32 buffer, not format {mv.format!r}")
    raw = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
    if raw.shape[0] % 4:
        raise ValueError(f"{what} buffer of {raw.shape[0]} bytes is not a whole number of int32 values")
    out.resize(raw.shape[0] // 4)
    if raw.shape[0]:
        memcpy(out.data(), &raw[0], raw.shape[0])
    return out


cdef class _Blob:
    """Owns a fixed-size struct copied from caller bytes (alignment-safe)."""
    cdef bytearray data
    cdef char * ptr

    @staticmethod
    cdef _Blob of(object obj, size_t size, str what):
        cdef _Blob b = _Blob.__new__(_Blob)
        if obj is None:
            b.ptr = NULL
            return b
        data = bytearray(obj)
        if <size_t> len(data) != size:
            raise ValueError(f"{what} must be exactly {size} bytes, got {len(data)}")
        b.data = data
        b.ptr = <char *> b.data
        return b


cdef class _Payload:
    cdef const unsigned char[::1] view
    cdef const void * ptr
    cdef Py_ssize_t size

    @staticmethod
    cdef _Payload of(object obj):
        cdef _Payload p = _Payload.__new__(_Payload)
        p.ptr = NULL
        p.size = 0
        if obj is not None:
            mv = memoryview(obj)
            p.view = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
            p.size = p.view.shape[0]
            if p.size:
                p.ptr = &p.view[0]
        return p


cdef object _payload_mismatch(_Blob desc, _Payload payload):
    """The Rust-side check that keeps native from reading past the caller's payload."""
    if desc.ptr == NULL or payload.ptr == NULL:
        return None
    cdef uint64_t declared = (<skippy_activation_desc *> desc.ptr).payload_bytes
    if <uint64_t> payload.size != declared:
        return f"activation payload length {payload.size} does not match descriptor payload_bytes {declared}"
    return None


cdef bytes _new_payload(size_t capacity):
    """A bytes object native may fill before anyone else sees it (saves a copy)."""
    return PyBytes_FromStringAndSize(NULL, capacity)


cdef char * _payload_ptr(bytes buf):
    return PyBytes_AS_STRING(buf) if len(buf) else NULL


cdef bytes _out_payload(bytes buf, size_t n, int status):
    if status != SKIPPY_STATUS_OK or n == 0:
        return b""
    if <size_t> len(buf) == n:
        return buf
    return buf[:n]


# ---- model / session --------------------------------------------------------------------

cdef class Model:
    cdef skippy_model_t * ptr
    cdef skippy_model_info info
    cdef int live_sessions
    cdef readonly str path

    def __cinit__(self):
        self.ptr = NULL
        self.live_sessions = 0

    def __init__(self, path, *, int stage_index=0, int layer_start=0, int layer_end=-1, int ctx_size=512,
                 int lane_count=1, int n_threads=0, int n_batch=512):
        cdef skippy_stage_config cfg
        cdef skippy_error * e = NULL
        cdef skippy_status st
        if self.ptr != NULL:
            raise RuntimeError("Model is already open")
        if ctx_size <= 0 or lane_count <= 0 or n_batch <= 0:
            raise NativeError(SKIPPY_STATUS_INVALID_ARGUMENT,
                              f"ctx_size, lane_count and n_batch must be positive ({ctx_size}, {lane_count}, {n_batch})")
        self.path = str(path)
        bpath = self.path.encode()
        cdef const char * cpath = bpath
        memset(&cfg, 0, sizeof(cfg))
        cfg.struct_size = sizeof(cfg)
        cfg.stage_index = stage_index
        cfg.layer_start = layer_start
        cfg.layer_end = layer_end
        cfg.ctx_size = ctx_size
        cfg.lane_count = lane_count
        cfg.n_threads = n_threads
        cfg.n_batch = n_batch
        with nogil:
            st = skippy_model_open(cpath, &cfg, &self.ptr, &e)
        msg = _take_message(e)
        if st != SKIPPY_STATUS_OK:
            raise NativeError(st, msg or status_string(st))
        skippy_model_get_info(self.ptr, &self.info)

    def __dealloc__(self):
        if self.ptr != NULL:
            skippy_model_free(self.ptr)
            self.ptr = NULL

    cdef _check_open(self):
        if self.ptr == NULL:
            raise ValueError("Model is closed")

    def close(self):
        """Release the native model; open sessions keep it alive until they close."""
        if self.ptr != NULL:
            skippy_model_free(self.ptr)
            self.ptr = NULL

    property n_layer:
        def __get__(self): return self.info.n_layer
    property n_embd:
        def __get__(self): return self.info.n_embd
    property n_vocab:
        def __get__(self): return self.info.n_vocab
    property n_ctx:
        def __get__(self): return self.info.n_ctx
    property n_head:
        def __get__(self): return self.info.n_head
    property n_head_kv:
        def __get__(self): return self.info.n_head_kv
    property n_threads:
        def __get__(self): return self.info.n_threads
    property n_batch:
        def __get__(self): return self.info.n_batch
    property lane_count:
        def __get__(self): return self.info.lane_count
    property layer_start:
        def __get__(self): return self.info.layer_start
    property layer_end:
        def __get__(self): return self.info.layer_end
    property stage_index:
        def __get__(self): return self.info.stage_index
    property is_source:
        def __get__(self): return bool(self.info.is_source)
    property is_terminal:
        def __get__(self): return bool(self.info.is_terminal)
    property batched_activation_exports:
        def __get__(self): return bool(self.info.batched_activation_exports)
    property architecture:
        def __get__(self): return self.info.architecture.decode()

    def create_session(self):
        cdef skippy_session_t * sp = NULL
        cdef skippy_error * e = NULL
        self._check_open()
        cdef skippy_status st = skippy_session_create(self.ptr, &sp, &e)
        msg = _take_message(e)
        if st != SKIPPY_STATUS_OK:
            raise NativeError(st, msg or status_string(st))
        cdef Session s = Session.__new__(Session)
        s.ptr = sp
        s._model = self
        self.live_sessions += 1
        return s

    def output_activation_boundary(self):
        cdef skippy_activation_boundary_desc b
        self._check_open()
        if not skippy_model_output_activation_boundary(self.ptr, &b):
            return None
        return PyBytes_FromStringAndSize(<char *> &b, sizeof(b))

    def input_activation_boundary(self):
        cdef skippy_activation_boundary_desc b
        self._check_open()
        if not skippy_model_input_activation_boundary(self.ptr, &b):
            return None
        return PyBytes_FromStringAndSize(<char *> &b, sizeof(b))

    def __repr__(self):
        return (f"<skippy_wire.stage._backend.Model {self.path!r} layers [{self.info.layer_start}, "
                f"{self.info.layer_end}) of {self.info.n_layer}>")


@cython.no_gc_clear  # __dealloc__ needs _model (its lane counter) even inside a collected cycle
cdef class Session:
    cdef skippy_session_t * ptr
    cdef Model _model

    def __cinit__(self):
        self.ptr = NULL

    def __init__(self, *args, **kwargs):
        raise TypeError("Session objects are created by Model.create_session()")

    def __dealloc__(self):
        self._free()

    cdef _free(self):
        if self.ptr != NULL:
            skippy_session_free(self.ptr, NULL)
            self.ptr = NULL
            self._model.live_sessions -= 1

    def close(self):
        self._free()

    cdef _check(self):
        if self.ptr == NULL:
            raise ValueError("Session is closed")

    @property
    def model(self):
        return self._model

    @property
    def position(self):
        self._check()
        return skippy_session_position(self.ptr)

    def prefill_chunk_frame(self, tokens, positions=None, sampling=None, bint sample=False, input_desc=None,
                            input_payload=None, size_t capacity=0):
        self._check()
        cdef vector[int32_t] tok = _int32s(tokens, "tokens")
        cdef vector[int32_t] pos
        cdef const int32_t * pos_ptr = NULL
        if positions is not None:
            pos = _int32s(positions, "positions")
            if pos.size():
                pos_ptr = pos.data()
        cdef _Blob samp = _Blob.of(sampling, sizeof(skippy_sampling_config), "sampling")
        cdef _Blob desc = _Blob.of(input_desc, sizeof(skippy_activation_desc), "input_desc")
        cdef _Payload pay = _Payload.of(input_payload)
        mismatch = _payload_mismatch(desc, pay)
        if mismatch is not None:
            return (SKIPPY_STATUS_INVALID_ARGUMENT, mismatch, _empty_desc_bytes(), b"", 0, -1)
        cdef skippy_activation_desc out_desc
        cdef bytes buf = _new_payload(capacity)
        cdef char * bufp = _payload_ptr(buf)
        cdef size_t out_bytes = 0
        cdef int32_t predicted = -1
        cdef skippy_error * e = NULL
        cdef skippy_status st
        with nogil:
            if sample:
                st = skippy_prefill_chunk_frame_sampled_with_positions(
                    self.ptr, tok.data(), tok.size(), pos_ptr, pos.size(),
                    <const skippy_sampling_config *> samp.ptr, <const skippy_activation_desc *> desc.ptr, pay.ptr,
                    &out_desc, bufp, capacity, &out_bytes, &predicted, &e)
            else:
                st = skippy_prefill_chunk_frame_with_positions(
                    self.ptr, tok.data(), tok.size(), pos_ptr, pos.size(),
                    <const skippy_activation_desc *> desc.ptr, pay.ptr,
                    &out_desc, bufp, capacity, &out_bytes, &e)
        msg = _take_message(e)
        return (st, msg, PyBytes_FromStringAndSize(<char *> &out_desc, sizeof(out_desc)),
                _out_payload(buf, out_bytes, st), out_bytes, predicted if sample else -1)

    def decode_step_frame_sampled(self, int32_t token, sampling=None, input_desc=None, input_payload=None,
                                  size_t capacity=0):
        self._check()
        cdef _Blob samp = _Blob.of(sampling, sizeof(skippy_sampling_config), "sampling")
        cdef _Blob desc = _Blob.of(input_desc, sizeof(skippy_activation_desc), "input_desc")
        cdef _Payload pay = _Payload.of(input_payload)
        mismatch = _payload_mismatch(desc, pay)
        if mismatch is not None:
            return (SKIPPY_STATUS_INVALID_ARGUMENT, mismatch, _empty_desc_bytes(), b"", 0, -1)
        cdef skippy_activation_desc out_desc
        cdef bytes buf = _new_payload(capacity)
        cdef char * bufp = _payload_ptr(buf)
        cdef size_t out_bytes = 0
        cdef int32_t predicted = -1
        cdef skippy_error * e = NULL
        cdef skippy_status st
        with nogil:
            st = skippy_decode_step_frame_sampled(
                self.ptr, token, <const skippy_sampling_config *> samp.ptr,
                <const skippy_activation_desc *> desc.ptr, pay.ptr, &out_desc, bufp, capacity, &out_bytes,
                &predicted, &e)
        msg = _take_message(e)
        return (st, msg, PyBytes_FromStringAndSize(<char *> &out_desc, sizeof(out_desc)),
                _out_payload(buf, out_bytes, st), out_bytes, predicted)

    def verify_tokens_frame_sampled(self, tokens, sampling=None, input_desc=None, input_payload=None,
                                    size_t capacity=0, token_capacity=None, size_t max_draft=0):
        self._check()
        cdef vector[int32_t] tok = _int32s(tokens, "tokens")
        cdef _Blob samp = _Blob.of(sampling, sizeof(skippy_sampling_config), "sampling")
        cdef _Blob desc = _Blob.of(input_desc, sizeof(skippy_activation_desc), "input_desc")
        cdef _Payload pay = _Payload.of(input_payload)
        cdef skippy_native_mtp_draft draft
        memset(&draft, 0, sizeof(draft))
        mismatch = _payload_mismatch(desc, pay)
        if mismatch is not None:
            return (SKIPPY_STATUS_INVALID_ARGUMENT, mismatch, _empty_desc_bytes(), b"", 0, [],
                    PyBytes_FromStringAndSize(<char *> &draft, sizeof(draft)))
        cdef size_t tcap = tok.size() if token_capacity is None else <size_t> token_capacity
        cdef vector[int32_t] predicted
        predicted.resize(tcap if tcap else 1)
        cdef size_t n_pred = 0
        cdef skippy_activation_desc out_desc
        cdef bytes buf = _new_payload(capacity)
        cdef char * bufp = _payload_ptr(buf)
        cdef size_t out_bytes = 0
        cdef skippy_error * e = NULL
        cdef skippy_status st
        with nogil:
            st = skippy_verify_tokens_frame_sampled(
                self.ptr, tok.data(), tok.size(), <const skippy_sampling_config *> samp.ptr,
                <const skippy_activation_desc *> desc.ptr, pay.ptr, &out_desc, bufp, capacity, &out_bytes,
                predicted.data(), tcap, &n_pred, max_draft, &draft, &e)
        msg = _take_message(e)
        preds = [predicted[i] for i in range(min(n_pred, tcap))] if st == SKIPPY_STATUS_OK else []
        return (st, msg, PyBytes_FromStringAndSize(<char *> &out_desc, sizeof(out_desc)),
                _out_payload(buf, out_bytes, st), out_bytes, preds,
                PyBytes_FromStringAndSize(<char *> &draft, sizeof(draft)))

    def copy_output_activation_frame(self, size_t token_count, size_t capacity=0):
        self._check()
        cdef skippy_activation_desc out_desc
        cdef bytes buf = _new_payload(capacity)
        cdef char * bufp = _payload_ptr(buf)
        cdef size_t out_bytes = 0
        cdef skippy_error * e = NULL
        cdef skippy_status st
        with nogil:
            st = skippy_session_copy_output_activation_frame(self.ptr, token_count, &out_desc, bufp, capacity,
                                                             &out_bytes, &e)
        msg = _take_message(e)
        return (st, msg, PyBytes_FromStringAndSize(<char *> &out_desc, sizeof(out_desc)),
                _out_payload(buf, out_bytes, st), out_bytes)

    def sample_current(self, sampling=None):
        self._check()
        cdef _Blob samp = _Blob.of(sampling, sizeof(skippy_sampling_config), "sampling")
        cdef int32_t token = -1
        cdef skippy_error * e = NULL
        cdef skippy_status st
        with nogil:
            st = skippy_session_sample_current(self.ptr, <const skippy_sampling_config *> samp.ptr, &token, &e)
        return (st, _take_message(e), token)

    def copy_logits(self):
        """(status, message, float32 bytes of the last execution's logit rows) — diagnostics."""
        self._check()
        cdef skippy_error * e = NULL
        cdef size_t n = 0
        cdef skippy_status st = skippy_session_copy_logits(self.ptr, NULL, 0, &n, &e)
        if st != SKIPPY_STATUS_BUFFER_TOO_SMALL:
            return (st, _take_message(e), b"")
        _take_message(e)
        cdef bytearray buf = bytearray(n * 4)
        st = skippy_session_copy_logits(self.ptr, <float *> (<char *> buf) if n else NULL, n, &n, &e)
        return (st, _take_message(e), bytes(buf) if st == SKIPPY_STATUS_OK else b"")

    def trim(self, uint64_t token_count):
        self._check()
        cdef skippy_error * e = NULL
        cdef skippy_status st = skippy_trim_session(self.ptr, token_count, &e)
        return (st, _take_message(e))

    def retire_verify_checkpoint(self, uint64_t token_start, uint64_t token_count):
        self._check()
        cdef skippy_error * e = NULL
        cdef skippy_status st = skippy_retire_verify_checkpoint(self.ptr, token_start, token_count, &e)
        return (st, _take_message(e))

    def reset(self):
        self._check()
        cdef skippy_error * e = NULL
        cdef skippy_status st = skippy_session_reset(self.ptr, &e)
        return (st, _take_message(e))


cdef skippy_session_t * _session_ptr(object s) except? NULL:
    if s is None:
        return NULL
    if not isinstance(s, Session):
        raise TypeError(f"expected a Session or None, not {type(s).__name__}")
    if (<Session> s).ptr == NULL:
        raise ValueError("Session is closed")
    return (<Session> s).ptr


def iteration_batch_sampled(requests, capacities, size_t sampled_capacity):
    cdef size_t n = len(requests)
    if <size_t> len(capacities) != n:
        raise ValueError(f"{len(capacities)} capacities for {n} requests")
    cdef vector[skippy_iteration_request] reqs
    cdef vector[vector[int32_t]] toks
    cdef vector[vector[int32_t]] poss
    cdef vector[size_t] caps
    cdef vector[void *] out_ptrs
    cdef vector[size_t] out_bytes
    cdef vector[size_t] idx
    cdef vector[int32_t] pred
    cdef vector[skippy_activation_desc] out_descs
    cdef size_t n_sampled = 0
    cdef size_t i
    cdef _Blob b
    cdef _Payload p
    keep = []
    bufs = []
    reqs.resize(n)
    toks.resize(n)
    poss.resize(n)
    caps.resize(n)
    out_ptrs.resize(n)
    out_bytes.resize(n)
    out_descs.resize(n)
    idx.resize(sampled_capacity if sampled_capacity else 1)
    pred.resize(sampled_capacity if sampled_capacity else 1)
    for i in range(n):
        session, tokens, positions, sampling, input_desc, input_payload, sample_last = requests[i]
        memset(&reqs[i], 0, sizeof(skippy_iteration_request))
        reqs[i].session = _session_ptr(session)
        toks[i] = _int32s(tokens, "tokens")
        reqs[i].token_ids = toks[i].data() if toks[i].size() else NULL
        reqs[i].token_count = toks[i].size()
        if positions is not None:
            poss[i] = _int32s(positions, "positions")
            if poss[i].size():
                reqs[i].positions = poss[i].data()
                reqs[i].position_count = poss[i].size()
        b = _Blob.of(sampling, sizeof(skippy_sampling_config), "sampling")
        keep.append(b)
        reqs[i].sampling = <const skippy_sampling_config *> b.ptr
        db = _Blob.of(input_desc, sizeof(skippy_activation_desc), "input_desc")
        keep.append(db)
        reqs[i].input_desc = <const skippy_activation_desc *> (<_Blob> db).ptr
        p = _Payload.of(input_payload)
        keep.append(p)
        mismatch = _payload_mismatch(<_Blob> db, p)
        if mismatch is not None:
            return (SKIPPY_STATUS_INVALID_ARGUMENT, f"request {i}: {mismatch}", [_empty_desc_bytes() for _ in range(n)],
                    [b"" for _ in range(n)], [0 for _ in range(n)], [], [])
        reqs[i].input_payload = p.ptr
        reqs[i].sample_last = bool(sample_last)
        caps[i] = capacities[i]
        buf = _new_payload(caps[i])
        bufs.append(buf)
        out_ptrs[i] = <void *> _payload_ptr(buf)
    cdef skippy_error * e = NULL
    cdef skippy_status st
    with nogil:
        st = skippy_iteration_batch_sampled(reqs.data(), n, out_descs.data(), out_ptrs.data(), caps.data(),
                                            out_bytes.data(), idx.data(), pred.data(), sampled_capacity,
                                            &n_sampled, &e)
    msg = _take_message(e)
    descs = [PyBytes_FromStringAndSize(<char *> &out_descs[i], sizeof(skippy_activation_desc)) for i in range(n)]
    payloads = [_out_payload(bufs[i], out_bytes[i], st) for i in range(n)]
    ns = min(n_sampled, sampled_capacity) if st == SKIPPY_STATUS_OK else 0
    return (st, msg, descs, payloads, [out_bytes[i] for i in range(n)], [idx[i] for i in range(ns)],
            [pred[i] for i in range(ns)])


def decode_step_frame_batch_sampled(sessions, token_ids, samplings, input_descs, input_payloads, capacities,
                                    size_t predicted_capacity):
    cdef size_t n = len(sessions)
    for name, seq in (("token_ids", token_ids), ("samplings", samplings), ("input_descs", input_descs),
                      ("input_payloads", input_payloads), ("capacities", capacities)):
        if <size_t> len(seq) != n:
            raise ValueError(f"{len(seq)} {name} for {n} sessions")
    cdef vector[skippy_session_t *] sess
    cdef vector[int32_t] toks
    cdef vector[const skippy_sampling_config *] samps
    cdef vector[const skippy_activation_desc *] descs
    cdef vector[const void *] pays
    cdef vector[size_t] caps
    cdef vector[void *] out_ptrs
    cdef vector[size_t] out_bytes
    cdef vector[int32_t] pred
    cdef vector[skippy_activation_desc] out_descs
    cdef size_t i
    cdef _Blob b
    cdef _Blob d
    cdef _Payload p
    keep = []
    bufs = []
    sess.resize(n)
    toks.resize(n)
    samps.resize(n)
    descs.resize(n)
    pays.resize(n)
    caps.resize(n)
    out_ptrs.resize(n)
    out_bytes.resize(n)
    out_descs.resize(n)
    pred.resize(predicted_capacity if predicted_capacity > n else (n if n else 1))
    for i in range(n):
        sess[i] = _session_ptr(sessions[i])
        toks[i] = token_ids[i]
        b = _Blob.of(samplings[i], sizeof(skippy_sampling_config), "sampling")
        d = _Blob.of(input_descs[i], sizeof(skippy_activation_desc), "input_desc")
        p = _Payload.of(input_payloads[i])
        keep.extend((b, d, p))
        mismatch = _payload_mismatch(d, p)
        if mismatch is not None:
            return (SKIPPY_STATUS_INVALID_ARGUMENT, f"request {i}: {mismatch}", [_empty_desc_bytes() for _ in range(n)],
                    [b"" for _ in range(n)], [0 for _ in range(n)], [])
        samps[i] = <const skippy_sampling_config *> b.ptr
        descs[i] = <const skippy_activation_desc *> d.ptr
        pays[i] = p.ptr
        caps[i] = capacities[i]
        buf = _new_payload(caps[i])
        bufs.append(buf)
        out_ptrs[i] = <void *> _payload_ptr(buf)
    cdef skippy_error * e = NULL
    cdef skippy_status st
    with nogil:
        st = skippy_decode_step_frame_batch_sampled(sess.data(), toks.data(), samps.data(), descs.data(), pays.data(),
                                                    out_descs.data(), out_ptrs.data(), caps.data(), out_bytes.data(),
                                                    pred.data(), predicted_capacity, n, &e)
    msg = _take_message(e)
    out_d = [PyBytes_FromStringAndSize(<char *> &out_descs[i], sizeof(skippy_activation_desc)) for i in range(n)]
    payloads = [_out_payload(bufs[i], out_bytes[i], st) for i in range(n)]
    predicted = [pred[i] for i in range(n)] if st == SKIPPY_STATUS_OK else []
    return (st, msg, out_d, payloads, [out_bytes[i] for i in range(n)], predicted)


# ---- logging -------------------------------------------------------------------------

cdef object _log_callback = None


cdef void _log_trampoline(int level, const char * text, void * user_data) noexcept with gil:
    cb = _log_callback
    if cb is None:
        return
    try:
        cb(level, text.decode("utf-8", "replace"))
    except BaseException:
        pass  # a logging failure must never unwind through C


def set_log_callback(callback):
    global _log_callback
    _log_callback = callback
    if callback is None:
        skippy_stage_log_set(NULL, NULL)
    else:
        skippy_stage_log_set(_log_trampoline, NULL)
