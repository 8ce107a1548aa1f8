// abi.cpp — the extern "C" functions of skippy_stage.h.

#include "stage_internal.h"

// ---- layouts (runtime.md §2; x86-64 LP64) ----
static_assert(sizeof(struct skippy_activation_part_desc) == 128, "part desc");
static_assert(offsetof(struct skippy_activation_part_desc, dimensions) == 48, "part dims");
static_assert(offsetof(struct skippy_activation_part_desc, byte_strides) == 80, "part strides");
static_assert(offsetof(struct skippy_activation_part_desc, payload_offset) == 112, "part offset");
static_assert(sizeof(struct skippy_activation_desc) == 2120, "activation desc");
static_assert(offsetof(struct skippy_activation_desc, payload_bytes) == 32, "desc payload");
static_assert(offsetof(struct skippy_activation_desc, frontier_identity) == 40, "desc frontier");
static_assert(offsetof(struct skippy_activation_desc, parts) == 72, "desc parts");
static_assert(sizeof(struct skippy_activation_boundary_desc) == 2088, "boundary desc");
static_assert(offsetof(struct skippy_activation_boundary_desc, parts) == 40, "boundary parts");
static_assert(sizeof(struct skippy_sampling_config) == 2352, "sampling config");
static_assert(offsetof(struct skippy_sampling_config, sampler_count) == 100, "sampler_count");
static_assert(offsetof(struct skippy_sampling_config, samplers) == 104, "samplers");
static_assert(offsetof(struct skippy_sampling_config, ignore_eos) == 168, "ignore_eos");
static_assert(offsetof(struct skippy_sampling_config, dry_sequence_breakers) == 176, "breakers");
static_assert(offsetof(struct skippy_sampling_config, logit_bias) == 304, "logit_bias");
static_assert(sizeof(struct skippy_native_mtp_draft) == 56, "mtp draft");
static_assert(offsetof(struct skippy_native_mtp_draft, token_ids) == 12, "mtp ids");
static_assert(offsetof(struct skippy_native_mtp_draft, proposal_compute_us) == 48, "mtp us");
static_assert(sizeof(struct skippy_iteration_request) == 72, "iteration request");
static_assert(offsetof(struct skippy_iteration_request, sample_last) == 64, "sample_last");
static_assert(sizeof(struct skippy_error) == 16, "error");

using namespace skippy_stage;

// ---------------------------------------------------------------------------------------
// C API

