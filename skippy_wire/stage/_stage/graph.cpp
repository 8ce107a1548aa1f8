// graph.cpp — building and evaluating the stage graph.

#include "stage_internal.h"

namespace skippy_stage {

// Stores one chunk's K [n_embd_kv, n] and V [n_embd_kv, n] in cache cells `cells`.  K rows
// are cells; V is kept transposed (one row of ctx_size cells per V dimension, as llama.cpp
// does without flash attention), so attention reads V^T in place instead of copying it.
// The CPU backend runs nodes in graph order, so expanding the stores first makes the cache
// reads of attend() see them.
void store_kv(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * kc, ggml_tensor * vc, ggml_tensor * k,
              ggml_tensor * v, ggml_tensor * cells) {
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, kc, k, cells));
    // element (cell c, dim d) as row c of plane d; the one index vector broadcasts over planes
    const int64_t n_embd_kv = v->ne[0], ctx_size = vc->ne[0];
    ggml_tensor * dst = ggml_view_3d(ctx, vc, 1, ctx_size, n_embd_kv, ggml_element_size(vc), vc->nb[1], 0);
    ggml_tensor * src = ggml_view_3d(ctx, v, 1, v->ne[1], n_embd_kv, v->nb[1], ggml_element_size(v), 0);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, dst, src, cells));
}

// Attention of q [hd, n_head, n] over the first n_kv cells (mask [n_kv, n]); [hd * n_head, n].
ggml_tensor * attend(ggml_context * ctx, const skippy_model * m, ggml_tensor * kc, ggml_tensor * vc,
                     ggml_tensor * q, int n_kv, ggml_tensor * mask) {
    const int hd = m->head_dim;
    const int64_t n = q->ne[2];
    ggml_tensor * kp = ggml_view_3d(ctx, kc, hd, n_kv, m->n_head_kv, kc->nb[1], (size_t) hd * ggml_element_size(kc), 0);
    ggml_tensor * qp = ggml_permute(ctx, q, 0, 2, 1, 3);  // [hd, n, n_head]
    ggml_tensor * kq = ggml_mul_mat(ctx, kp, qp);          // [n_kv, n, n_head]; GQA by broadcast
    kq = ggml_soft_max_ext(ctx, kq, mask, 1.0f / sqrtf((float) hd), 0.0f);
    ggml_tensor * vt = ggml_view_3d(ctx, vc, n_kv, hd, m->n_head_kv, vc->nb[1], (size_t) hd * vc->nb[1], 0);
    ggml_tensor * kqv = ggml_mul_mat(ctx, vt, kq);  // [hd, n, n_head]
    return ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), (int64_t) hd * m->n_head, n);
}

