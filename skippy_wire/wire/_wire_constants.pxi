# The protocol constants as C values for the compiled modules (included by _codec.pyx and
# _frame.pyx).  Each value is read once, at import, from skippy_wire.wire.constants, where
# it is defined; no number is restated here.

from libc.stdint cimport int32_t, uint32_t, uint64_t

from . import constants as _wc

cdef int32_t STATE_VERSION = _wc.STAGE_STATE_VERSION
cdef uint32_t MAX_LOGIT_BIAS = _wc.MAX_STAGE_LOGIT_BIAS
cdef uint32_t MAX_SAMPLERS = _wc.MAX_STAGE_SAMPLERS
cdef uint32_t MAX_BREAKERS = _wc.MAX_STAGE_DRY_SEQUENCE_BREAKERS
cdef uint32_t MAX_STRING = _wc.MAX_STAGE_SAMPLING_STRING_BYTES
cdef int32_t MAX_PREDICTED = _wc.MAX_STAGE_PREDICTED_TOKENS
cdef int32_t MAX_SIDEBAND = _wc.MAX_STAGE_SIDEBAND_VALUES
cdef uint32_t MAX_METADATA = _wc.MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES
cdef uint64_t MAX_STATE_IMPORT = _wc.MAX_STAGE_STATE_IMPORT_BYTES
cdef uint64_t MAX_ACTIVATION = _wc.MAX_STAGE_ACTIVATION_BYTES
cdef uint64_t MAX_DECODED = _wc.MAX_STAGE_DECODED_ACTIVATION_BYTES
cdef Py_ssize_t HEADER_BYTES = _wc.STAGE_WIRE_FIXED_HEADER_BYTES
cdef Py_ssize_t SAMPLING_BASE_BYTES = _wc.STAGE_SAMPLING_CONFIG_BASE_BYTES
cdef Py_ssize_t LOGIT_BIAS_BYTES = _wc.STAGE_LOGIT_BIAS_WIRE_BYTES
cdef int STATS_COUNT = _wc.STAGE_REPLY_STATS_COUNT
# header flag bits (section 2.4)
cdef uint32_t F_SAMPLING = _wc.StateFlags.SAMPLING
cdef uint32_t F_CHAT = _wc.StateFlags.CHAT_SAMPLING_METADATA
cdef uint32_t F_DOUBLING = _wc.ROW_DOUBLING_SIDEBANDS
# codec ids (section 6.1)
cdef int RAW_F32_V1 = _wc.ActivationCodec.RAW_F32_V1
cdef int F16_RNE_V1 = _wc.ActivationCodec.F16_RNE_V1
cdef int BF16_RNE_V1 = _wc.ActivationCodec.BF16_RNE_V1
cdef int S8_ROW_F32_RNE_V1 = _wc.ActivationCodec.S8_ROW_F32_RNE_V1
cdef int MIN_CODEC = min(_wc.ActivationCodec)
cdef int MAX_CODEC = max(_wc.ActivationCodec)
