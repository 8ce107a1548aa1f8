// skippy_stage.cpp — llama layer-range stage on the ggml CPU backend.
// The contract is the opening comment of skippy_stage.h; runtime.md §4–§5 is the design.

#include "skippy_stage.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "gguf.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

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

namespace {

// ---------------------------------------------------------------------------------------
// errors and logging

std::string strf(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
std::string strf(const char * fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

skippy_status fail(skippy_error ** out_error, skippy_status status, const std::string & message) {
    if (out_error) {
        auto * e = static_cast<skippy_error *>(std::malloc(sizeof(skippy_error)));
        if (e) {
            e->status = status;
            e->message = strdup(message.c_str());
        }
        *out_error = e;
    }
    return status;
}

skippy_status ok(skippy_error ** out_error) {
    if (out_error) {
        *out_error = nullptr;
    }
    return SKIPPY_STATUS_OK;
}

// A status plus message, used internally before it becomes a skippy_error.
struct result {
    skippy_status status = SKIPPY_STATUS_OK;
    std::string message;
    bool is_ok() const { return status == SKIPPY_STATUS_OK; }
};

result err(skippy_status s, std::string m) { return {s, std::move(m)}; }

skippy_status finish(skippy_error ** out_error, const result & r) {
    return r.is_ok() ? ok(out_error) : fail(out_error, r.status, r.message);
}

std::mutex g_log_mutex;
skippy_stage_log_callback g_log_cb = nullptr;
void * g_log_ud = nullptr;

void log_trampoline(enum ggml_log_level level, const char * text, void *) {
    skippy_stage_log_callback cb;
    void * ud;
    {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        cb = g_log_cb;
        ud = g_log_ud;
    }
    if (cb) {
        cb(static_cast<int>(level), text, ud);
    }
}

std::once_flag g_log_once;
void ensure_log_installed() {
    // ggml prints to stderr by default; the contract says quiet unless asked.
    std::call_once(g_log_once, [] { ggml_log_set(log_trampoline, nullptr); });
}

// ---------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4), for the activation identities (skippy_stage.h §3).

struct sha256 {
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                     0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    uint8_t block[64];
    size_t used = 0;
    uint64_t total = 0;

    static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

    void compress(const uint8_t * p) {
        static const uint32_t k[64] = {
            0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
            0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
            0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
            0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
            0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
            0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
            0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
            0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
            0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
            0xc67178f2};
        uint32_t w[64];
        for (int i = 0; i < 16; i++) {
            w[i] = (uint32_t) p[4 * i] << 24 | (uint32_t) p[4 * i + 1] << 16 |
                   (uint32_t) p[4 * i + 2] << 8 | (uint32_t) p[4 * i + 3];
        }
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
        for (int i = 0; i < 64; i++) {
            uint32_t S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
            uint32_t ch = (e & f) ^ (~e & g);
            uint32_t t1 = hh + S1 + ch + k[i] + w[i];
            uint32_t S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
            uint32_t mj = (a & b) ^ (a & c) ^ (b & c);
            uint32_t t2 = S0 + mj;
            hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
    }

    void update(const void * data, size_t n) {
        const uint8_t * p = static_cast<const uint8_t *>(data);
        total += n;
        while (n > 0) {
            size_t take = std::min(n, sizeof(block) - used);
            memcpy(block + used, p, take);
            used += take; p += take; n -= take;
            if (used == 64) { compress(block); used = 0; }
        }
    }
    void u32(uint32_t v) { uint8_t b[4] = {(uint8_t) v, (uint8_t) (v >> 8), (uint8_t) (v >> 16), (uint8_t) (v >> 24)}; update(b, 4); }
    void i64(int64_t v) { uint64_t u = (uint64_t) v; u32((uint32_t) u); u32((uint32_t) (u >> 32)); }

    void final(uint8_t out[32]) {
        uint64_t bits = total * 8;
        uint8_t pad = 0x80;
        update(&pad, 1);
        uint8_t zero = 0;
        while (used != 56) update(&zero, 1);
        uint8_t len[8];
        for (int i = 0; i < 8; i++) len[i] = (uint8_t) (bits >> (56 - 8 * i));
        update(len, 8);
        for (int i = 0; i < 8; i++) {
            out[4 * i] = (uint8_t) (h[i] >> 24); out[4 * i + 1] = (uint8_t) (h[i] >> 16);
            out[4 * i + 2] = (uint8_t) (h[i] >> 8); out[4 * i + 3] = (uint8_t) h[i];
        }
    }
};

// ---------------------------------------------------------------------------------------
// GGUF metadata helpers

bool gguf_int(const gguf_context * g, const std::string & key, int64_t * out) {
    int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
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
    int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_FLOAT32: *out = gguf_get_val_f32(g, id); return true;
        case GGUF_TYPE_FLOAT64: *out = gguf_get_val_f64(g, id); return true;
        default: return false;
    }
}

int physical_cores() {
    // Pairs (package, core) from sysfs; capped by the affinity mask (containers, taskset).
    std::set<std::pair<int, int>> cores;
    for (int cpu = 0; cpu < 4096; cpu++) {
        char path[128];
        int core = -1, pkg = -1;
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/core_id", cpu);
        FILE * f = fopen(path, "r");
        if (!f) break;
        if (fscanf(f, "%d", &core) != 1) core = cpu;
        fclose(f);
        snprintf(path, sizeof(path), "/sys/devices/system/cpu/cpu%d/topology/physical_package_id", cpu);
        f = fopen(path, "r");
        if (f) {
            if (fscanf(f, "%d", &pkg) != 1) pkg = 0;
            fclose(f);
        }
        cores.insert({pkg, core});
    }
    int n = (int) cores.size();
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        int allowed = CPU_COUNT(&set);
        if (n == 0 || allowed < n) n = allowed;
    }
    if (n <= 0) n = (int) std::max(1u, std::thread::hardware_concurrency());
    return n;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// model and session

struct stage_layer {
    ggml_tensor * attn_norm = nullptr;
    ggml_tensor * wq = nullptr;
    ggml_tensor * wk = nullptr;
    ggml_tensor * wv = nullptr;
    ggml_tensor * wo = nullptr;
    ggml_tensor * ffn_norm = nullptr;
    ggml_tensor * w_gate = nullptr;
    ggml_tensor * w_up = nullptr;
    ggml_tensor * w_down = nullptr;
};

// The last built graph of a model, kept for reuse while the shape stays the same.
struct graph_cache {
    ggml_context * ctx = nullptr;  // lives in skippy_model::graph_meta
    ggml_cgraph * gf = nullptr;
    const skippy_session * session = nullptr;
    int n = 0, n_kv = 0, lr = -1;
    ggml_tensor * inp_tokens = nullptr;
    ggml_tensor * inp_rows = nullptr;
    ggml_tensor * inp_pos = nullptr;
    ggml_tensor * inp_cells = nullptr;
    ggml_tensor * inp_mask = nullptr;
    ggml_tensor * out_x = nullptr;
    ggml_tensor * out_logits = nullptr;
};

struct skippy_model {
    // hyper-parameters (from GGUF)
    std::string arch;
    int n_layer = 0, n_embd = 0, n_vocab = 0, n_head = 0, n_head_kv = 0, head_dim = 0;
    int n_ff = 0, n_rot = 0, n_ctx_train = 0;
    float eps = 1e-5f, freq_base = 10000.0f, freq_scale = 1.0f;
    int32_t eos_id = -1, eot_id = -1;

    // config
    int stage_index = 0, layer_start = 0, layer_end = 0;
    int ctx_size = 0, lane_count = 0, n_threads = 0, n_batch = 0;
    bool is_source = false, is_terminal = false;

    // ggml handles (freed in reverse order)
    ggml_backend_t backend = nullptr;
    ggml_threadpool_t threadpool = nullptr;  // persistent workers (n_threads > 1)
    ggml_context * wctx = nullptr;
    ggml_backend_buffer_t wbuf = nullptr;
    ggml_gallocr_t galloc = nullptr;
    std::vector<uint8_t> graph_meta;  // no_alloc context memory for graph building
    std::vector<uint8_t> graph_meta_batch;  // the same for multi-session batch graphs
    int graph_nodes = 0;

    ggml_tensor * tok_embd = nullptr;
    ggml_tensor * output_norm = nullptr;
    ggml_tensor * output = nullptr;  // output.weight or tied token_embd
    ggml_tensor * rope_freqs = nullptr;
    std::vector<stage_layer> layers;  // index il - layer_start

    uint8_t part_identity[32] = {};
    uint8_t frontier_identity[32] = {};

    double weight_elems = 0;  // elements of the owned weights, for the thread heuristic
    int threads_now = 0;      // threads currently set on the backend

    std::atomic<int> refs{1};  // the owner's handle + one per live session
    graph_cache cache;         // guarded by compute_mutex
    std::mutex compute_mutex;  // graph_meta, galloc and cache are shared by the model's sessions
    std::mutex lane_mutex;
    std::vector<bool> lane_used;
};

struct skippy_session {
    skippy_model * model = nullptr;
    int lane = -1;
    ggml_context * kctx = nullptr;
    ggml_backend_buffer_t kbuf = nullptr;
    std::vector<ggml_tensor *> k, v;  // per owned layer: [n_embd_kv, ctx_size] F32

    std::vector<int32_t> cell_pos;  // position of each filled cache cell
    uint64_t n_past = 0;
    std::vector<int32_t> history;  // tokens fed so far (penalties)

    std::vector<float> logits;  // rows of the last execution (terminal); the last one is "current"
    size_t logits_rows = 0;
    bool has_logits = false;
    std::vector<float> last_rows;  // last export (non-terminal)
    size_t last_rows_n = 0;

    bool has_checkpoint = false;
    uint64_t ck_start = 0, ck_count = 0;

    uint64_t rng = 0;
    bool rng_ready = false;
    skippy_sampling_config rng_cfg;  // config the RNG was seeded for
};

namespace {

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

void compute_identities(skippy_model * m) {
    std::string binding = strf("skippy_wire/llama/residual/%d/f32", m->n_embd);
    sha256 p;
    p.update(binding.data(), binding.size());
    p.final(m->part_identity);
    sha256 f;
    const char * tag = "skippy_wire/frontier/v1";
    f.update(tag, strlen(tag));
    f.u32(1);
    f.update(m->part_identity, 32);
    f.u32(GGML_TYPE_F32);
    f.u32(2);
    f.u32(1);  // token_axis (as i32 little-endian)
    f.i64(m->n_embd);
    f.final(m->frontier_identity);
}

void fill_part(const skippy_model * m, skippy_activation_part_desc * p, int64_t n_tokens) {
    memset(p, 0, sizeof(*p));
    memcpy(p->identity, m->part_identity, 32);
    p->ggml_type = GGML_TYPE_F32;
    p->rank = 2;
    p->token_axis = 1;
    p->flags = 0;
    p->dimensions[0] = m->n_embd;
    p->dimensions[1] = n_tokens;  // -1 in a boundary
    p->byte_strides[0] = 4;
    p->byte_strides[1] = 4ull * (uint64_t) m->n_embd;
    p->payload_offset = 0;
    p->payload_bytes = n_tokens > 0 ? 4ull * (uint64_t) m->n_embd * (uint64_t) n_tokens : 0;
}

void empty_desc(skippy_activation_desc * d) {
    if (!d) return;
    memset(d, 0, sizeof(*d));
    d->producer_stage_index = -1;
}

void fill_output_desc(const skippy_model * m, skippy_activation_desc * d, size_t n) {
    if (!d) return;
    if (m->is_terminal) {
        empty_desc(d);
        return;
    }
    memset(d, 0, sizeof(*d));
    d->version = SKIPPY_ACTIVATION_FRAME_VERSION;
    d->producer_stage_index = m->stage_index;
    d->layer_start = m->layer_start;
    d->layer_end = m->layer_end;
    d->token_count = (uint32_t) n;
    d->sequence_count = 1;
    d->part_count = 1;
    d->payload_bytes = 4ull * (uint64_t) m->n_embd * n;
    memcpy(d->frontier_identity, m->frontier_identity, 32);
    fill_part(m, &d->parts[0], (int64_t) n);
}

void fill_boundary(const skippy_model * m, skippy_activation_boundary_desc * b) {
    memset(b, 0, sizeof(*b));
    b->version = SKIPPY_ACTIVATION_BOUNDARY_DESC_VERSION;
    b->part_count = 1;
    memcpy(b->frontier_identity, m->frontier_identity, 32);
    fill_part(m, &b->parts[0], -1);
}

size_t output_bytes_for(const skippy_model * m, size_t n) {
    return m->is_terminal ? 0 : 4ull * (size_t) m->n_embd * n;
}

// ---- open ----------------------------------------------------------------------------

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

result model_load(skippy_model * m, const char * path, const skippy_stage_config * cfg) {
    file_guard fg;
    fg.f = fopen(path, "rb");
    if (!fg.f) {
        return err(SKIPPY_STATUS_IO_ERROR, strf("cannot open model file '%s': %s", path, strerror(errno)));
    }
    gguf_guard gg;
    gguf_init_params gp = {/*.no_alloc =*/true, /*.ctx =*/&gg.meta};
    gg.g = gguf_init_from_file(path, gp);
    if (!gg.g || !gg.meta) {
        return err(SKIPPY_STATUS_MODEL_ERROR, strf("'%s' is not a readable GGUF file", path));
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

    // config (runtime.md §1.2 admission rules)
    m->stage_index = cfg->stage_index;
    m->layer_start = cfg->layer_start;
    m->layer_end = cfg->layer_end < 0 ? m->n_layer : cfg->layer_end;
    if (m->layer_start < 0 || m->layer_start >= m->layer_end || m->layer_end > m->n_layer) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                   strf("invalid layer range [%d, %d) for a model with %d layers", cfg->layer_start,
                        cfg->layer_end, m->n_layer));
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
    for (auto & w : want) {
        int64_t id = gguf_find_tensor(g, w.name.c_str());
        ggml_tensor * meta = id >= 0 ? ggml_get_tensor(gg.meta, w.name.c_str()) : nullptr;
        if (!meta) return err(SKIPPY_STATUS_MODEL_ERROR, strf("GGUF has no tensor %s", w.name.c_str()));
        if (!(r = check_shape(meta, w.name.c_str(), w.ne0, w.ne1)).is_ok()) return r;
        bool is_vector = w.ne1 == 1;
        if (is_vector && meta->type != GGML_TYPE_F32) {
            return err(SKIPPY_STATUS_MODEL_ERROR, strf("tensor %s must be F32", w.name.c_str()));
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

// ---- validation ----------------------------------------------------------------------

bool sampling_enabled(const skippy_sampling_config * s) {
    return s && s->version != 0 && s->flags != 0;  // runtime.md §2.4
}

result validate_sampling(const skippy_sampling_config * s) {
    if (!sampling_enabled(s)) return {};
    if (s->version != SKIPPY_SAMPLING_CONFIG_VERSION) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT, strf("sampling config version %u is not 2", s->version));
    }
    if (s->logit_bias_count > SKIPPY_MAX_LOGIT_BIAS) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT, strf("%u logit biases exceed the limit of 256", s->logit_bias_count));
    }
    if (s->sampler_count > SKIPPY_MAX_SAMPLERS) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT, strf("%u samplers exceed the limit of 16", s->sampler_count));
    }
    if (s->dry_sequence_breaker_count > SKIPPY_MAX_DRY_SEQUENCE_BREAKERS) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT, "more than 8 DRY sequence breakers");
    }
    return {};
}

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
    if (in->part_count != 1) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT, strf("activation frame has %u parts, expected 1", in->part_count));
    }
    const uint64_t expect = 4ull * (uint64_t) m->n_embd * n;
    const skippy_activation_part_desc & p = in->parts[0];
    if (p.ggml_type != GGML_TYPE_F32 || p.rank != 2 || p.token_axis != 1 || p.flags != 0 ||
        p.dimensions[0] != m->n_embd || p.dimensions[1] != (int64_t) n || p.byte_strides[0] != 4 ||
        p.byte_strides[1] != 4ull * (uint64_t) m->n_embd || p.payload_offset != 0 || p.payload_bytes != expect) {
        return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                   strf("activation part must be F32 [%d, %zu] token-major (type %u, rank %u, dims [%lld, %lld])",
                        m->n_embd, n, p.ggml_type, p.rank, (long long) p.dimensions[0], (long long) p.dimensions[1]));
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