// Builds the stage graph for n rows over n_kv cache cells into the model's cached slot.
// The graph depends only on (session KV tensors, n, n_kv, logit rows); the cache position
// enters through input tensors (row indices, positions, mask), never through view offsets.
result build_graph(skippy_session * s, int n, int n_kv, logit_rows lr) {
    skippy_model * m = s->model;
    graph_cache & g = m->cache;
    if (g.ctx) {
        ggml_free(g.ctx);
        g = graph_cache();
    }
    const int hd = m->head_dim;
    const int64_t n_embd_kv = (int64_t) m->n_head_kv * hd;
    ggml_init_params ip = {/*.mem_size =*/m->graph_meta.size(), /*.mem_buffer =*/m->graph_meta.data(),
                           /*.no_alloc =*/true};
    ggml_context * ctx = ggml_init(ip);
    if (!ctx) return err(SKIPPY_STATUS_RUNTIME_ERROR, "ggml_init failed for the graph");
    g.ctx = ctx;
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, m->graph_nodes, false);
    g.gf = gf;

    ggml_tensor * x;
    if (m->is_source) {
        g.inp_tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
        ggml_set_input(g.inp_tokens);
        x = ggml_get_rows(ctx, m->tok_embd, g.inp_tokens);
    } else {
        g.inp_rows = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, m->n_embd, n);
        ggml_set_input(g.inp_rows);
        x = g.inp_rows;
    }
    g.inp_pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_input(g.inp_pos);
    g.inp_cells = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n);
    ggml_set_input(g.inp_cells);
    g.inp_mask = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_kv, n);
    ggml_set_input(g.inp_mask);
    for (size_t li = 0; li < m->layers.size(); li++) {
        const stage_layer & L = m->layers[li];
        ggml_tensor * kc = s->k[li];
        ggml_tensor * vc = s->v[li];
        ggml_tensor * cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, m->eps), L.attn_norm);

        ggml_tensor * q = ggml_reshape_3d(ctx, weight_product(ctx, L.wq, cur), hd, m->n_head, n);
        ggml_tensor * k = ggml_reshape_3d(ctx, weight_product(ctx, L.wk, cur), hd, m->n_head_kv, n);
        ggml_tensor * v = weight_product(ctx, L.wv, cur);
        // llama GGUF: RoPE mode NORMAL (adjacent pairs), runtime.md §5.3.
        q = ggml_rope_ext(ctx, q, g.inp_pos, m->rope_freqs, m->n_rot, 0, m->n_ctx_train, m->freq_base,
                          m->freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);
        k = ggml_rope_ext(ctx, k, g.inp_pos, m->rope_freqs, m->n_rot, 0, m->n_ctx_train, m->freq_base,
                          m->freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);

        store_kv(ctx, gf, kc, vc, ggml_reshape_2d(ctx, k, n_embd_kv, n), v, g.inp_cells);
        cur = attend(ctx, m, kc, vc, q, n_kv, g.inp_mask);
        x = ggml_add(ctx, x, weight_product(ctx, L.wo, cur));

        cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, m->eps), L.ffn_norm);
        ggml_tensor * gate = weight_product(ctx, L.w_gate, cur);
        ggml_tensor * up = weight_product(ctx, L.w_up, cur);
        cur = ggml_swiglu_split(ctx, gate, up);
        x = ggml_add(ctx, x, weight_product(ctx, L.w_down, cur));
    }

    if (!m->is_terminal) {
        g.out_x = x;
        ggml_set_output(x);
        ggml_build_forward_expand(gf, x);
    } else if (lr != logit_rows::none) {
        ggml_tensor * h = x;
        if (lr == logit_rows::last && n > 1) {
            h = ggml_view_2d(ctx, x, m->n_embd, 1, x->nb[1], (size_t) (n - 1) * x->nb[1]);
        }
        h = ggml_mul(ctx, ggml_rms_norm(ctx, h, m->eps), m->output_norm);
        g.out_logits = weight_product(ctx, m->output, h);  // only the rows that are needed
        ggml_set_output(g.out_logits);
        ggml_build_forward_expand(gf, g.out_logits);
    } else {
        ggml_build_forward_expand(gf, x);
    }
    if (!ggml_gallocr_alloc_graph(m->galloc, gf)) {
        ggml_free(g.ctx);
        g = graph_cache();
        return err(SKIPPY_STATUS_RUNTIME_ERROR, "cannot allocate the compute graph");
    }
    g.session = s;
    g.n = n;
    g.n_kv = n_kv;
    g.lr = (int) lr;
    return {};
}

