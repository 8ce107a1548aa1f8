# cython: language_level=3, boundscheck=False, wraparound=False
# distutils: language = c++
"""1:1 binding of the C stage backend (skippy_wire/stage/_stage/skippy_stage.h).

No policy (retries, token-count mirrors and one-at-a-time decisions belong to skippy_wire.stage.runtime).
Every native status other than OK is raised in one place, ``_check``, as ``skippy_wire.errors.StageRuntimeError``
(``.status``, ``.message``; with BUFFER_TOO_SMALL also ``.required``, the output size native asked for).  Execution
calls return small result objects with named fields (``FrameResult``, ``VerifyResult``, ``BatchResult``).  Packed
C structs (ActivationDesc, SamplingConfig) travel as bytes.  The GIL is released around every native execution call.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset
from libcpp cimport bool as cbool
from libcpp.vector cimport vector

import os
import sys

from skippy_wire.errors import StageRuntimeError

include "_backend_abi.pxi"

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


cdef class FrameResult:
    """What one prefill / decode / copy call produced: the output descriptor (2120 bytes),
    the payload (``out_bytes`` long) and the predicted token (-1 when nothing was sampled)."""
    cdef readonly bytes out_desc
    cdef readonly bytes out_payload
    cdef readonly size_t out_bytes
    cdef readonly int32_t predicted_token

    def __repr__(self):
        return f"FrameResult(out_bytes={self.out_bytes}, predicted_token={self.predicted_token})"


cdef class VerifyResult:
    """What a verify call produced: as ``FrameResult`` with one predicted token per verified
    row (terminal stages) and the raw 56-byte native MTP draft."""
    cdef readonly bytes out_desc
    cdef readonly bytes out_payload
    cdef readonly size_t out_bytes
    cdef readonly list predicted_tokens
    cdef readonly bytes mtp_draft

    def __repr__(self):
        return f"VerifyResult(out_bytes={self.out_bytes}, predicted_tokens={self.predicted_tokens!r})"


cdef class BatchResult:
    """What a batch call produced, one entry per request (descriptors, payloads, sizes) and
    the compact samples: ``predicted_tokens[i]`` belongs to request ``sampled_request_indexes[i]``
    (a decode batch samples every request, in order)."""
    cdef readonly list out_descs
    cdef readonly list out_payloads
    cdef readonly list out_bytes
    cdef readonly list sampled_request_indexes
    cdef readonly list predicted_tokens

    def __repr__(self):
        return (f"BatchResult(out_bytes={self.out_bytes!r}, sampled_request_indexes="
                f"{self.sampled_request_indexes!r}, predicted_tokens={self.predicted_tokens!r})")


cdef int _check(int status, object message, object required=None) except -1:
    """The one place a status other than OK becomes an exception (``StageRuntimeError``)."""
    if status == SKIPPY_STATUS_OK:
        return 0
    if skippy_interrupted():  # stopped by set_interrupted: the signal's own handler raises (Ctrl-C: KeyboardInterrupt)
        skippy_set_interrupted(False)  # its work is done: the next call computes
        PyErr_CheckSignals()
    raise StageRuntimeError.from_native(status, message, required if status == SKIPPY_STATUS_BUFFER_TOO_SMALL else None)


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


cdef int _check_payload(_Blob desc, _Payload payload, str where) except -1:
    """The Rust-side check that keeps native from reading past the caller's payload."""
    if desc.ptr == NULL or payload.ptr == NULL:
        return 0
    cdef uint64_t declared = (<skippy_activation_desc *> desc.ptr).payload_bytes
    if <uint64_t> payload.size != declared:
        _check(SKIPPY_STATUS_INVALID_ARGUMENT,
               f"{where}activation payload length {payload.size} does not match descriptor payload_bytes {declared}")
    return 0


cdef size_t _LARGEST_BUFFER = <size_t> (PY_SSIZE_T_MAX - sys.getsizeof(b""))  # a bytes object's most, less its header