extern "C" {

struct skippy_abi_version skippy_abi_version(void) {
    return {SKIPPY_STAGE_ABI_MAJOR, SKIPPY_STAGE_ABI_MINOR, SKIPPY_STAGE_ABI_PATCH};
}

void skippy_set_interrupted(bool interrupted) { g_interrupted.store(interrupted, std::memory_order_relaxed); }

bool skippy_interrupted(void) { return g_interrupted.load(std::memory_order_relaxed); }

uint64_t skippy_abi_features(void) {
    return SKIPPY_FEATURE_RUNTIME_SLICE | SKIPPY_FEATURE_ACTIVATION_FRAME | SKIPPY_FEATURE_SESSION_RESET |
           SKIPPY_FEATURE_SAMPLING_CONFIG | SKIPPY_FEATURE_BATCH_VERIFY_FRAME | SKIPPY_FEATURE_LOGIT_BIAS |
           SKIPPY_FEATURE_SESSION_TRIM | SKIPPY_FEATURE_ITERATION_BATCH | SKIPPY_FEATURE_ACTIVATION_BOUNDARY;
}

const char * skippy_status_string(int32_t status) {
    switch (status) {
        case SKIPPY_STATUS_OK: return "ok";
        case SKIPPY_STATUS_ERROR: return "error";
        case SKIPPY_STATUS_INVALID_ARGUMENT: return "invalid_argument";
        case SKIPPY_STATUS_UNSUPPORTED: return "unsupported";
        case SKIPPY_STATUS_BUFFER_TOO_SMALL: return "buffer_too_small";
        case SKIPPY_STATUS_IO_ERROR: return "io_error";
        case SKIPPY_STATUS_MODEL_ERROR: return "model_error";
        case SKIPPY_STATUS_RUNTIME_ERROR: return "runtime_error";
        default: return "unknown";
    }
}

void skippy_error_free(struct skippy_error * error) {
    if (!error) return;
    std::free(const_cast<char *>(error->message));
    std::free(error);
}

void skippy_stage_log_set(skippy_stage_log_callback callback, void * user_data) {
    set_log_callback(callback, user_data);
}

enum skippy_status skippy_model_open(const char * path, const struct skippy_stage_config * config,
                                     skippy_model_t ** out_model, struct skippy_error ** out_error) {
    if (out_model) *out_model = nullptr;
    if (!path || !config || !out_model) {
        return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "path, config and out_model are required");
    }
    if (config->struct_size != sizeof(skippy_stage_config)) {
        return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT,
                    strf("config struct_size %u, expected %zu", config->struct_size, sizeof(skippy_stage_config)));
    }
    // the first field out of range, named with its bounds (the message listed every field)
    std::string bad;
    if (config->ctx_size == 0 || config->ctx_size > (1u << 24)) {
        bad = strf("ctx_size %u is not in [1, %u]", config->ctx_size, 1u << 24);
    } else if (config->lane_count == 0 || config->lane_count > 1024) {
        bad = strf("lane_count %u is not in [1, 1024]", config->lane_count);
    } else if (config->n_batch == 0) {
        bad = "n_batch 0 is not positive";
    } else if (config->n_threads < 0 || config->n_threads > GGML_MAX_N_THREADS) {
        bad = strf("n_threads %d is not in [0 (the default), %d]", config->n_threads, GGML_MAX_N_THREADS);
    } else if (config->stage_index < 0) {
        bad = strf("stage_index %d is negative", config->stage_index);
    }
    if (!bad.empty()) {
        return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "invalid config: " + bad);
    }
    ensure_log_installed();
    auto * m = new (std::nothrow) skippy_model();
    if (!m) return fail(out_error, SKIPPY_STATUS_RUNTIME_ERROR, "out of memory");
    result r;
    try {  // sizes come from the file: an exception must not cross the C ABI (it aborts)
        r = model_load(m, path, config);
    } catch (const std::bad_alloc &) {
        r = err(SKIPPY_STATUS_RUNTIME_ERROR, strf("out of memory loading '%s'", path));
    } catch (const std::exception & e) {
        r = err(SKIPPY_STATUS_RUNTIME_ERROR, strf("loading '%s' failed: %s", path, e.what()));
    }
    if (!r.is_ok()) {
        model_destroy(m);
        return fail(out_error, r.status, r.message);
    }
    *out_model = m;
    return ok(out_error);
}

void skippy_model_free(skippy_model_t * model) {
    // Sessions keep the model alive, so any free order is safe.
    if (model && model->refs.fetch_sub(1) == 1) model_destroy(model);
}

void skippy_model_get_info(const skippy_model_t * m, struct skippy_model_info * out) {
    if (!m || !out) return;
    memset(out, 0, sizeof(*out));
    out->n_layer = m->n_layer;
    out->n_embd = m->n_embd;
    out->n_vocab = m->n_vocab;
    out->n_ctx = m->ctx_size;
    out->n_head = m->n_head;
    out->n_head_kv = m->n_head_kv;
    out->layer_start = m->layer_start;
    out->layer_end = m->layer_end;
    out->stage_index = m->stage_index;
    out->lane_count = m->lane_count;
    out->n_threads = m->n_threads;
    out->n_batch = m->n_batch;
    out->is_source = m->is_source;
    out->is_terminal = m->is_terminal;
    out->batched_activation_exports = true;  // dense llama (runtime.md §1.3)
    snprintf(out->architecture, sizeof(out->architecture), "%s", m->arch.c_str());
}

bool skippy_model_output_activation_boundary(const skippy_model_t * m, struct skippy_activation_boundary_desc * out) {
    if (!m || !out || m->is_terminal) return false;
    fill_boundary(m, out);
    return true;
}

bool skippy_model_input_activation_boundary(const skippy_model_t * m, struct skippy_activation_boundary_desc * out) {
    if (!m || !out || m->is_source) return false;
    fill_boundary(m, out);
    return true;
}