// ---- graph --------------------------------------------------------------------------

enum class logit_rows { none, last, all };

// KV views cover n_kv rounded up to this many cells, so consecutive decode steps have the
// same graph shape and reuse the built + allocated graph (the extra cells are masked).
constexpr int KV_PAD = 64;

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
    const float kq_scale = 1.0f / sqrtf((float) hd);

    for (size_t li = 0; li < m->layers.size(); li++) {
        const stage_layer & L = m->layers[li];
        ggml_tensor * kc = s->k[li];
        ggml_tensor * vc = s->v[li];
        ggml_tensor * cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, m->eps), L.attn_norm);

        ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wq, cur), hd, m->n_head, n);
        ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wk, cur), hd, m->n_head_kv, n);
        ggml_tensor * v = ggml_mul_mat(ctx, L.wv, cur);
        // llama GGUF: RoPE mode NORMAL (adjacent pairs), runtime.md §5.3.
        q = ggml_rope_ext(ctx, q, g.inp_pos, m->rope_freqs, m->n_rot, 0, m->n_ctx_train, m->freq_base,
                          m->freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);
        k = ggml_rope_ext(ctx, k, g.inp_pos, m->rope_freqs, m->n_rot, 0, m->n_ctx_train, m->freq_base,
                          m->freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);

        // Store this chunk's K/V in cells inp_cells; the CPU backend runs nodes in graph
        // order, so expanding the stores first makes the cache reads below see them.
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, kc, ggml_reshape_2d(ctx, k, n_embd_kv, n), g.inp_cells));
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, vc, v, g.inp_cells));

        ggml_tensor * kv_k = ggml_view_3d(ctx, kc, hd, m->n_head_kv, n_kv, (size_t) hd * sizeof(float), kc->nb[1], 0);
        ggml_tensor * kv_v = ggml_view_3d(ctx, vc, hd, m->n_head_kv, n_kv, (size_t) hd * sizeof(float), vc->nb[1], 0);
        ggml_tensor * qp = ggml_permute(ctx, q, 0, 2, 1, 3);     // [hd, n, n_head]
        ggml_tensor * kp = ggml_permute(ctx, kv_k, 0, 2, 1, 3);  // [hd, n_kv, n_head_kv]
        ggml_tensor * kq = ggml_mul_mat(ctx, kp, qp);            // [n_kv, n, n_head]; GQA by broadcast
        kq = ggml_soft_max_ext(ctx, kq, g.inp_mask, kq_scale, 0.0f);
        ggml_tensor * vt = ggml_cont(ctx, ggml_permute(ctx, kv_v, 1, 2, 0, 3));  // [n_kv, hd, n_head_kv]
        ggml_tensor * kqv = ggml_mul_mat(ctx, vt, kq);                            // [hd, n, n_head]
        cur = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), (int64_t) hd * m->n_head, n);
        x = ggml_add(ctx, x, ggml_mul_mat(ctx, L.wo, cur));

        cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, m->eps), L.ffn_norm);
        ggml_tensor * gate = ggml_mul_mat(ctx, L.w_gate, cur);
        ggml_tensor * up = ggml_mul_mat(ctx, L.w_up, cur);
        cur = ggml_swiglu_split(ctx, gate, up);
        x = ggml_add(ctx, x, ggml_mul_mat(ctx, L.w_down, cur));
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
        g.out_logits = ggml_mul_mat(ctx, m->output, h);  // only the rows that are needed
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
    if (ggml_backend_graph_compute(m->backend, g.gf) != GGML_STATUS_SUCCESS) {
        return err(SKIPPY_STATUS_RUNTIME_ERROR, "ggml graph compute failed");
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

// ---- sampling -----------------------------------------------------------------------

uint64_t splitmix64(uint64_t * state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int32_t argmax(const float * l, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++) {
        if (l[i] > l[best]) best = i;  // first max wins
    }
    return best;
}

// Samples one row; `hist` is the history the penalties see (skippy_stage.h §5).
int32_t sample_row(skippy_session * s, const float * row, const skippy_sampling_config * cfg,
                   const int32_t * hist, size_t hist_n) {
    const skippy_model * m = s->model;
    const int nv = m->n_vocab;
    if (!sampling_enabled(cfg)) return argmax(row, nv);

    if (!s->rng_ready || memcmp(&s->rng_cfg, cfg, sizeof(*cfg)) != 0) {
        s->rng = cfg->seed ? cfg->seed : 0xFFFFFFFFull;
        s->rng_cfg = *cfg;
        s->rng_ready = true;
    }
    std::vector<float> l(row, row + nv);
    float repeat = cfg->repeat_penalty == 0.0f ? 1.0f : cfg->repeat_penalty;
    if (repeat != 1.0f || cfg->frequency_penalty != 0.0f || cfg->presence_penalty != 0.0f) {
        size_t last_n = cfg->penalty_last_n <= 0 ? hist_n : std::min(hist_n, (size_t) cfg->penalty_last_n);
        std::unordered_map<int32_t, int> counts;
        for (size_t i = hist_n - last_n; i < hist_n; i++) counts[hist[i]]++;
        for (auto & [tok, c] : counts) {
            if (tok < 0 || tok >= nv) continue;
            float & x = l[tok];
            x = x <= 0 ? x * repeat : x / repeat;  // llama.cpp penalties
            x -= (float) c * cfg->frequency_penalty + (c > 0 ? 1.0f : 0.0f) * cfg->presence_penalty;
        }
    }
    for (uint32_t i = 0; i < cfg->logit_bias_count; i++) {
        int32_t t = cfg->logit_bias[i].token;
        if (t >= 0 && t < nv) l[t] += cfg->logit_bias[i].bias;
    }
    if ((cfg->flags & SKIPPY_SAMPLING_FLAG_IGNORE_EOS) || cfg->ignore_eos) {
        const float ninf = -std::numeric_limits<float>::infinity();
        if (m->eos_id >= 0 && m->eos_id < nv) l[m->eos_id] = ninf;
        if (m->eot_id >= 0 && m->eot_id < nv) l[m->eot_id] = ninf;
    }

    // candidates sorted by logit descending, ties by id
    std::vector<int32_t> cand(nv);
    for (int i = 0; i < nv; i++) cand[i] = i;
    auto by_logit = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
    size_t keep = nv;
    if (cfg->top_k > 0 && cfg->top_k < nv) {
        keep = (size_t) cfg->top_k;
        std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(), by_logit);
        cand.resize(keep);
    } else {
        std::sort(cand.begin(), cand.end(), by_logit);
    }
    auto probs = [&](std::vector<double> & p, float temp) {
        p.resize(cand.size());
        double mx = l[cand[0]], sum = 0;
        for (size_t i = 0; i < cand.size(); i++) { p[i] = std::exp(((double) l[cand[i]] - mx) / temp); sum += p[i]; }
        for (auto & x : p) x /= sum;
    };
    std::vector<double> p;
    if (cfg->top_p > 0.0f && cfg->top_p < 1.0f) {
        probs(p, 1.0f);
        double cum = 0;
        size_t cut = cand.size();
        for (size_t i = 0; i < cand.size(); i++) {
            cum += p[i];
            if (cum >= cfg->top_p) { cut = i + 1; break; }
        }
        cand.resize(std::max<size_t>(cut, 1));
    }
    if (cfg->min_p > 0.0f && cfg->min_p < 1.0f) {
        const float thr = l[cand[0]] + logf(cfg->min_p);
        size_t cut = 1;
        while (cut < cand.size() && l[cand[cut]] >= thr) cut++;
        cand.resize(cut);
    }
    if (!(cfg->temperature > 0.0f)) return cand[0];
    probs(p, cfg->temperature);
    const double u = (double) (splitmix64(&s->rng) >> 11) * (1.0 / 9007199254740992.0);
    double cum = 0;
    for (size_t i = 0; i < cand.size(); i++) {
        cum += p[i];
        if (u < cum) return cand[i];
    }
    return cand.back();
}