cdef bytes _new_payload(size_t capacity):
    """A bytes object native may fill before anyone else sees it (saves a copy)."""
    if capacity > _LARGEST_BUFFER:
        _check(SKIPPY_STATUS_INVALID_ARGUMENT, f"output capacity {capacity} exceeds the largest buffer")
    return PyBytes_FromStringAndSize(NULL, capacity)


cdef char * _payload_ptr(bytes buf):
    return PyBytes_AS_STRING(buf) if len(buf) else NULL


cdef bytes _out_payload(bytes buf, size_t n):
    if n == 0:
        return b""
    if <size_t> len(buf) == n:
        return buf
    return buf[:n]


cdef bytes _desc_bytes(const skippy_activation_desc * d):
    return PyBytes_FromStringAndSize(<const char *> d, sizeof(skippy_activation_desc))


cdef object _boundary_bytes(bint found, const skippy_activation_boundary_desc * b):
    """A model's activation boundary struct as bytes, or ``None`` where it has none."""
    return PyBytes_FromStringAndSize(<const char *> b, sizeof(b[0])) if found else None


cdef class _FrameCall:
    """The arguments and the output buffer of one native frame call: the optional sampling
    struct and input frame (checked as the Rust side checks them), and the output frame."""
    cdef _Blob samp
    cdef _Blob desc
    cdef _Payload pay
    cdef const skippy_sampling_config * sampling
    cdef const skippy_activation_desc * input_desc
    cdef const void * input_payload
    cdef skippy_activation_desc out_desc
    cdef bytes buf
    cdef char * bufp
    cdef size_t capacity
    cdef size_t out_bytes
    cdef skippy_error * e

    @staticmethod
    cdef _FrameCall output(size_t capacity):
        cdef _FrameCall c = _FrameCall.__new__(_FrameCall)
        c.buf = _new_payload(capacity)
        c.bufp = _payload_ptr(c.buf)
        c.capacity = capacity
        c.out_bytes = 0
        c.e = NULL
        return c

    @staticmethod
    cdef _FrameCall of(object sampling, object input_desc, object input_payload, size_t capacity):
        cdef _Blob samp = _Blob.of(sampling, sizeof(skippy_sampling_config), "sampling")
        cdef _Blob desc = _Blob.of(input_desc, sizeof(skippy_activation_desc), "input_desc")
        cdef _Payload pay = _Payload.of(input_payload)
        _check_payload(desc, pay, "")
        cdef _FrameCall c = _FrameCall.output(capacity)
        c.samp, c.desc, c.pay = samp, desc, pay
        c.sampling = <const skippy_sampling_config *> samp.ptr
        c.input_desc = <const skippy_activation_desc *> desc.ptr
        c.input_payload = pay.ptr
        return c

    cdef FrameResult result(self, int status, int32_t predicted):
        _check(status, _take_message(self.e), self.out_bytes)
        cdef FrameResult r = FrameResult.__new__(FrameResult)
        r.out_desc = _desc_bytes(&self.out_desc)
        r.out_payload = _out_payload(self.buf, self.out_bytes)
        r.out_bytes = self.out_bytes
        r.predicted_token = predicted
        return r


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
        for name, value in (("ctx_size", ctx_size), ("lane_count", lane_count), ("n_batch", n_batch)):
            if value <= 0:  # before the C struct's unsigned fields would wrap it
                _check(SKIPPY_STATUS_INVALID_ARGUMENT, f"invalid config: {name} {value} is not positive")
        bpath = os.fsencode(path)  # a file name is bytes: any the OS takes, not only UTF-8
        if b"\0" in bpath:  # C would read the path up to it: another file
            _check(SKIPPY_STATUS_INVALID_ARGUMENT, "model path contains a NUL byte")
        self.path = os.fsdecode(bpath)
        cdef const char * cpath = bpath
        cfg = skippy_stage_config(sizeof(cfg), stage_index, layer_start, layer_end, ctx_size, lane_count,
                                  n_threads, n_batch)
        with nogil:
            st = skippy_model_open(cpath, &cfg, &self.ptr, &e)
        _check(st, _take_message(e) or status_string(st))
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
        _check(st, _take_message(e) or status_string(st))
        cdef Session s = Session.__new__(Session)
        s.ptr = sp
        s._model = self
        self.live_sessions += 1
        return s

    def output_activation_boundary(self):
        cdef skippy_activation_boundary_desc b
        self._check_open()
        return _boundary_bytes(skippy_model_output_activation_boundary(self.ptr, &b), &b)

    def input_activation_boundary(self):
        cdef skippy_activation_boundary_desc b
        self._check_open()
        return _boundary_bytes(skippy_model_input_activation_boundary(self.ptr, &b), &b)

    def __repr__(self):
        return (f"<skippy_wire.stage._backend.Model {self.path!r} layers [{self.info.layer_start}, "
                f"{self.info.layer_end}) of {self.info.n_layer}>")


