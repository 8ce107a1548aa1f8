// batch.cpp — several sessions of one model as one graph.

#include "stage_internal.h"

namespace skippy_stage {

// Several prepared prefill/decode requests (distinct sessions of one model, each within
// n_batch rows in total) as ONE graph: the weight matmuls run over all rows together and
// attention runs per session over its own cache.  All or nothing: on failure no session
// moves.  Falls back to one request at a time when the rows exceed n_batch, all or nothing
// too: every request computes before any commits.
result run_prepared_batch(skippy_model * m, call_kind kind, std::vector<skippy_session *> & ss,
                          std::vector<request_io> & ios) {
    const size_t R = ss.size();
    size_t total = 0;
    for (auto & io : ios) total += io.n;
    if (R < 2 || total > (size_t) m->n_batch) {
        std::vector<std::vector<float>> logits(R);
        for (size_t i = 0; i < R; i++) {
            result r = execute_prepared(ss[i], kind, ios[i], logits[i]);
            if (!r.is_ok()) return err(r.status, strf("request %zu: %s", i, r.message.c_str()));
        }
        for (size_t i = 0; i < R; i++) commit(ss[i], kind, ios[i], logits[i]);
        return {};
    }
    const int N = (int) total;
    const int hd = m->head_dim;
    const int64_t n_embd_kv = (int64_t) m->n_head_kv * hd;
    std::vector<int> off(R), n_used(R), n_kv(R);
    std::vector<int32_t> pos(N);
    for (size_t r = 0, o = 0; r < R; r++) {
        off[r] = (int) o;
        const request_io & io = ios[r];
        const bool use_pos = io.positions && io.position_count > 0;
        for (size_t i = 0; i < io.n; i++) pos[o + i] = use_pos ? io.positions[i] : (int32_t) (ss[r]->n_past + i);
        n_used[r] = (int) (ss[r]->n_past + io.n);
        n_kv[r] = std::min(m->ctx_size, (n_used[r] + KV_PAD - 1) / KV_PAD * KV_PAD);
        o += io.n;
    }

    std::lock_guard<std::mutex> lock(m->compute_mutex);
    const int want_threads = m->weight_elems * (double) N < 4e6 ? 1 : m->n_threads;
    if (want_threads != m->threads_now) {
        ggml_backend_cpu_set_n_threads(m->backend, want_threads);
        m->threads_now = want_threads;
    }
    if (m->cache.ctx) {  // the batch graph reuses the cache's memory
        ggml_free(m->cache.ctx);
        m->cache = graph_cache();
    }
    const size_t max_nodes = m->graph_nodes + 48 * R * m->layers.size();
    const size_t meta_bytes = ggml_tensor_overhead() * (max_nodes + 16 * R) + ggml_graph_overhead_custom(max_nodes, false);
    if (m->graph_meta_batch.size() < meta_bytes) m->graph_meta_batch.resize(meta_bytes);
    ggml_init_params ip = {/*.mem_size =*/m->graph_meta_batch.size(), /*.mem_buffer =*/m->graph_meta_batch.data(),
                           /*.no_alloc =*/true};
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) return err(SKIPPY_STATUS_RUNTIME_ERROR, "ggml_init failed for the batch graph");
    struct ctx_guard { ggml_context * c; ~ctx_guard() { ggml_free(c); } } cg{ctx};
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, max_nodes, false);

    ggml_tensor * inp_tokens = nullptr, * inp_rows = nullptr, * x;
    if (m->is_source) {
        inp_tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, N);
        ggml_set_input(inp_tokens);
        x = ggml_get_rows(ctx, m->tok_embd, inp_tokens);
    } else {
        inp_rows = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, m->n_embd, N);
        ggml_set_input(inp_rows);
        x = inp_rows;
    }
    ggml_tensor * inp_pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, N);
    ggml_set_input(inp_pos);
    ggml_tensor * inp_last = nullptr;  // last row of each request (terminal)
    if (m->is_terminal) {
        inp_last = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, (int64_t) R);
        ggml_set_input(inp_last);
    }
    std::vector<ggml_tensor *> cells(R), masks(R);
    for (size_t r = 0; r < R; r++) {
        cells[r] = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, (int64_t) ios[r].n);
        ggml_set_input(cells[r]);
        masks[r] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_kv[r], (int64_t) ios[r].n);
        ggml_set_input(masks[r]);
    }
    for (size_t li = 0; li < m->layers.size(); li++) {
        const stage_layer & L = m->layers[li];
        ggml_tensor * cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, m->eps), L.attn_norm);
        ggml_tensor * q = ggml_reshape_3d(ctx, weight_product(ctx, L.wq, cur), hd, m->n_head, N);
        ggml_tensor * k = ggml_reshape_3d(ctx, weight_product(ctx, L.wk, cur), hd, m->n_head_kv, N);
        ggml_tensor * v = weight_product(ctx, L.wv, cur);
        q = ggml_rope_ext(ctx, q, inp_pos, m->rope_freqs, m->n_rot, 0, m->n_ctx_train, m->freq_base,
                          m->freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);
        k = ggml_rope_ext(ctx, k, inp_pos, m->rope_freqs, m->n_rot, 0, m->n_ctx_train, m->freq_base,
                          m->freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);
        ggml_tensor * k2 = ggml_reshape_2d(ctx, k, n_embd_kv, N);
        ggml_tensor * attn = nullptr;
        for (size_t r = 0; r < R; r++) {
            const int nr = (int) ios[r].n;
            ggml_tensor * kc = ss[r]->k[li];
            ggml_tensor * vc = ss[r]->v[li];
            store_kv(ctx, gf, kc, vc, ggml_view_2d(ctx, k2, n_embd_kv, nr, k2->nb[1], (size_t) off[r] * k2->nb[1]),
                     ggml_view_2d(ctx, v, n_embd_kv, nr, v->nb[1], (size_t) off[r] * v->nb[1]), cells[r]);
            ggml_tensor * qr = ggml_view_3d(ctx, q, hd, m->n_head, nr, q->nb[1], q->nb[2], (size_t) off[r] * q->nb[2]);
            ggml_tensor * o = attend(ctx, m, kc, vc, qr, n_kv[r], masks[r]);
            attn = attn ? ggml_concat(ctx, attn, o, 1) : o;
        }
        x = ggml_add(ctx, x, weight_product(ctx, L.wo, attn));
        cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, m->eps), L.ffn_norm);
        cur = ggml_swiglu_split(ctx, weight_product(ctx, L.w_gate, cur), weight_product(ctx, L.w_up, cur));
        x = ggml_add(ctx, x, weight_product(ctx, L.w_down, cur));
    }
    ggml_tensor * out_x = nullptr, * out_logits = nullptr;
    if (!m->is_terminal) {
        out_x = x;
        ggml_set_output(out_x);
        ggml_build_forward_expand(gf, out_x);
    } else {
        ggml_tensor * h = ggml_get_rows(ctx, x, inp_last);
        h = ggml_mul(ctx, ggml_rms_norm(ctx, h, m->eps), m->output_norm);
        out_logits = weight_product(ctx, m->output, h);
        ggml_set_output(out_logits);
        ggml_build_forward_expand(gf, out_logits);
    }
    if (!ggml_gallocr_alloc_graph(m->galloc, gf)) return err(SKIPPY_STATUS_RUNTIME_ERROR, "cannot allocate the batch graph");

    const size_t row_bytes = 4ull * m->n_embd;
    for (size_t r = 0; r < R; r++) {
        const request_io & io = ios[r];
        if (inp_tokens) ggml_backend_tensor_set(inp_tokens, io.tokens, sizeof(int32_t) * off[r], sizeof(int32_t) * io.n);
        if (inp_rows) ggml_backend_tensor_set(inp_rows, io.in_payload, row_bytes * off[r], row_bytes * io.n);
        std::vector<int64_t> c(io.n);
        for (size_t i = 0; i < io.n; i++) {
            c[i] = (int64_t) (ss[r]->n_past + i);
            ss[r]->cell_pos[ss[r]->n_past + i] = pos[off[r] + i];  // beyond n_past: invisible until commit
        }
        ggml_backend_tensor_set(cells[r], c.data(), 0, sizeof(int64_t) * io.n);
        std::vector<float> mask((size_t) n_kv[r] * io.n);
        const float ninf = -std::numeric_limits<float>::infinity();
        for (size_t i = 0; i < io.n; i++) {
            const int32_t pi = pos[off[r] + i];
            float * row = mask.data() + i * n_kv[r];
            for (int j = 0; j < n_used[r]; j++) row[j] = ss[r]->cell_pos[j] <= pi ? 0.0f : ninf;
            for (int j = n_used[r]; j < n_kv[r]; j++) row[j] = ninf;
        }
        ggml_backend_tensor_set(masks[r], mask.data(), 0, mask.size() * sizeof(float));
    }
    ggml_backend_tensor_set(inp_pos, pos.data(), 0, sizeof(int32_t) * N);
    if (inp_last) {
        std::vector<int32_t> last(R);
        for (size_t r = 0; r < R; r++) last[r] = off[r] + (int) ios[r].n - 1;
        ggml_backend_tensor_set(inp_last, last.data(), 0, sizeof(int32_t) * R);
    }
    if (result computed = compute_result(ggml_backend_graph_compute(m->backend, gf)); !computed.is_ok()) {
        return computed;
    }
    std::vector<std::vector<float>> logits(R);
    for (size_t r = 0; r < R; r++) {
        if (out_x && ios[r].out_payload) ggml_backend_tensor_get(out_x, ios[r].out_payload, row_bytes * off[r], row_bytes * ios[r].n);
        if (out_logits) {
            logits[r].resize(m->n_vocab);
            ggml_backend_tensor_get(out_logits, logits[r].data(), sizeof(float) * m->n_vocab * r, sizeof(float) * m->n_vocab);
        }
    }
    for (size_t r = 0; r < R; r++) commit(ss[r], kind, ios[r], logits[r]);
    return {};
}

}  // namespace skippy_stage