enum skippy_status skippy_session_create(skippy_model_t * m, skippy_session_t ** out_session,
                                         struct skippy_error ** out_error) {
    if (out_session) *out_session = nullptr;
    if (!m || !out_session) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "model and out_session are required");
    int lane = -1;
    {
        std::lock_guard<std::mutex> lock(m->lane_mutex);
        for (int i = 0; i < m->lane_count; i++) {
            if (!m->lane_used[i]) { lane = i; m->lane_used[i] = true; break; }
        }
    }
    if (lane < 0) return fail(out_error, SKIPPY_STATUS_RUNTIME_ERROR, "no skippy execution lane is available");
    auto * s = new (std::nothrow) skippy_session();
    auto release = [&](const std::string & why) {
        if (s) {
            if (s->kbuf) ggml_backend_buffer_free(s->kbuf);
            if (s->kctx) ggml_free(s->kctx);
            delete s;
        }
        std::lock_guard<std::mutex> lock(m->lane_mutex);
        m->lane_used[lane] = false;
        return fail(out_error, SKIPPY_STATUS_RUNTIME_ERROR, why);
    };
    if (!s) return release("out of memory");
    s->model = m;
    s->lane = lane;
    const size_t n_owned = m->layers.size();
    ggml_init_params kp = {/*.mem_size =*/ggml_tensor_overhead() * (2 * n_owned + 1), /*.mem_buffer =*/nullptr,
                           /*.no_alloc =*/true};
    s->kctx = ggml_init(kp);
    if (!s->kctx) return release("ggml_init failed for the KV cache");
    const int64_t n_embd_kv = (int64_t) m->n_head_kv * m->head_dim;
    for (size_t i = 0; i < n_owned; i++) {
        s->k.push_back(ggml_new_tensor_2d(s->kctx, GGML_TYPE_F32, n_embd_kv, m->ctx_size));
        s->v.push_back(ggml_new_tensor_2d(s->kctx, GGML_TYPE_F32, m->ctx_size, n_embd_kv));  // transposed
    }
    const uint64_t kv_bytes = 2 * (uint64_t) n_owned * (uint64_t) n_embd_kv * m->ctx_size * sizeof(float);
    uint64_t available = 0;
    if (skippy_memory_available("", &available) && kv_bytes > available) {
        return release("cannot allocate the KV cache: " + std::to_string(kv_bytes >> 20) + " MiB for " +
                       std::to_string(m->ctx_size) + " positions, " + std::to_string(available >> 20) +
                       " MiB of memory available");
    }
    s->kbuf = ggml_backend_alloc_ctx_tensors(s->kctx, m->backend);
    if (!s->kbuf) return release("cannot allocate the KV cache");
    ggml_backend_buffer_clear(s->kbuf, 0);  // masked cells must never hold NaN bit patterns
    s->cell_pos.assign(m->ctx_size, 0);
    m->refs.fetch_add(1);
    *out_session = s;
    return ok(out_error);
}

enum skippy_status skippy_session_free(skippy_session_t * s, struct skippy_error ** out_error) {
    if (!s) return ok(out_error);
    skippy_model * m = s->model;
    {
        // the cached graph points at this session's KV tensors
        std::lock_guard<std::mutex> lock(m->compute_mutex);
        if (m->cache.session == s) {
            ggml_free(m->cache.ctx);
            m->cache = graph_cache();
        }
    }
    if (s->kbuf) ggml_backend_buffer_free(s->kbuf);
    if (s->kctx) ggml_free(s->kctx);
    {
        std::lock_guard<std::mutex> lock(m->lane_mutex);
        m->lane_used[s->lane] = false;
    }
    delete s;
    if (m->refs.fetch_sub(1) == 1) model_destroy(m);
    return ok(out_error);
}

int32_t skippy_session_position(const skippy_session_t * s) { return s ? (int32_t) s->n_past : -1; }

enum skippy_status skippy_session_reset(skippy_session_t * s, struct skippy_error ** out_error) {
    if (!s) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "session is required");
    s->n_past = 0;
    s->history.clear();
    s->has_logits = false;
    s->last_rows_n = 0;
    s->has_checkpoint = false;
    s->rng_ready = false;
    return ok(out_error);
}

