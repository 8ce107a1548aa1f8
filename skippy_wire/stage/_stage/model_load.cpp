// model_load.cpp — opening a layer range of a GGUF llama model.

#include "stage_internal.h"

#include <sys/stat.h>

namespace skippy_stage {

// ---- GGUF metadata helpers

namespace {

// The type of ``key``'s value (GGUF_TYPE_COUNT where the key is absent) and its id.
gguf_type gguf_key_type(const gguf_context * g, const std::string & key, int64_t * id) {
    *id = gguf_find_key(g, key.c_str());
    return *id < 0 ? GGUF_TYPE_COUNT : gguf_get_kv_type(g, *id);
}

bool gguf_int(const gguf_context * g, const std::string & key, int64_t * out) {
    int64_t id;
    switch (gguf_key_type(g, key, &id)) {
        case GGUF_TYPE_UINT8: *out = gguf_get_val_u8(g, id); return true;
        case GGUF_TYPE_INT8: *out = gguf_get_val_i8(g, id); return true;
        case GGUF_TYPE_UINT16: *out = gguf_get_val_u16(g, id); return true;
        case GGUF_TYPE_INT16: *out = gguf_get_val_i16(g, id); return true;
        case GGUF_TYPE_UINT32: *out = gguf_get_val_u32(g, id); return true;
        case GGUF_TYPE_INT32: *out = gguf_get_val_i32(g, id); return true;
        case GGUF_TYPE_UINT64: *out = (int64_t) gguf_get_val_u64(g, id); return true;
        case GGUF_TYPE_INT64: *out = gguf_get_val_i64(g, id); return true;
        default: return false;
    }
}

bool gguf_float(const gguf_context * g, const std::string & key, double * out) {
    int64_t id;
    switch (gguf_key_type(g, key, &id)) {
        case GGUF_TYPE_FLOAT32: *out = gguf_get_val_f32(g, id); return true;
        case GGUF_TYPE_FLOAT64: *out = gguf_get_val_f64(g, id); return true;
        default: return false;
    }
}

struct gguf_guard {
    gguf_context * g = nullptr;
    ggml_context * meta = nullptr;
    ~gguf_guard() {
        if (meta) ggml_free(meta);
        if (g) gguf_free(g);
    }
};

struct file_guard {
    FILE * f = nullptr;
    ~file_guard() { if (f) fclose(f); }
};

result check_shape(const ggml_tensor * t, const char * name, int64_t ne0, int64_t ne1) {
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != 1 || t->ne[3] != 1) {
        return err(SKIPPY_STATUS_MODEL_ERROR,
                   strf("tensor %s has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]", name,
                        (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
                        (long long) t->ne[3], (long long) ne0, (long long) ne1));
    }
    return {};
}

// Decode streams every weight once per token; with 4 KiB pages that is a TLB miss per page.
// Ask for transparent huge pages on the (still untouched) weight buffer, which matters where
// THP is "madvise" (docs/backend.md "Decode profile"); a hint only, ignored where unavailable.
void advise_huge_pages(ggml_backend_buffer_t buf) {
    if (!ggml_backend_buffer_is_host(buf)) return;
    const uintptr_t huge = 2u << 20;
    const uintptr_t base = (uintptr_t) ggml_backend_buffer_get_base(buf);
    const uintptr_t lo = (base + huge - 1) & ~(huge - 1);
    const uintptr_t hi = (base + ggml_backend_buffer_get_size(buf)) & ~(huge - 1);
    if (hi > lo) madvise((void *) lo, hi - lo, MADV_HUGEPAGE);
}

}  // namespace

void model_destroy(skippy_model * m) {
    if (!m) return;
    if (m->cache.ctx) ggml_free(m->cache.ctx);
    if (m->galloc) ggml_gallocr_free(m->galloc);
    if (m->wbuf) ggml_backend_buffer_free(m->wbuf);
    if (m->wctx) ggml_free(m->wctx);
    if (m->backend) ggml_backend_free(m->backend);
    if (m->threadpool) ggml_threadpool_free(m->threadpool);
    delete m;
}

result model_load(skippy_model * m, const char * path, const skippy_stage_config * cfg) {
    file_guard fg;
    fg.f = fopen(path, "rb");
    if (!fg.f) {
        return err(SKIPPY_STATUS_IO_ERROR, strf("cannot open model file '%s': %s", path, strerror(errno)));
    }
    gguf_guard gg;
    gguf_init_params gp = {/*.no_alloc =*/true, /*.ctx =*/&gg.meta};
    ensure_log_installed();
    take_log_error();
    gg.g = gguf_init_from_file(path, gp);
    if (!gg.g || !gg.meta) {
        const std::string why = take_log_error();
        return err(SKIPPY_STATUS_MODEL_ERROR, strf("'%s' is not a readable GGUF file%s%s", path,
                                                   why.empty() ? "" : ": ", why.c_str()));
    }
    const gguf_context * g = gg.g;

    int64_t arch_id = gguf_find_key(g, "general.architecture");
    if (arch_id < 0 || gguf_get_kv_type(g, arch_id) != GGUF_TYPE_STRING) {
        return err(SKIPPY_STATUS_MODEL_ERROR, "GGUF has no general.architecture");
    }
    m->arch = gguf_get_val_str(g, arch_id);
    if (m->arch != "llama") {
        return err(SKIPPY_STATUS_UNSUPPORTED,
                   strf("architecture '%s' is not supported (this backend runs llama only)", m->arch.c_str()));
    }
    const std::string a = m->arch + ".";
    int64_t v = 0;
    double dv = 0;
    auto need_int = [&](const char * key, int * out) -> result {
        if (!gguf_int(g, a + key, &v) || v <= 0 || v > (1 << 30)) {
            return err(SKIPPY_STATUS_MODEL_ERROR, strf("missing or invalid %s%s", a.c_str(), key));
        }
        *out = (int) v;
        return {};
    };
    result r;
    if (!(r = need_int("block_count", &m->n_layer)).is_ok()) return r;
    // Each layer has its nine tensors: a block count the file cannot hold is refused before
    // anything is sized by it (2^30 layers would allocate gigabytes, then abort).
    if ((int64_t) m->n_layer * 9 > gguf_get_n_tensors(g)) {
        return err(SKIPPY_STATUS_MODEL_ERROR, strf("%sblock_count %d: the file holds %lld tensors, fewer than its layers need",
                                                   a.c_str(), m->n_layer, (long long) gguf_get_n_tensors(g)));
    }
    if (!(r = need_int("embedding_length", &m->n_embd)).is_ok()) return r;
    if (!(r = need_int("feed_forward_length", &m->n_ff)).is_ok()) return r;
    if (!(r = need_int("attention.head_count", &m->n_head)).is_ok()) return r;
    m->n_head_kv = m->n_head;
    if (gguf_int(g, a + "attention.head_count_kv", &v)) m->n_head_kv = (int) v;
    if (m->n_head_kv <= 0 || m->n_head % m->n_head_kv != 0) {
        return err(SKIPPY_STATUS_MODEL_ERROR, strf("head_count %d is not a multiple of head_count_kv %d", m->n_head, m->n_head_kv));
    }
    m->head_dim = m->n_embd / m->n_head;
    if (gguf_int(g, a + "attention.key_length", &v)) m->head_dim = (int) v;
    if (m->head_dim <= 0 || m->head_dim % 2 != 0) {
        return err(SKIPPY_STATUS_MODEL_ERROR, strf("invalid head dimension %d", m->head_dim));
    }
    m->n_rot = m->head_dim;
    if (gguf_int(g, a + "rope.dimension_count", &v)) m->n_rot = (int) v;
    if (m->n_rot <= 0 || m->n_rot > m->head_dim || m->n_rot % 2 != 0) {
        return err(SKIPPY_STATUS_MODEL_ERROR, strf("invalid rope.dimension_count %d", m->n_rot));
    }
    m->n_ctx_train = 2048;
    if (gguf_int(g, a + "context_length", &v)) m->n_ctx_train = (int) v;
    if (gguf_float(g, a + "attention.layer_norm_rms_epsilon", &dv)) m->eps = (float) dv;
    if (!std::isfinite(m->eps) || m->eps < 0) {  // ggml's rms_norm aborts on it
        return err(SKIPPY_STATUS_MODEL_ERROR, strf("invalid %sattention.layer_norm_rms_epsilon %g", a.c_str(), dv));
    }
    if (gguf_float(g, a + "rope.freq_base", &dv)) m->freq_base = (float) dv;
    {
        int64_t sid = gguf_find_key(g, (a + "rope.scaling.type").c_str());
        if (sid >= 0 && gguf_get_kv_type(g, sid) == GGUF_TYPE_STRING) {
            std::string st = gguf_get_val_str(g, sid);
            if (st == "linear" && gguf_float(g, a + "rope.scaling.factor", &dv) && dv > 0) {
                m->freq_scale = (float) (1.0 / dv);
            } else if (st != "none" && st != "linear") {
                return err(SKIPPY_STATUS_UNSUPPORTED, strf("rope scaling '%s' is not supported", st.c_str()));
            }
        }
    }
    if (gguf_int(g, "tokenizer.ggml.eos_token_id", &v)) m->eos_id = (int32_t) v;
    if (gguf_int(g, "tokenizer.ggml.eot_token_id", &v)) m->eot_id = (int32_t) v;

    int64_t embd_id = gguf_find_tensor(g, "token_embd.weight");
    if (embd_id < 0) return err(SKIPPY_STATUS_MODEL_ERROR, "GGUF has no token_embd.weight");
    m->n_vocab = (int) gguf_get_tensor_ne(g, embd_id)[1];
    int64_t tokens_id = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (tokens_id >= 0 && gguf_get_kv_type(g, tokens_id) == GGUF_TYPE_ARRAY &&
        (int64_t) gguf_get_arr_n(g, tokens_id) != m->n_vocab) {  // as llama.cpp: one embedding row per token
        return err(SKIPPY_STATUS_MODEL_ERROR, strf("the vocabulary lists %lld tokens, token_embd.weight has %d rows",
                                                   (long long) gguf_get_arr_n(g, tokens_id), m->n_vocab));
    }

    // config (runtime.md §1.2 admission rules)
    m->stage_index = cfg->stage_index;
    m->layer_start = cfg->layer_start;
    m->layer_end = cfg->layer_end < 0 ? m->n_layer : cfg->layer_end;
    if (m->layer_start < 0 || m->layer_start >= m->layer_end || m->layer_end > m->n_layer) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                   strf("invalid layer range [%d, %d) for a model with %d layers", m->layer_start,
                        m->layer_end, m->n_layer));
    }
    m->is_source = m->layer_start == 0;
    m->is_terminal = m->layer_end == m->n_layer;
    m->ctx_size = (int) cfg->ctx_size;
    m->lane_count = (int) cfg->lane_count;
    m->n_batch = (int) cfg->n_batch;
    m->n_threads = cfg->n_threads > 0 ? cfg->n_threads : physical_cores();

    // tensors of this slice
    struct wanted { std::string name; ggml_tensor ** slot; int64_t ne0, ne1; };
    std::vector<wanted> want;
    const int64_t n_embd_q = (int64_t) m->n_head * m->head_dim;
    const int64_t n_embd_kv = (int64_t) m->n_head_kv * m->head_dim;
    m->layers.resize(m->layer_end - m->layer_start);
    for (int il = m->layer_start; il < m->layer_end; il++) {
        stage_layer & L = m->layers[il - m->layer_start];
        auto blk = [&](const char * s) { return strf("blk.%d.%s.weight", il, s); };
        want.push_back({blk("attn_norm"), &L.attn_norm, m->n_embd, 1});
        want.push_back({blk("attn_q"), &L.wq, m->n_embd, n_embd_q});
        want.push_back({blk("attn_k"), &L.wk, m->n_embd, n_embd_kv});
        want.push_back({blk("attn_v"), &L.wv, m->n_embd, n_embd_kv});
        want.push_back({blk("attn_output"), &L.wo, n_embd_q, m->n_embd});
        want.push_back({blk("ffn_norm"), &L.ffn_norm, m->n_embd, 1});
        want.push_back({blk("ffn_gate"), &L.w_gate, m->n_embd, m->n_ff});
        want.push_back({blk("ffn_up"), &L.w_up, m->n_embd, m->n_ff});
        want.push_back({blk("ffn_down"), &L.w_down, m->n_ff, m->n_embd});
    }
    bool has_output = gguf_find_tensor(g, "output.weight") >= 0;
    if (m->is_source || (m->is_terminal && !has_output)) {
        want.push_back({"token_embd.weight", &m->tok_embd, m->n_embd, m->n_vocab});
    }
    if (m->is_terminal) {
        want.push_back({"output_norm.weight", &m->output_norm, m->n_embd, 1});
        if (has_output) want.push_back({"output.weight", &m->output, m->n_embd, m->n_vocab});
    }
    if (gguf_find_tensor(g, "rope_freqs.weight") >= 0) {
        want.push_back({"rope_freqs.weight", &m->rope_freqs, m->n_rot / 2, 1});
    }

    ggml_init_params wp = {/*.mem_size =*/ggml_tensor_overhead() * (want.size() + 1),
                           /*.mem_buffer =*/nullptr, /*.no_alloc =*/true};
    m->wctx = ggml_init(wp);
    if (!m->wctx) return err(SKIPPY_STATUS_RUNTIME_ERROR, "ggml_init failed");
    std::vector<std::pair<int64_t, ggml_tensor *>> loads;
    struct stat st;
    const uint64_t file_size = fstat(fileno(fg.f), &st) == 0 ? (uint64_t) st.st_size : UINT64_MAX;
    for (auto & w : want) {
        int64_t id = gguf_find_tensor(g, w.name.c_str());
        ggml_tensor * meta = id >= 0 ? ggml_get_tensor(gg.meta, w.name.c_str()) : nullptr;
        if (!meta) return err(SKIPPY_STATUS_MODEL_ERROR, strf("GGUF has no tensor %s", w.name.c_str()));
        if (!(r = check_shape(meta, w.name.c_str(), w.ne0, w.ne1)).is_ok()) return r;
        // before any weight memory is sized by it: a truncated file declaring gigabytes
        if (gguf_get_data_offset(g) + gguf_get_tensor_offset(g, id) + ggml_nbytes(meta) > file_size) {
            return err(SKIPPY_STATUS_MODEL_ERROR, strf("GGUF is truncated in tensor %s", w.name.c_str()));
        }
        bool is_vector = w.ne1 == 1;
        if (is_vector && meta->type != GGML_TYPE_F32) {
            return err(SKIPPY_STATUS_MODEL_ERROR, strf("tensor %s must be F32", w.name.c_str()));
        }
        if (!is_vector && !ggml_get_type_traits_cpu(meta->type)->vec_dot) {  // ggml-cpu would abort or crash
            return err(SKIPPY_STATUS_UNSUPPORTED, strf("tensor %s is of type %s, which the CPU backend cannot multiply",
                                                       w.name.c_str(), ggml_type_name(meta->type)));
        }
        ggml_tensor * t = ggml_dup_tensor(m->wctx, meta);
        ggml_set_name(t, w.name.c_str());
        *w.slot = t;
        loads.push_back({id, t});
        m->weight_elems += (double) ggml_nelements(t);
    }
    if (m->is_terminal && !has_output) m->output = m->tok_embd;  // tied head

    ensure_log_installed();
    m->backend = ggml_backend_cpu_init();
    if (!m->backend) return err(SKIPPY_STATUS_RUNTIME_ERROR, "ggml CPU backend init failed");
    ggml_backend_cpu_set_n_threads(m->backend, m->n_threads);
    ggml_backend_cpu_set_abort_callback(m->backend, interrupted_callback, nullptr);
    m->threads_now = m->n_threads;
    if (m->n_threads > 1) {
        // A persistent pool instead of threads created per graph.  poll 0: idle workers
        // sleep, so one stage's pool does not spin while another stage in the process runs.
        ggml_threadpool_params tpp = ggml_threadpool_params_default(m->n_threads);
        tpp.poll = 0;
        m->threadpool = ggml_threadpool_new(&tpp);
        if (m->threadpool) ggml_backend_cpu_set_threadpool(m->backend, m->threadpool);
    }
    m->wbuf = ggml_backend_alloc_ctx_tensors(m->wctx, m->backend);
    if (!m->wbuf) return err(SKIPPY_STATUS_RUNTIME_ERROR, "cannot allocate weight memory");
    advise_huge_pages(m->wbuf);

    // Stream only this slice's bytes (runtime slice, runtime.md §4 item 4).
    const size_t data_off = gguf_get_data_offset(g);
    std::vector<uint8_t> staging;
    for (auto & [id, t] : loads) {
        const size_t off = data_off + gguf_get_tensor_offset(g, id);
        const size_t nbytes = ggml_nbytes(t);
        if (fseeko(fg.f, (off_t) off, SEEK_SET) != 0) {
            return err(SKIPPY_STATUS_IO_ERROR, strf("seek to tensor %s failed", ggml_get_name(t)));
        }
        void * dst = t->data;
        if (!ggml_backend_buffer_is_host(m->wbuf)) {
            staging.resize(nbytes);
            dst = staging.data();
        }
        if (fread(dst, 1, nbytes, fg.f) != nbytes) {
            return err(SKIPPY_STATUS_MODEL_ERROR, strf("GGUF is truncated in tensor %s", ggml_get_name(t)));
        }
        if (dst != t->data) ggml_backend_tensor_set(t, dst, 0, nbytes);
    }

    m->galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(m->backend));
    if (!m->galloc) return err(SKIPPY_STATUS_RUNTIME_ERROR, "cannot create graph allocator");
    m->graph_nodes = 64 * (int) m->layers.size() + 256;
    m->graph_meta.resize(ggml_tensor_overhead() * m->graph_nodes +
                         ggml_graph_overhead_custom(m->graph_nodes, false));
    m->lane_used.assign(m->lane_count, false);
    compute_identities(m);
    return {};
}

}  // namespace skippy_stage
