# The C ABI of skippy_stage.h as Cython sees it (included by _backend.pyx).

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
    void skippy_set_interrupted(cbool interrupted)
    cbool skippy_memory_available(const char * root, uint64_t * out_bytes)
    cbool skippy_interrupted()

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
    skippy_status skippy_sampling_check(const skippy_sampling_config * sampling, skippy_error ** err)

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