enum skippy_status skippy_trim_session(skippy_session_t * s, uint64_t token_count, struct skippy_error ** out_error) {
    if (!s) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "session is required");
    if (token_count > s->n_past) {
        return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "cannot trim session beyond current token count");
    }
    if (token_count != s->n_past) {
        s->n_past = token_count;
        s->history.resize(token_count < s->history.size() ? token_count : s->history.size());
        s->has_logits = false;  // they belonged to a row that no longer exists
        s->last_rows_n = 0;
    }
    if (s->has_checkpoint && s->ck_start + s->ck_count > token_count) s->has_checkpoint = false;
    return ok(out_error);
}

enum skippy_status skippy_retire_verify_checkpoint(skippy_session_t * s, uint64_t token_start, uint64_t token_count,
                                                   struct skippy_error ** out_error) {
    if (!s) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "session is required");
    if (token_start > s->n_past || token_count > s->n_past - token_start) {
        return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT,
                    strf("verify checkpoint [%llu, +%llu) is outside the session's %llu tokens",
                         (unsigned long long) token_start, (unsigned long long) token_count,
                         (unsigned long long) s->n_past));
    }
    s->has_checkpoint = false;  // dense KV: nothing to snapshot or restore
    return ok(out_error);
}

enum skippy_status skippy_session_sample_current(skippy_session_t * s, const struct skippy_sampling_config * sampling,
                                                 int32_t * out_token, struct skippy_error ** out_error) {
    if (out_token) *out_token = -1;
    if (!s || !out_token) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "session and out_token are required");
    if (!s->model->is_terminal) {
        return fail(out_error, SKIPPY_STATUS_UNSUPPORTED, "sample_current needs the terminal stage (it owns the logits)");
    }
    if (!s->has_logits) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "no current logits: run a prefill or decode first");
    result r = validate_sampling(sampling);
    if (!r.is_ok()) return finish(out_error, r);
    const float * row = s->logits.data() + (s->logits_rows - 1) * (size_t) s->model->n_vocab;
    *out_token = sample_row(s, row, sampling, s->history.data(), s->history.size());
    return ok(out_error);
}

enum skippy_status skippy_sampling_check(const struct skippy_sampling_config * sampling,
                                         struct skippy_error ** out_error) {
    result r = validate_sampling(sampling);
    return r.is_ok() ? ok(out_error) : finish(out_error, r);
}

enum skippy_status skippy_session_copy_logits(skippy_session_t * s, float * out, size_t capacity, size_t * out_count,
                                              struct skippy_error ** out_error) {
    if (out_count) *out_count = 0;
    if (!s) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "session is required");
    if (!s->model->is_terminal) return fail(out_error, SKIPPY_STATUS_UNSUPPORTED, "only the terminal stage has logits");
    if (!s->has_logits) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "no current logits: run a prefill or decode first");
    const size_t need = s->logits_rows * (size_t) s->model->n_vocab;
    if (out_count) *out_count = need;
    if (capacity < need || !out) {
        return fail(out_error, SKIPPY_STATUS_BUFFER_TOO_SMALL, strf("logits need %zu floats, capacity is %zu", need, capacity));
    }
    memcpy(out, s->logits.data(), need * sizeof(float));
    return ok(out_error);
}

enum skippy_status skippy_prefill_chunk_frame(skippy_session_t * s, const int32_t * token_ids, size_t token_count,
                                              const struct skippy_activation_desc * input_desc, const void * input_payload,
                                              struct skippy_activation_desc * output_desc, void * output_payload,
                                              size_t output_capacity, size_t * out_bytes, struct skippy_error ** out_error) {
    return skippy_prefill_chunk_frame_sampled_with_positions(s, token_ids, token_count, nullptr, 0, nullptr, input_desc,
                                                             input_payload, output_desc, output_payload, output_capacity,
                                                             out_bytes, nullptr, out_error);
}

