// request.cpp — validating and running one request on one session.

#include "stage_internal.h"

namespace skippy_stage {

// Validates one request's tokens, positions, sampling and input frame (skippy_stage.h §3–4).
result validate_request(const skippy_session * s, const int32_t * tokens, size_t n,
                        const int32_t * positions, size_t position_count,
                        const skippy_sampling_config * sampling, const skippy_activation_desc * in,
                        const void * payload) {
    if (!s) return err(SKIPPY_STATUS_INVALID_ARGUMENT, "session and at least one token are required");
    const skippy_model * m = s->model;
    if (n == 0 || !tokens) return err(SKIPPY_STATUS_INVALID_ARGUMENT, "session and at least one token are required");
    if (n > (size_t) INT32_MAX) return err(SKIPPY_STATUS_INVALID_ARGUMENT, "too many tokens");
    for (size_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= m->n_vocab) {
            return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                       strf("token id %d at index %zu is outside the vocabulary [0, %d)", tokens[i], i, m->n_vocab));
        }
    }
    if (!positions && position_count > 0) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT, "position_count is set but positions is NULL");
    }
    if (positions && position_count > 0) {
        if (position_count != n) {
            return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                       strf("position count %zu does not match token count %zu", position_count, n));
        }
        for (size_t i = 0; i < n; i++) {
            if (positions[i] < 0) {
                return err(SKIPPY_STATUS_INVALID_ARGUMENT, strf("position %d at index %zu is negative", positions[i], i));
            }
        }
    }
    result r = validate_sampling(sampling);
    if (!r.is_ok()) return r;

    const bool has_payload = in && in->payload_bytes > 0;
    if (m->is_source) {
        if (has_payload) {
            return err(SKIPPY_STATUS_INVALID_ARGUMENT, "this stage expects token input, not activation input");
        }
        return {};
    }
    if (!in || !payload) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                   strf("stage [%d, %d) needs an activation frame input", m->layer_start, m->layer_end));
    }
    if (in->version != SKIPPY_ACTIVATION_FRAME_VERSION) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT, strf("activation frame version %u is not 2", in->version));
    }
    if (in->layer_end != m->layer_start) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                   strf("activation frame ends at layer %d but this stage starts at layer %d", in->layer_end, m->layer_start));
    }
    if (in->token_count != n) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                   strf("activation frame has %u tokens, request has %zu", in->token_count, n));
    }
    if (in->sequence_count != 1) {  // runtime.md 2.2: one sequence, as every frame a stage exports
        return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                   strf("activation frame has %u sequences, expected 1", in->sequence_count));
    }
    if (in->part_count != 1) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT, strf("activation frame has %u parts, expected 1", in->part_count));
    }
    const uint64_t expect = 4ull * (uint64_t) m->n_embd * n;
    const skippy_activation_part_desc & p = in->parts[0];
    if (p.ggml_type != GGML_TYPE_F32 || p.rank != 2 || p.token_axis != 1 || p.flags != 0 ||
        p.dimensions[0] != m->n_embd || p.dimensions[1] != (int64_t) n || p.byte_strides[0] != 4 ||
        p.byte_strides[1] != 4ull * (uint64_t) m->n_embd || p.payload_offset != 0 || p.payload_bytes != expect) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                   strf("activation part must be a required F32 [%d, %zu] token-major part (type %u, rank %u, "
                        "token axis %d, dims [%lld, %lld], strides [%llu, %llu], offset %llu, flags %u)",
                        m->n_embd, n, p.ggml_type, p.rank, p.token_axis, (long long) p.dimensions[0],
                        (long long) p.dimensions[1], (unsigned long long) p.byte_strides[0],
                        (unsigned long long) p.byte_strides[1], (unsigned long long) p.payload_offset, p.flags));
    }
    if (memcmp(p.identity, m->part_identity, 32) != 0 || memcmp(in->frontier_identity, m->frontier_identity, 32) != 0) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT, "activation frame identity does not match this stage's input boundary");
    }
    if (in->payload_bytes != expect) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                   strf("activation payload_bytes %llu, expected %llu", (unsigned long long) in->payload_bytes,
                        (unsigned long long) expect));
    }
    return {};
}

result check_room(const skippy_session * s, size_t n) {
    if (s->n_past + n > (uint64_t) s->model->ctx_size) {
        return err(SKIPPY_STATUS_RUNTIME_ERROR,
                   strf("context full: %llu cached + %zu new tokens exceed ctx_size %d",
                        (unsigned long long) s->n_past, n, s->model->ctx_size));
    }
    return {};
}