// ---- one request ---------------------------------------------------------------------

enum class call_kind { prefill, decode, verify };

struct request_io {
    const int32_t * tokens = nullptr;
    size_t n = 0;
    const int32_t * positions = nullptr;
    size_t position_count = 0;
    const skippy_sampling_config * sampling = nullptr;
    const skippy_activation_desc * in_desc = nullptr;
    const void * in_payload = nullptr;
    skippy_activation_desc * out_desc = nullptr;
    void * out_payload = nullptr;
    size_t capacity = 0;
    size_t * out_bytes = nullptr;
    bool sample = false;            // terminal: sample the last row
    int32_t * out_token = nullptr;  // prefill/decode predicted token
    int32_t * out_tokens = nullptr; // verify: one per row
    size_t token_capacity = 0;
    size_t * out_token_count = nullptr;
};

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

// Steps (d)–(e); `prepare` must have returned OK.
result run_prepared(skippy_session * s, call_kind kind, request_io & io) {
    skippy_model * m = s->model;
    const logit_rows lr = !m->is_terminal ? logit_rows::none : kind == call_kind::verify ? logit_rows::all : logit_rows::last;
    std::vector<float> logits;
    const bool use_pos = io.positions && io.position_count > 0;
    result r = execute(s, io.tokens, io.n, use_pos ? io.positions : nullptr,
                       m->is_source ? nullptr : io.in_payload, lr, io.out_payload, &logits);
    if (!r.is_ok()) return r;
    commit(s, kind, io, logits);
    return {};
}