enum skippy_status skippy_prefill_chunk_frame_with_positions(
    skippy_session_t * s, const int32_t * token_ids, size_t token_count, const int32_t * positions, size_t position_count,
    const struct skippy_activation_desc * input_desc, const void * input_payload, struct skippy_activation_desc * output_desc,
    void * output_payload, size_t output_capacity, size_t * out_bytes, struct skippy_error ** out_error) {
    return skippy_prefill_chunk_frame_sampled_with_positions(s, token_ids, token_count, positions, position_count, nullptr,
                                                             input_desc, input_payload, output_desc, output_payload,
                                                             output_capacity, out_bytes, nullptr, out_error);
}

// The tokens and frame arguments of a single-sequence call; a terminal stage samples the
// last row when the call asks for the predicted token (out_token).
static request_io frame_io(const int32_t * tokens, size_t n, const skippy_sampling_config * sampling,
                           const skippy_activation_desc * input_desc, const void * input_payload,
                           skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
                           size_t * out_bytes, int32_t * out_token) {
    request_io io;
    io.tokens = tokens; io.n = n;
    io.sampling = sampling; io.in_desc = input_desc; io.in_payload = input_payload;
    io.out_desc = output_desc; io.out_payload = output_payload; io.capacity = output_capacity; io.out_bytes = out_bytes;
    io.sample = out_token != nullptr;
    io.out_token = out_token;
    return io;
}

enum skippy_status skippy_prefill_chunk_frame_sampled(
    skippy_session_t * s, const int32_t * token_ids, size_t token_count, const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload, struct skippy_activation_desc * output_desc,
    void * output_payload, size_t output_capacity, size_t * out_bytes, int32_t * out_predicted_token,
    struct skippy_error ** out_error) {
    return skippy_prefill_chunk_frame_sampled_with_positions(s, token_ids, token_count, nullptr, 0, sampling, input_desc,
                                                             input_payload, output_desc, output_payload, output_capacity,
                                                             out_bytes, out_predicted_token, out_error);
}

enum skippy_status skippy_prefill_chunk_frame_sampled_with_positions(
    skippy_session_t * s, const int32_t * token_ids, size_t token_count, const int32_t * positions, size_t position_count,
    const struct skippy_sampling_config * sampling, const struct skippy_activation_desc * input_desc,
    const void * input_payload, struct skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
    size_t * out_bytes, int32_t * out_predicted_token, struct skippy_error ** out_error) {
    request_io io = frame_io(token_ids, token_count, sampling, input_desc, input_payload, output_desc, output_payload,
                             output_capacity, out_bytes, out_predicted_token);
    io.positions = positions; io.position_count = position_count;
    return run_single(s, call_kind::prefill, io, out_error);
}

enum skippy_status skippy_decode_step_frame_sampled(
    skippy_session_t * s, int32_t token_id, const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload, struct skippy_activation_desc * output_desc,
    void * output_payload, size_t output_capacity, size_t * out_bytes, int32_t * out_predicted_token,
    struct skippy_error ** out_error) {
    request_io io = frame_io(&token_id, 1, sampling, input_desc, input_payload, output_desc, output_payload,
                             output_capacity, out_bytes, out_predicted_token);
    return run_single(s, call_kind::decode, io, out_error);
}

enum skippy_status skippy_decode_step_frame_sampled_mtp(
    skippy_session_t * s, int32_t token_id, const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload, struct skippy_activation_desc * output_desc,
    void * output_payload, size_t output_capacity, size_t * out_bytes, int32_t * out_predicted_token,
    size_t max_draft_tokens, struct skippy_native_mtp_draft * out_mtp_draft, struct skippy_error ** out_error) {
    (void) max_draft_tokens;  // no MTP head on llama: drafts are never available
    mtp_unavailable(out_mtp_draft);
    return skippy_decode_step_frame_sampled(s, token_id, sampling, input_desc, input_payload, output_desc, output_payload,
                                            output_capacity, out_bytes, out_predicted_token, out_error);
}