// Steps (a)–(c) of skippy_stage.h §2.
result prepare(skippy_session * s, call_kind kind, request_io & io) {
    if (io.out_bytes) *io.out_bytes = 0;
    result r = validate_request(s, io.tokens, io.n, io.positions, io.position_count, io.sampling, io.in_desc, io.in_payload);
    if (!r.is_ok()) return r;
    if (!(r = check_room(s, io.n)).is_ok()) return r;
    const size_t need = output_bytes_for(s->model, io.n);
    if (io.out_bytes) *io.out_bytes = need;
    if (io.capacity < need || (need > 0 && !io.out_payload)) {
        return err(SKIPPY_STATUS_BUFFER_TOO_SMALL,
                   strf("output payload needs %zu bytes, capacity is %zu", need, io.capacity));
    }
    if (kind == call_kind::verify && s->model->is_terminal && (io.token_capacity < io.n || !io.out_tokens)) {
        return err(SKIPPY_STATUS_BUFFER_TOO_SMALL,
                   strf("verify needs room for %zu predicted tokens, capacity is %zu", io.n, io.token_capacity));
    }
    return {};
}

// Steps (d)–(e); `prepare` must have returned OK.
// Step (e) after a successful compute: sample, then advance the session (sampling cannot
// fail after validation).  `logits` holds 1 row (prefill/decode) or n rows (verify).
void commit(skippy_session * s, call_kind kind, request_io & io, std::vector<float> & logits) {
    skippy_model * m = s->model;
    if (m->is_terminal && kind == call_kind::verify) {
        std::vector<int32_t> hist = s->history;
        for (size_t i = 0; i < io.n; i++) {
            hist.push_back(io.tokens[i]);
            io.out_tokens[i] = sample_row(s, logits.data() + i * (size_t) m->n_vocab, io.sampling, hist.data(), hist.size());
        }
        if (io.out_token_count) *io.out_token_count = io.n;
    } else if (io.out_token_count) {
        *io.out_token_count = 0;
    }
    s->history.insert(s->history.end(), io.tokens, io.tokens + io.n);
    if (io.out_token) {
        *io.out_token = -1;
        if (m->is_terminal && io.sample) {
            *io.out_token = sample_row(s, logits.data(), io.sampling, s->history.data(), s->history.size());
        }
    }
    const uint64_t start = s->n_past;
    s->n_past += io.n;
    if (m->is_terminal) {
        s->logits_rows = logits.size() / (size_t) m->n_vocab;
        s->logits.swap(logits);
        s->has_logits = true;
    } else {
        const size_t bytes = output_bytes_for(m, io.n);
        s->last_rows.resize(bytes / 4);
        memcpy(s->last_rows.data(), io.out_payload, bytes);
        s->last_rows_n = io.n;
    }
    if (kind == call_kind::verify) {
        s->has_checkpoint = true;
        s->ck_start = start;
        s->ck_count = io.n;
    }
    if (io.out_bytes) *io.out_bytes = output_bytes_for(m, io.n);
    fill_output_desc(m, io.out_desc, io.n);
}

// Step (d); `prepare` must have returned OK.  The session does not move: the cache cells
// written lie past n_past until commit.
result execute_prepared(skippy_session * s, call_kind kind, request_io & io, std::vector<float> & logits) {
    skippy_model * m = s->model;
    const logit_rows lr = !m->is_terminal ? logit_rows::none : kind == call_kind::verify ? logit_rows::all : logit_rows::last;
    const bool use_pos = io.positions && io.position_count > 0;
    return execute(s, io.tokens, io.n, use_pos ? io.positions : nullptr,
                   m->is_source ? nullptr : io.in_payload, lr, io.out_payload, &logits);
}

// Steps (d)–(e); `prepare` must have returned OK.
result run_prepared(skippy_session * s, call_kind kind, request_io & io) {
    std::vector<float> logits;
    result r = execute_prepared(s, kind, io, logits);
    if (!r.is_ok()) return r;
    commit(s, kind, io, logits);
    return {};
}

skippy_status run_single(skippy_session * s, call_kind kind, request_io & io, skippy_error ** out_error) {
    empty_desc(io.out_desc);
    if (io.out_token) *io.out_token = -1;
    if (io.out_token_count) *io.out_token_count = 0;
    result r = prepare(s, kind, io);
    if (r.is_ok()) r = run_prepared(s, kind, io);
    return finish(out_error, r);
}

void mtp_unavailable(skippy_native_mtp_draft * d) {
    if (!d) return;
    memset(d, 0, sizeof(*d));
    d->version = 1;
    d->available = false;
}

}  // namespace skippy_stage