// Several prepared prefill/decode requests (distinct sessions of one model, each within
// n_batch rows in total) as ONE graph: the weight matmuls run over all rows together and
// attention runs per session over its own cache.  All or nothing: on failure no session
// moves.  Falls back to one request at a time when the rows exceed n_batch.
result run_prepared_batch(skippy_model * m, call_kind kind, std::vector<skippy_session *> & ss,
                          std::vector<request_io> & ios) {
    const size_t R = ss.size();
    size_t total = 0;
    for (auto & io : ios) total += io.n;
    if (R < 2 || total > (size_t) m->n_batch) {
        for (size_t i = 0; i < R; i++) {
            result r = run_prepared(ss[i], kind, ios[i]);
            if (!r.is_ok()) return err(r.status, strf("request %zu: %s", i, r.message.c_str()));
        }
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
    const float kq_scale = 1.0f / sqrtf((float) hd);
    for (size_t li = 0; li < m->layers.size(); li++) {
        const stage_layer & L = m->layers[li];
        ggml_tensor * cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, m->eps), L.attn_norm);
        ggml_tensor * q = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wq, cur), hd, m->n_head, N);
        ggml_tensor * k = ggml_reshape_3d(ctx, ggml_mul_mat(ctx, L.wk, cur), hd, m->n_head_kv, N);
        ggml_tensor * v = ggml_mul_mat(ctx, L.wv, cur);
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
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, kc, ggml_view_2d(ctx, k2, n_embd_kv, nr, k2->nb[1], (size_t) off[r] * k2->nb[1]), cells[r]));
            ggml_build_forward_expand(gf, ggml_set_rows(ctx, vc, ggml_view_2d(ctx, v, n_embd_kv, nr, v->nb[1], (size_t) off[r] * v->nb[1]), cells[r]));
            ggml_tensor * qr = ggml_view_3d(ctx, q, hd, m->n_head, nr, q->nb[1], q->nb[2], (size_t) off[r] * q->nb[2]);
            ggml_tensor * kv_k = ggml_view_3d(ctx, kc, hd, m->n_head_kv, n_kv[r], (size_t) hd * sizeof(float), kc->nb[1], 0);
            ggml_tensor * kv_v = ggml_view_3d(ctx, vc, hd, m->n_head_kv, n_kv[r], (size_t) hd * sizeof(float), vc->nb[1], 0);
            ggml_tensor * kq = ggml_mul_mat(ctx, ggml_permute(ctx, kv_k, 0, 2, 1, 3), ggml_permute(ctx, qr, 0, 2, 1, 3));
            kq = ggml_soft_max_ext(ctx, kq, masks[r], kq_scale, 0.0f);
            ggml_tensor * vt = ggml_cont(ctx, ggml_permute(ctx, kv_v, 1, 2, 0, 3));
            ggml_tensor * kqv = ggml_mul_mat(ctx, vt, kq);
            ggml_tensor * o = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), (int64_t) hd * m->n_head, nr);
            attn = attn ? ggml_concat(ctx, attn, o, 1) : o;
        }
        x = ggml_add(ctx, x, ggml_mul_mat(ctx, L.wo, attn));
        cur = ggml_mul(ctx, ggml_rms_norm(ctx, x, m->eps), L.ffn_norm);
        cur = ggml_swiglu_split(ctx, ggml_mul_mat(ctx, L.w_gate, cur), ggml_mul_mat(ctx, L.w_up, cur));
        x = ggml_add(ctx, x, ggml_mul_mat(ctx, L.w_down, cur));
    }
    ggml_tensor * out_x = nullptr, * out_logits = nullptr;
    if (!m->is_terminal) {
        out_x = x;
        ggml_set_output(out_x);
        ggml_build_forward_expand(gf, out_x);
    } else {
        ggml_tensor * h = ggml_get_rows(ctx, x, inp_last);
        h = ggml_mul(ctx, ggml_rms_norm(ctx, h, m->eps), m->output_norm);
        out_logits = ggml_mul_mat(ctx, m->output, h);
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
    if (ggml_backend_graph_compute(m->backend, gf) != GGML_STATUS_SUCCESS) {
        return err(SKIPPY_STATUS_RUNTIME_ERROR, "ggml graph compute failed");
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

}  // namespace

// ---------------------------------------------------------------------------------------
// C API

extern "C" {

struct skippy_abi_version skippy_abi_version(void) {
    return {SKIPPY_STAGE_ABI_MAJOR, SKIPPY_STAGE_ABI_MINOR, SKIPPY_STAGE_ABI_PATCH};
}

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
    {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        g_log_cb = callback;
        g_log_ud = user_data;
    }
    ensure_log_installed();
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
    if (config->ctx_size == 0 || config->ctx_size > (1u << 24) || config->lane_count == 0 ||
        config->lane_count > 1024 || config->n_batch == 0 || config->n_threads < 0 || config->stage_index < 0) {
        return fail(out_error, SKIPPY_STATUS_INVALID_ARGUMENT,
                    strf("invalid config: ctx_size %u, lane_count %u, n_batch %u, n_threads %d, stage_index %d",
                         config->ctx_size, config->lane_count, config->n_batch, config->n_threads, config->stage_index));
    }
    ensure_log_installed();
    auto * m = new (std::nothrow) skippy_model();
    if (!m) return fail(out_error, SKIPPY_STATUS_RUNTIME_ERROR, "out of memory");
    result r = model_load(m, path, config);
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
    auto release = [&](const char * why) {
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
        s->v.push_back(ggml_new_tensor_2d(s->kctx, GGML_TYPE_F32, n_embd_kv, m->ctx_size));
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
    request_io io;
    io.tokens = token_ids; io.n = token_count; io.positions = positions; io.position_count = position_count;
    io.sampling = sampling; io.in_desc = input_desc; io.in_payload = input_payload;
    io.out_desc = output_desc; io.out_payload = output_payload; io.capacity = output_capacity; io.out_bytes = out_bytes;
    io.sample = out_predicted_token != nullptr;
    io.out_token = out_predicted_token;
    return run_single(s, call_kind::prefill, io, out_error);
}

enum skippy_status skippy_decode_step_frame_sampled(
    skippy_session_t * s, int32_t token_id, const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload, struct skippy_activation_desc * output_desc,
    void * output_payload, size_t output_capacity, size_t * out_bytes, int32_t * out_predicted_token,
    struct skippy_error ** out_error) {
    request_io io;
    io.tokens = &token_id; io.n = 1;
    io.sampling = sampling; io.in_desc = input_desc; io.in_payload = input_payload;
    io.out_desc = output_desc; io.out_payload = output_payload; io.capacity = output_capacity; io.out_bytes = out_bytes;
    io.sample = true;
    io.out_token = out_predicted_token;
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
    request_io io;
    io.tokens = token_ids; io.n = token_count;
    io.sampling = sampling; io.in_desc = input_desc; io.in_payload = input_payload;
    io.out_desc = output_desc; io.out_payload = output_payload; io.capacity = output_capacity; io.out_bytes = out_bytes;
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