enum skippy_status skippy_verify_tokens_frame_sampled(
    skippy_session_t * s, const int32_t * token_ids, size_t token_count, const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload, struct skippy_activation_desc * output_desc,
    void * output_payload, size_t output_capacity, size_t * out_bytes, int32_t * output_tokens,
    size_t output_token_capacity, size_t * out_token_count, size_t max_draft_tokens,
    struct skippy_native_mtp_draft * out_mtp_draft, struct skippy_error ** out_error) {
    (void) max_draft_tokens;
    mtp_unavailable(out_mtp_draft);
    request_io io = frame_io(token_ids, token_count, sampling, input_desc, input_payload, output_desc, output_payload,
                             output_capacity, out_bytes, nullptr);
    io.out_tokens = output_tokens; io.token_capacity = output_token_capacity; io.out_token_count = out_token_count;
    return run_single(s, call_kind::verify, io, out_error);
}

enum skippy_status skippy_session_copy_output_activation_frame(
    skippy_session_t * s, size_t token_count, struct skippy_activation_desc * output_desc, void * output_payload,
    size_t output_capacity, size_t * out_bytes, struct skippy_error ** out_error) {
    empty_desc(output_desc);
    if (out_bytes) *out_bytes = 0;
    if (!s) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "session is required");
    const skippy_model * m = s->model;
    if (m->is_terminal) {
        return fail(out_error, SKIPPY_STATUS_UNSUPPORTED, "the terminal stage exports no activation frame");
    }
    if (token_count == 0 || token_count > s->last_rows_n) {
        return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT,
                    strf("cannot copy %zu rows: the last output holds %zu", token_count, s->last_rows_n));
    }
    const size_t need = output_bytes_for(m, token_count);
    if (out_bytes) *out_bytes = need;
    if (output_capacity < need || !output_payload) {
        return fail(out_error, SKIPPY_STATUS_BUFFER_TOO_SMALL,
                    strf("output payload needs %zu bytes, capacity is %zu", need, output_capacity));
    }
    const size_t skip = (s->last_rows_n - token_count) * (size_t) m->n_embd;  // the last rows
    memcpy(output_payload, s->last_rows.data() + skip, need);
    fill_output_desc(m, output_desc, token_count);
    return ok(out_error);
}

enum skippy_status skippy_iteration_batch_sampled(
    const struct skippy_iteration_request * requests, size_t request_count, struct skippy_activation_desc * output_descs,
    void * const * output_payloads, const size_t * output_capacities, size_t * out_bytes,
    size_t * out_sampled_request_indexes, int32_t * out_predicted_tokens, size_t sampled_capacity,
    size_t * out_sampled_output_count, struct skippy_error ** out_error) {
    if (out_sampled_output_count) *out_sampled_output_count = 0;
    if (request_count == 0) return ok(out_error);
    if (!requests || !output_descs || !output_payloads || !output_capacities || !out_bytes || !out_sampled_output_count) {
        return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "iteration batch output arrays are required");
    }
    std::vector<request_io> ios(request_count);
    std::set<const skippy_session *> seen;
    size_t n_samples = 0;
    bool too_small = false;
    result first_error;
    const skippy_model * model = nullptr;
    for (size_t i = 0; i < request_count; i++) {
        const skippy_iteration_request & q = requests[i];
        empty_desc(&output_descs[i]);
        out_bytes[i] = 0;
        request_io & io = ios[i];
        io.tokens = q.token_ids; io.n = q.token_count; io.positions = q.positions; io.position_count = q.position_count;
        io.sampling = q.sampling; io.in_desc = q.input_desc; io.in_payload = q.input_payload;
        io.out_desc = &output_descs[i]; io.out_payload = output_payloads[i]; io.capacity = output_capacities[i];
        io.out_bytes = &out_bytes[i];
        if (!q.session) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, strf("request %zu has no session", i));
        if (model && q.session->model != model) {
            return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "all batch sessions must belong to one stage model");
        }
        model = q.session->model;
        if (!seen.insert(q.session).second) {
            return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, strf("request %zu repeats a session", i));
        }
        result r = prepare(q.session, call_kind::prefill, io);
        if (r.status == SKIPPY_STATUS_BUFFER_TOO_SMALL) {
            too_small = true;  // keep going: every request's size must be reported
        } else if (!r.is_ok()) {
            return fail(out_error, r.status, strf("request %zu: %s", i, r.message.c_str()));
        }
        if (q.sample_last && model->is_terminal) n_samples++;
    }
    if (too_small) return fail(out_error, SKIPPY_STATUS_BUFFER_TOO_SMALL, "an output payload buffer is too small");
    if (n_samples > sampled_capacity || (n_samples > 0 && (!out_sampled_request_indexes || !out_predicted_tokens))) {
        return fail(out_error, SKIPPY_STATUS_BUFFER_TOO_SMALL,
                    strf("%zu samples need room, sampled capacity is %zu", n_samples, sampled_capacity));
    }
    std::vector<int32_t> toks(request_count, -1);
    std::vector<skippy_session *> ss(request_count);
    for (size_t i = 0; i < request_count; i++) {
        ss[i] = requests[i].session;
        ios[i].sample = requests[i].sample_last;
        ios[i].out_token = &toks[i];
    }
    result r = run_prepared_batch(const_cast<skippy_model *>(model), call_kind::prefill, ss, ios);
    if (!r.is_ok()) return fail(out_error, r.status, r.message);
    size_t k = 0;
    for (size_t i = 0; i < request_count; i++) {
        if (requests[i].sample_last && model->is_terminal) {
            out_sampled_request_indexes[k] = i;
            out_predicted_tokens[k] = toks[i];
            k++;
        }
    }
    *out_sampled_output_count = k;
    return ok(out_error);
}

