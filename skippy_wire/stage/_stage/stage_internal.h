// stage_internal.h — what the units of the stage backend share (not part of the C ABI).
// The contract is the opening comment of skippy_stage.h; runtime.md §4–§5 is the design.
//
// Units: common.cpp (errors, logging, cores), identity.cpp (SHA-256 and the activation
// identities / descriptors), model_load.cpp (GGUF open), graph.cpp (graph build and
// execution), sampling.cpp, request.cpp (validation and one request), batch.cpp (several
// sessions as one graph), abi.cpp (the extern "C" functions).
#ifndef SKIPPY_STAGE_INTERNAL_H
#define SKIPPY_STAGE_INTERNAL_H

#include "skippy_stage.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "gguf.h"

#include <sched.h>
#include <sys/mman.h>

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
    std::vector<ggml_tensor *> k, v;  // per owned layer: K [n_embd_kv, ctx_size], V^T [ctx_size, n_embd_kv]; F32

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

namespace skippy_stage {

// ---- errors and logging (common.cpp) ----

std::string strf(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
skippy_status fail(skippy_error ** out_error, skippy_status status, const std::string & message);
skippy_status ok(skippy_error ** out_error);

// A status plus message, used internally before it becomes a skippy_error.
struct result {
    skippy_status status = SKIPPY_STATUS_OK;
    std::string message;
    bool is_ok() const { return status == SKIPPY_STATUS_OK; }
};

inline result err(skippy_status s, std::string m) { return {s, std::move(m)}; }

skippy_status finish(skippy_error ** out_error, const result & r);
void ensure_log_installed();
std::string take_log_error();
void set_log_callback(skippy_stage_log_callback callback, void * user_data);
extern std::atomic<bool> g_interrupted;  // skippy_set_interrupted
bool interrupted_callback(void *);  // ggml's abort callback: reads g_interrupted
// A graph's compute status as a result (an interrupted one says so).
result compute_result(ggml_status status);
int physical_cores();

// ---- identities and descriptors (identity.cpp) ----

void compute_identities(skippy_model * m);
void fill_part(const skippy_model * m, skippy_activation_part_desc * p, int64_t n_tokens);
void empty_desc(skippy_activation_desc * d);
void fill_output_desc(const skippy_model * m, skippy_activation_desc * d, size_t n);
void fill_boundary(const skippy_model * m, skippy_activation_boundary_desc * b);
size_t output_bytes_for(const skippy_model * m, size_t n);

// ---- open (model_load.cpp) ----

void model_destroy(skippy_model * m);
result model_load(skippy_model * m, const char * path, const skippy_stage_config * cfg);

// ---- graph (graph.cpp) ----

enum class logit_rows { none, last, all };

// KV views cover n_kv rounded up to this many cells, so consecutive decode steps have the
// same graph shape and reuse the built + allocated graph (the extra cells are masked).
constexpr int KV_PAD = 64;

void store_kv(ggml_context * ctx, ggml_cgraph * gf, ggml_tensor * kc, ggml_tensor * vc, ggml_tensor * k,
              ggml_tensor * v, ggml_tensor * cells);
ggml_tensor * attend(ggml_context * ctx, const skippy_model * m, ggml_tensor * kc, ggml_tensor * vc,
                     ggml_tensor * q, int n_kv, ggml_tensor * mask);
// w x x for a weight matrix: matmul.cpp's Q4_1 / Q8_0 kernels where they apply, else ggml_mul_mat.
ggml_tensor * weight_product(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x);
result build_graph(skippy_session * s, int n, int n_kv, logit_rows lr);
result eval_chunk(skippy_session * s, const int32_t * tokens, const uint8_t * in_rows,
                  const int32_t * pos, int n, uint64_t base, logit_rows lr, void * out_rows,
                  void * out_logits);
result execute(skippy_session * s, const int32_t * tokens, size_t n, const int32_t * positions,
               const void * in_payload, logit_rows lr, void * out_rows, std::vector<float> * logits);

// ---- sampling (sampling.cpp) ----

bool sampling_enabled(const skippy_sampling_config * s);
result validate_sampling(const skippy_sampling_config * s);
int32_t sample_row(skippy_session * s, const float * row, const skippy_sampling_config * cfg,
                   const int32_t * hist, size_t hist_n);

// ---- one request (request.cpp) ----

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

result validate_request(const skippy_session * s, const int32_t * tokens, size_t n,
                        const int32_t * positions, size_t position_count,
                        const skippy_sampling_config * sampling, const skippy_activation_desc * in,
                        const void * in_payload);
result check_room(const skippy_session * s, size_t n);
result prepare(skippy_session * s, call_kind kind, request_io & io);
void commit(skippy_session * s, call_kind kind, request_io & io, std::vector<float> & logits);
result execute_prepared(skippy_session * s, call_kind kind, request_io & io, std::vector<float> & logits);
result run_prepared(skippy_session * s, call_kind kind, request_io & io);
skippy_status run_single(skippy_session * s, call_kind kind, request_io & io, skippy_error ** out_error);
void mtp_unavailable(skippy_native_mtp_draft * d);

// ---- several sessions as one graph (batch.cpp) ----

result run_prepared_batch(skippy_model * m, call_kind kind, std::vector<skippy_session *> & ss,
                          std::vector<request_io> & ios);

}  // namespace skippy_stage

#endif  // SKIPPY_STAGE_INTERNAL_H