#: A call on a session while another thread's call on it runs (native state would race).
SESSION_BUSY = "the session is in use by another thread: calls on one session must not overlap"


@cython.no_gc_clear  # __dealloc__ needs _model (its lane counter) even inside a collected cycle
cdef class Session:
    cdef skippy_session_t * ptr
    cdef Model _model
    # A call of this session runs with the GIL released (set and read with the GIL held); a
    # close() meanwhile frees the session when that call returns, not under it.
    cdef bint busy
    cdef bint close_pending

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
        if self.busy:
            self.close_pending = True
        else:
            self._free()

    cdef _check(self):
        if self.ptr == NULL:
            raise ValueError("Session is closed")
        if self.busy:
            raise StageRuntimeError(SESSION_BUSY)

    cdef _enter(self):
        """Before a call that releases the GIL: the session is this call's until _leave()."""
        self._check()
        self.busy = True

    cdef _leave(self):
        self.busy = False
        if self.close_pending:
            self.close_pending = False
            self._free()

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
        cdef _FrameCall c = _FrameCall.of(sampling, input_desc, input_payload, capacity)
        cdef int32_t predicted = -1
        cdef skippy_status st
        self._enter()
        try:
            with nogil:
                if sample:
                    st = skippy_prefill_chunk_frame_sampled_with_positions(
                        self.ptr, tok.data(), tok.size(), pos_ptr, pos.size(), c.sampling, c.input_desc,
                        c.input_payload, &c.out_desc, c.bufp, c.capacity, &c.out_bytes, &predicted, &c.e)
                else:
                    st = skippy_prefill_chunk_frame_with_positions(
                        self.ptr, tok.data(), tok.size(), pos_ptr, pos.size(), c.input_desc, c.input_payload,
                        &c.out_desc, c.bufp, c.capacity, &c.out_bytes, &c.e)
        finally:
            self._leave()
        return c.result(st, predicted if sample else -1)

    def decode_step_frame_sampled(self, int32_t token, sampling=None, input_desc=None, input_payload=None,
                                  size_t capacity=0):
        self._check()
        cdef _FrameCall c = _FrameCall.of(sampling, input_desc, input_payload, capacity)
        cdef int32_t predicted = -1
        cdef skippy_status st
        self._enter()
        try:
            with nogil:
                st = skippy_decode_step_frame_sampled(
                    self.ptr, token, c.sampling, c.input_desc, c.input_payload, &c.out_desc, c.bufp, c.capacity,
                    &c.out_bytes, &predicted, &c.e)
        finally:
            self._leave()
        return c.result(st, predicted)

    def verify_tokens_frame_sampled(self, tokens, sampling=None, input_desc=None, input_payload=None,
                                    size_t capacity=0, token_capacity=None, size_t max_draft=0):
        self._check()
        cdef vector[int32_t] tok = _int32s(tokens, "tokens")
        cdef _FrameCall c = _FrameCall.of(sampling, input_desc, input_payload, capacity)
        cdef skippy_native_mtp_draft draft
        memset(&draft, 0, sizeof(draft))
        cdef size_t tcap = tok.size() if token_capacity is None else <size_t> token_capacity
        cdef vector[int32_t] predicted
        predicted.resize(tcap if tcap else 1)
        cdef size_t n_pred = 0
        cdef skippy_status st
        self._enter()
        try:
            with nogil:
                st = skippy_verify_tokens_frame_sampled(
                    self.ptr, tok.data(), tok.size(), c.sampling, c.input_desc, c.input_payload, &c.out_desc,
                    c.bufp, c.capacity, &c.out_bytes, predicted.data(), tcap, &n_pred, max_draft, &draft, &c.e)
        finally:
            self._leave()
        _check(st, _take_message(c.e), c.out_bytes)
        cdef VerifyResult r = VerifyResult.__new__(VerifyResult)
        r.out_desc = _desc_bytes(&c.out_desc)
        r.out_payload = _out_payload(c.buf, c.out_bytes)
        r.out_bytes = c.out_bytes
        r.predicted_tokens = [predicted[i] for i in range(min(n_pred, tcap))]
        r.mtp_draft = PyBytes_FromStringAndSize(<char *> &draft, sizeof(draft))
        return r

    def copy_output_activation_frame(self, size_t token_count, size_t capacity=0):
        self._check()
        cdef _FrameCall c = _FrameCall.output(capacity)
        cdef skippy_status st
        self._enter()
        try:
            with nogil:
                st = skippy_session_copy_output_activation_frame(self.ptr, token_count, &c.out_desc, c.bufp, c.capacity,
                                                                 &c.out_bytes, &c.e)
        finally:
            self._leave()
        return c.result(st, -1)

    def sample_current(self, sampling=None):
        self._check()
        cdef _Blob samp = _Blob.of(sampling, sizeof(skippy_sampling_config), "sampling")
        cdef int32_t token = -1
        cdef skippy_error * e = NULL
        cdef skippy_status st
        self._enter()
        try:
            with nogil:
                st = skippy_session_sample_current(self.ptr, <const skippy_sampling_config *> samp.ptr, &token, &e)
        finally:
            self._leave()
        _check(st, _take_message(e))
        return token

    def copy_logits(self):
        """float32 bytes of the last execution's logit rows (diagnostics)."""
        self._check()
        cdef skippy_error * e = NULL
        cdef size_t n = 0
        cdef skippy_status st = skippy_session_copy_logits(self.ptr, NULL, 0, &n, &e)
        msg = _take_message(e)
        if st == SKIPPY_STATUS_OK:
            return b""
        if st != SKIPPY_STATUS_BUFFER_TOO_SMALL:
            _check(st, msg)
        cdef bytearray buf = bytearray(n * 4)
        st = skippy_session_copy_logits(self.ptr, <float *> (<char *> buf) if n else NULL, n, &n, &e)
        _check(st, _take_message(e))
        return bytes(buf)

    def trim(self, uint64_t token_count):
        self._check()
        cdef skippy_error * e = NULL
        cdef skippy_status st = skippy_trim_session(self.ptr, token_count, &e)
        _check(st, _take_message(e))

    def retire_verify_checkpoint(self, uint64_t token_start, uint64_t token_count):
        self._check()
        cdef skippy_error * e = NULL
        cdef skippy_status st = skippy_retire_verify_checkpoint(self.ptr, token_start, token_count, &e)
        _check(st, _take_message(e))

    def reset(self):
        self._check()
        cdef skippy_error * e = NULL
        cdef skippy_status st = skippy_session_reset(self.ptr, &e)
        _check(st, _take_message(e))


include "_backend_batch.pxi"


include "_backend_process.pxi"