enum skippy_status skippy_decode_step_frame_batch_sampled(
    skippy_session_t * const * sessions, const int32_t * token_ids, const struct skippy_sampling_config * const * sampling,
    const struct skippy_activation_desc * const * input_descs, const void * const * input_payloads,
    struct skippy_activation_desc * output_descs, void * const * output_payloads, const size_t * output_capacities,
    size_t * out_bytes, int32_t * out_predicted_tokens, size_t predicted_capacity, size_t request_count,
    struct skippy_error ** out_error) {
    if (request_count == 0) return ok(out_error);
    if (!sessions || !token_ids || !output_descs || !output_payloads || !output_capacities || !out_bytes ||
        !out_predicted_tokens) {
        return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "decode batch arrays are required");
    }
    if (predicted_capacity < request_count) {
        return fail(out_error, SKIPPY_STATUS_BUFFER_TOO_SMALL,
                    strf("predicted capacity %zu is below the request count %zu", predicted_capacity, request_count));
    }
    std::vector<request_io> ios(request_count);
    std::set<const skippy_session *> seen;
    bool too_small = false;
    const skippy_model * model = nullptr;
    for (size_t i = 0; i < request_count; i++) {
        empty_desc(&output_descs[i]);
        out_bytes[i] = 0;
        out_predicted_tokens[i] = -1;
        skippy_session * s = sessions[i];
        request_io & io = ios[i];
        io.tokens = &token_ids[i]; io.n = 1;
        io.sampling = sampling ? sampling[i] : nullptr;
        io.in_desc = input_descs ? input_descs[i] : nullptr;
        io.in_payload = input_payloads ? input_payloads[i] : nullptr;
        io.out_desc = &output_descs[i]; io.out_payload = output_payloads[i]; io.capacity = output_capacities[i];
        io.out_bytes = &out_bytes[i];
        io.sample = true;
        io.out_token = &out_predicted_tokens[i];
        if (!s) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, strf("request %zu has no session", i));
        if (model && s->model != model) {
            return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, "all batch sessions must belong to one stage model");
        }
        model = s->model;
        if (!seen.insert(s).second) return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT, strf("request %zu repeats a session", i));
        result r = prepare(s, call_kind::decode, io);
        if (r.status == SKIPPY_STATUS_BUFFER_TOO_SMALL) {
            too_small = true;
        } else if (!r.is_ok()) {
            return fail(out_error, r.status, strf("request %zu: %s", i, r.message.c_str()));
        }
    }
    if (too_small) return fail(out_error, SKIPPY_STATUS_BUFFER_TOO_SMALL, "an output payload buffer is too small");
    std::vector<skippy_session *> ss(sessions, sessions + request_count);
    result r = run_prepared_batch(const_cast<skippy_model *>(model), call_kind::decode, ss, ios);
    return finish(out_error, r);
}

}  // extern "C"