// One graph evaluation of n rows at cache cells [base, base + n).  Writes exported rows to
// out_rows (non-terminal, n * n_embd floats) and logits to out_logits (terminal; 1 or n rows).
result eval_chunk(skippy_session * s, const int32_t * tokens, const uint8_t * in_rows,
                  const int32_t * pos, int n, uint64_t base, logit_rows lr, void * out_rows,
                  float * out_logits) {
    skippy_model * m = s->model;
    const int n_used = (int) base + n;
    const int n_kv = std::min(m->ctx_size, (n_used + KV_PAD - 1) / KV_PAD * KV_PAD);
    graph_cache & g = m->cache;
    if (!(g.ctx && g.session == s && g.n == n && g.n_kv == n_kv && g.lr == (int) lr)) {
        result r = build_graph(s, n, n_kv, lr);
        if (!r.is_ok()) return r;
    }
    if (g.inp_tokens) ggml_backend_tensor_set(g.inp_tokens, tokens, 0, sizeof(int32_t) * n);
    if (g.inp_rows) ggml_backend_tensor_set(g.inp_rows, in_rows, 0, 4ull * m->n_embd * n);
    ggml_backend_tensor_set(g.inp_pos, pos, 0, sizeof(int32_t) * n);
    {
        std::vector<int64_t> cells(n);
        for (int i = 0; i < n; i++) cells[i] = (int64_t) base + i;
        ggml_backend_tensor_set(g.inp_cells, cells.data(), 0, sizeof(int64_t) * n);
    }
    {
        // causal mask by position: cell j < n_used is visible to row i iff pos(j) <= pos(i);
        // padding cells j >= n_used are never visible
        float * mask = static_cast<float *>(g.inp_mask->data);
        std::vector<float> host;
        if (!ggml_backend_buffer_is_host(g.inp_mask->buffer)) {
            host.resize((size_t) n_kv * n);
            mask = host.data();
        }
        const float ninf = -std::numeric_limits<float>::infinity();
        for (int i = 0; i < n; i++) {
            float * row = mask + (size_t) i * n_kv;
            const int32_t pi = pos[i];
            for (int j = 0; j < n_used; j++) row[j] = s->cell_pos[j] <= pi ? 0.0f : ninf;
            for (int j = n_used; j < n_kv; j++) row[j] = ninf;
        }
        if (!host.empty()) ggml_backend_tensor_set(g.inp_mask, host.data(), 0, host.size() * sizeof(float));
    }
    if (result computed = compute_result(ggml_backend_graph_compute(m->backend, g.gf)); !computed.is_ok()) {
        return computed;
    }
    if (g.out_x && out_rows) ggml_backend_tensor_get(g.out_x, out_rows, 0, ggml_nbytes(g.out_x));
    if (g.out_logits && out_logits) ggml_backend_tensor_get(g.out_logits, out_logits, 0, ggml_nbytes(g.out_logits));
    return {};
}

// Runs n rows in chunks of n_batch under the model's compute lock.  Nothing visible to the
// caller changes here except the cache cells beyond n_past (unused until n_past moves).
result execute(skippy_session * s, const int32_t * tokens, size_t n, const int32_t * positions,
               const void * in_payload, logit_rows lr, void * out_rows, std::vector<float> * logits) {
    skippy_model * m = s->model;
    std::vector<int32_t> pos(n);
    for (size_t i = 0; i < n; i++) {
        pos[i] = positions ? positions[i] : (int32_t) (s->n_past + i);
    }
    if (m->is_terminal && lr != logit_rows::none) {
        logits->assign((lr == logit_rows::all ? n : 1) * (size_t) m->n_vocab, 0.0f);
    }
    std::lock_guard<std::mutex> lock(m->compute_mutex);
    const size_t row_bytes = 4ull * m->n_embd;
    for (size_t done = 0; done < n;) {
        const size_t c = std::min(n - done, (size_t) m->n_batch);
        const bool last_chunk = done + c == n;
        const uint64_t base = s->n_past + done;
        for (size_t i = 0; i < c; i++) s->cell_pos[base + i] = pos[done + i];
        // Tiny graphs (under ~4M weight multiply-adds) lose more to ggml's spinning thread
        // barriers than they gain, and collapse when the cores are oversubscribed.
        const int want_threads = m->weight_elems * (double) c < 4e6 ? 1 : m->n_threads;
        if (want_threads != m->threads_now) {
            ggml_backend_cpu_set_n_threads(m->backend, want_threads);
            m->threads_now = want_threads;
        }
        logit_rows clr = logit_rows::none;
        float * lout = nullptr;
        if (m->is_terminal && lr == logit_rows::all) {
            clr = logit_rows::all;
            lout = logits->data() + done * (size_t) m->n_vocab;
        } else if (m->is_terminal && lr == logit_rows::last && last_chunk) {
            clr = logit_rows::last;
            lout = logits->data();
        }
        result r = eval_chunk(s, tokens + done, in_payload ? static_cast<const uint8_t *>(in_payload) + done * row_bytes : nullptr,
                              pos.data() + done, (int) c, base, clr,
                              out_rows ? static_cast<uint8_t *>(out_rows) + done * row_bytes : nullptr, lout);
        if (!r.is_ok()) return r;
        done += c;
    }
    return {};
}

}  // namespace skippy_stage
