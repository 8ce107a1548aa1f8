/*
 * skippy_stage.h — the skippy_wire ggml stage backend (C ABI, project version 0.1.0).
 *
 * CONTRACT
 * ========
 * A *model* is one pipeline stage: a llama-architecture GGUF opened for the half-open
 * layer range [layer_start, layer_end) on the ggml CPU backend.  Only that range's tensors
 * are loaded (`blk.<i>.*`), plus `token_embd` on the source stage (layer_start == 0) and
 * `output_norm` + `output` (or the tied `token_embd`) on the terminal stage
 * (layer_end == n_layer).  `rope_freqs` is loaded by every stage when present.
 *
 * A *session* is one sequence lane of a model (at most `lane_count` live sessions).  It owns
 * its F32 K/V cache for the owned layers (`ctx_size` cells), `n_past` (= position()), the
 * token history (for penalties), the sampling RNG, the last logits (terminal) and the last
 * exported rows (non-terminal).
 *
 * 1. Every entry point returns a skippy_status (or a plain value for getters) and takes a
 *    trailing `struct skippy_error ** out_error` (may be NULL).  On failure a heap error
 *    {status, message} is stored there; on success NULL is stored.  Free it with
 *    skippy_error_free (NULL-safe).  Bad input never prints and never aborts.
 * 2. Order of work in every execution call (runtime.md §5.4):
 *      (a) validate arguments, the input frame and (batches) every request;
 *      (b) check context room: n_past + n <= ctx_size, else RUNTIME_ERROR "context full";
 *      (c) compute the required output payload size, write it to *out_output_payload_bytes
 *          and return BUFFER_TOO_SMALL if capacity < required — before anything executes;
 *      (d) build the graph, compute (GIL released by the binding);
 *      (e) copy outputs, sample (terminal: last row; verify: every row), then advance
 *          n_past and the token history.
 *    So on any non-OK status the session is unchanged.
 * 3. Frames (runtime.md §2.3): v2 ActivationDesc with ONE part: F32, rank 2, token_axis 1,
 *    dims [n_embd, n_tokens], strides [4, 4*n_embd], payload_offset 0, flags 0; the payload
 *    is the residual stream after the producer's last layer, token-major F32 rows.
 *    Part identity    = SHA-256("skippy_wire/llama/residual/<n_embd>/f32").
 *    Frontier identity = SHA-256("skippy_wire/frontier/v1" || u32le part_count ||
 *        for each part: identity[32] || u32le ggml_type || u32le rank || i32le token_axis ||
 *        i64le of every non-token dimension in order).
 *    An input frame must have version 2, part_count 1, that part layout, the same
 *    identities, token_count == n, sequence_count 1, layer_end == this stage's layer_start and
 *    payload_bytes == 4*n_embd*n.  The source stage takes no activation input
 *    (INVALID_ARGUMENT if a non-empty payload is given); every other stage requires one.
 *    Output: a non-terminal stage exports all n rows (4*n_embd*n bytes) with
 *    producer_stage_index = stage_index and its layer range; a terminal stage writes the
 *    "empty" descriptor (version 0, producer -1, all zero) and 0 payload bytes.
 * 4. Token ids are validated (0 <= id < n_vocab) on every stage: downstream stages get the
 *    same ids (penalty history), though only the source stage embeds them.
 *    Positions: NULL/0 → n_past + i; otherwise position_count must equal token_count, and
 *    positions must be >= 0.  They drive RoPE and the causal mask (cell j is visible to
 *    token i iff pos(j) <= pos(i)); cache cells are always filled at n_past + i.
 * 5. Sampling (runtime.md §2.4): enabled iff the pointer is non-NULL, version != 0 and
 *    flags != 0 (version must then be 2).  Otherwise greedy arg-max (first max wins).
 *    Chain: penalties (repeat/frequency/presence over the last penalty_last_n history
 *    tokens; 0 or <0 = whole history) → logit bias → ignore_eos (EOS/EOT = -inf) → top-k
 *    (k > 0) → top-p (0 < p < 1) → min-p (0 < p < 1) → temperature (<= 0 → arg-max of the
 *    survivors) → seeded draw.  DRY, XTC, typical-p, top-n-sigma, mirostat and dynatemp
 *    are accepted and ignored.  PRNG: splitmix64, seeded from `seed` (0 → 0xFFFFFFFF) and
 *    re-seeded whenever the session's config bytes change; uniform = (x >> 11) * 2^-53.
 * 6. Verify computes logits for every row and samples every row (history grows row by
 *    row); it records a checkpoint {start, count}.  retire_verify_checkpoint validates
 *    start + count <= n_past and clears it (KV caches need no snapshot); trim(n) requires
 *    n <= n_past, sets n_past = n, cuts history and drops the last logits/rows if n moved.
 *    MTP is not implemented: drafts come back with version 1, available = false.
 * 7. Batches validate every request first (non-NULL distinct sessions of one model, frames,
 *    context room, capacities; BUFFER_TOO_SMALL reports every request's size).  When all
 *    rows fit in n_batch they run as ONE graph (weight matmuls over all rows, attention per
 *    session over its own cache) and either every session advances or none does; larger
 *    batches compute request by request and advance the sessions once all have computed
 *    (all or nothing too).  Samples are compact: one {request index, token} per request
 *    with sample_last on a terminal stage, in request order.
 * 8. Lifetime: a session keeps its model alive; skippy_model_free and skippy_session_free may
 *    come in any order (the model is destroyed with its last handle).
 *    Threads: n_threads 0 = physical cores, at most GGML_MAX_N_THREADS (512, INVALID_ARGUMENT
 *    above: ggml aborts the process when it cannot start a worker); graphs under ~4M weight
 *    multiply-adds run on one thread (ggml's spinning barriers cost more than they save there).  One model
 *    serialises its computes with an internal mutex; different models (stages) run in
 *    parallel.  One call per session at a time.  The last built graph is reused while its
 *    shape (session, rows, KV length padded to 64 cells, logit rows) holds.
 *    Logging: ggml's log goes to the callback set with skippy_stage_log_set; the default
 *    drops everything.
 *
 * Status codes, feature bits and struct layouts are those of upstream skippy ABI
 * (runtime.md §2–§3); sizes and offsets are static_assert'ed in skippy_stage.cpp.
 */
#ifndef SKIPPY_STAGE_H
#define SKIPPY_STAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SKIPPY_STAGE_ABI_MAJOR 0
#define SKIPPY_STAGE_ABI_MINOR 1
#define SKIPPY_STAGE_ABI_PATCH 0

enum skippy_status {
    SKIPPY_STATUS_OK = 0,
    SKIPPY_STATUS_ERROR = 1,
    SKIPPY_STATUS_INVALID_ARGUMENT = 2,
    SKIPPY_STATUS_UNSUPPORTED = 3,
    SKIPPY_STATUS_BUFFER_TOO_SMALL = 4,
    SKIPPY_STATUS_IO_ERROR = 5,
    SKIPPY_STATUS_MODEL_ERROR = 6,
    SKIPPY_STATUS_RUNTIME_ERROR = 7,
};

/* Feature bits (runtime.md §3.2); skippy_abi_features() reports the ones implemented. */
#define SKIPPY_FEATURE_RUNTIME_SLICE        (1ull << 0)
#define SKIPPY_FEATURE_TOKENIZE_DETOKENIZE  (1ull << 6)
#define SKIPPY_FEATURE_ACTIVATION_FRAME     (1ull << 7)
#define SKIPPY_FEATURE_SESSION_RESET        (1ull << 9)
#define SKIPPY_FEATURE_BATCH_VERIFY         (1ull << 10)
#define SKIPPY_FEATURE_SAMPLING_CONFIG      (1ull << 12)
#define SKIPPY_FEATURE_BATCH_VERIFY_FRAME   (1ull << 13)
#define SKIPPY_FEATURE_LOGIT_BIAS           (1ull << 15)
#define SKIPPY_FEATURE_SESSION_TRIM         (1ull << 16)
#define SKIPPY_FEATURE_NATIVE_MTP_N1        (1ull << 25)
#define SKIPPY_FEATURE_ITERATION_BATCH      (1ull << 28)
#define SKIPPY_FEATURE_ACTIVATION_BOUNDARY  (1ull << 29)

#define SKIPPY_ACTIVATION_FRAME_VERSION 2
#define SKIPPY_ACTIVATION_BOUNDARY_DESC_VERSION 2
#define SKIPPY_ACTIVATION_IDENTITY_BYTES 32
#define SKIPPY_ACTIVATION_MAX_DIMS 4
#define SKIPPY_ACTIVATION_MAX_PARTS 16
#define SKIPPY_ACTIVATION_PART_OPTIONAL (1u << 0)

#define SKIPPY_SAMPLING_CONFIG_VERSION 2
#define SKIPPY_MAX_LOGIT_BIAS 256
#define SKIPPY_MAX_SAMPLERS 16
#define SKIPPY_MAX_DRY_SEQUENCE_BREAKERS 8
#define SKIPPY_MAX_DRY_SEQUENCE_BREAKER_BYTES 16
#define SKIPPY_SAMPLING_FLAG_ENABLED 1u
#define SKIPPY_SAMPLING_FLAG_IGNORE_EOS 2u

#define SKIPPY_NATIVE_MTP_MAX_DRAFT_TOKENS 8

struct skippy_error {
    int32_t status;       /* enum skippy_status */
    const char * message; /* malloc'd, NUL-terminated */
};

struct skippy_abi_version {
    uint32_t major;
    uint32_t minor;
    uint32_t patch;
};

/* 128 bytes */
struct skippy_activation_part_desc {
    uint8_t identity[SKIPPY_ACTIVATION_IDENTITY_BYTES]; /* @0 */
    uint32_t ggml_type;                                /* @32 */
    uint32_t rank;                                     /* @36 */
    int32_t token_axis;                                /* @40 */
    uint32_t flags;                                    /* @44 */
    int64_t dimensions[SKIPPY_ACTIVATION_MAX_DIMS];    /* @48, ggml order; -1 = dynamic */
    uint64_t byte_strides[SKIPPY_ACTIVATION_MAX_DIMS]; /* @80 */
    uint64_t payload_offset;                           /* @112 */
    uint64_t payload_bytes;                            /* @120 */
};

/* v2 frame descriptor, 2120 bytes */
struct skippy_activation_desc {
    uint32_t version;              /* @0, 2 (0 = empty) */
    int32_t producer_stage_index;  /* @4, -1 when unset */
    int32_t layer_start;           /* @8 */
    int32_t layer_end;             /* @12 */
    uint32_t token_count;          /* @16 */
    uint32_t sequence_count;       /* @20 */
    uint32_t part_count;           /* @24 */
    uint32_t reserved;             /* @28 */
    uint64_t payload_bytes;        /* @32 */
    uint8_t frontier_identity[SKIPPY_ACTIVATION_IDENTITY_BYTES]; /* @40 */
    struct skippy_activation_part_desc parts[SKIPPY_ACTIVATION_MAX_PARTS]; /* @72 */
};

/* 2088 bytes */
struct skippy_activation_boundary_desc {
    uint32_t version;    /* @0 */
    uint32_t part_count; /* @4 */
    uint8_t frontier_identity[SKIPPY_ACTIVATION_IDENTITY_BYTES]; /* @8 */
    struct skippy_activation_part_desc parts[SKIPPY_ACTIVATION_MAX_PARTS]; /* @40 */
};

struct skippy_logit_bias {
    int32_t token;
    float bias;
};

/* SamplingConfig v2, 2352 bytes (runtime.md §2.4) */
struct skippy_sampling_config {
    uint32_t version;               /* @0 */
    uint32_t flags;                 /* @4 */
    uint32_t seed;                  /* @8 */
    int32_t top_k;                  /* @12 */
    int32_t penalty_last_n;         /* @16 */
    float temperature;              /* @20 */
    float top_p;                    /* @24 */
    float presence_penalty;         /* @28 */
    float frequency_penalty;        /* @32 */
    float repeat_penalty;           /* @36 */
    uint32_t logit_bias_count;      /* @40 */
    float min_p;                    /* @44 */
    float typical_p;                /* @48 */
    float top_nsigma;               /* @52 */
    float dynatemp_range;           /* @56 */
    float dynatemp_exponent;        /* @60 */
    float dry_multiplier;           /* @64 */
    float dry_base;                 /* @68 */
    int32_t dry_allowed_length;     /* @72 */
    int32_t dry_penalty_last_n;     /* @76 */
    float xtc_probability;          /* @80 */
    float xtc_threshold;            /* @84 */
    int32_t mirostat_mode;          /* @88 */
    float mirostat_entropy;         /* @92 */
    float mirostat_learning_rate;   /* @96 */
    uint32_t sampler_count;         /* @100 */
    uint32_t samplers[SKIPPY_MAX_SAMPLERS]; /* @104 */
    uint32_t ignore_eos;            /* @168 */
    uint32_t dry_sequence_breaker_count; /* @172 */
    char dry_sequence_breakers[SKIPPY_MAX_DRY_SEQUENCE_BREAKERS][SKIPPY_MAX_DRY_SEQUENCE_BREAKER_BYTES]; /* @176 */
    struct skippy_logit_bias logit_bias[SKIPPY_MAX_LOGIT_BIAS]; /* @304 */
};

/* 56 bytes */
struct skippy_native_mtp_draft {
    uint32_t version;  /* @0, 1 */
    bool available;    /* @4 */
    int32_t token_count; /* @8 */
    int32_t token_ids[SKIPPY_NATIVE_MTP_MAX_DRAFT_TOKENS]; /* @12 */
    int64_t proposal_compute_us; /* @48 */
};

typedef struct skippy_model skippy_model_t;
typedef struct skippy_session skippy_session_t;

/* 72 bytes */
struct skippy_iteration_request {
    skippy_session_t * session;       /* @0 */
    const int32_t * token_ids;        /* @8 */
    size_t token_count;               /* @16 */
    const int32_t * positions;        /* @24, NULL → n_past + i */
    size_t position_count;            /* @32 */
    const struct skippy_sampling_config * sampling; /* @40 */
    const struct skippy_activation_desc * input_desc; /* @48 */
    const void * input_payload;       /* @56 */
    bool sample_last;                 /* @64 */
};

/* Project open config (not upstream's skippy_runtime_config).  struct_size must be
 * sizeof(struct skippy_stage_config); layer_end -1 = n_layer; n_threads 0 = physical cores. */
struct skippy_stage_config {
    uint32_t struct_size;
    int32_t stage_index;
    int32_t layer_start;
    int32_t layer_end;
    uint32_t ctx_size;   /* per-session (per-lane) token capacity */
    uint32_t lane_count; /* live sessions allowed */
    int32_t n_threads;
    uint32_t n_batch;    /* tokens per graph evaluation; longer calls are split */
};

struct skippy_model_info {
    int32_t n_layer;
    int32_t n_embd;
    int32_t n_vocab;
    int32_t n_ctx;      /* = ctx_size, per session */
    int32_t n_head;
    int32_t n_head_kv;
    int32_t layer_start;
    int32_t layer_end;
    int32_t stage_index;
    int32_t lane_count;
    int32_t n_threads;
    int32_t n_batch;
    bool is_source;
    bool is_terminal;
    bool batched_activation_exports;
    char architecture[64];
};

typedef void (*skippy_stage_log_callback)(int level, const char * text, void * user_data);

/* ---- discovery / errors ---- */
struct skippy_abi_version skippy_abi_version(void);
uint64_t skippy_abi_features(void);
const char * skippy_status_string(int32_t status);
void skippy_error_free(struct skippy_error * error);
/* Routes ggml's log (process-wide).  NULL callback = drop everything (the default). */
void skippy_stage_log_set(skippy_stage_log_callback callback, void * user_data);
/* Process-wide: while set, a computation in progress stops at its next graph node and its
 * call fails with SKIPPY_STATUS_RUNTIME_ERROR "computation interrupted" (the session is
 * unchanged), as does every later one until it is cleared (the caller clears it once it
 * has seen the failure).  For a command's Ctrl-C. */
void skippy_set_interrupted(bool interrupted);
bool skippy_interrupted(void);
/* The bytes this process can still allocate: the lesser of Linux's MemAvailable and what the
 * memory limits of its cgroup and the cgroups above it leave (v2 memory.max or memory.high,
 * v1 memory.limit_in_bytes, less the usage but reclaimable file pages).  False when none of them can be read.
 * `root` prefixes every path read: "" for this machine. */
bool skippy_memory_available(const char * root, uint64_t * out_bytes);

/* ---- model / session ---- */
enum skippy_status skippy_model_open(const char * path, const struct skippy_stage_config * config,
                                     skippy_model_t ** out_model, struct skippy_error ** out_error);
void skippy_model_free(skippy_model_t * model);
void skippy_model_get_info(const skippy_model_t * model, struct skippy_model_info * out_info);
bool skippy_model_output_activation_boundary(const skippy_model_t * model,
                                             struct skippy_activation_boundary_desc * out_desc);
bool skippy_model_input_activation_boundary(const skippy_model_t * model,
                                            struct skippy_activation_boundary_desc * out_desc);

enum skippy_status skippy_session_create(skippy_model_t * model, skippy_session_t ** out_session,
                                         struct skippy_error ** out_error);
enum skippy_status skippy_session_free(skippy_session_t * session, struct skippy_error ** out_error);
int32_t skippy_session_position(const skippy_session_t * session); /* -1 on NULL */
enum skippy_status skippy_session_reset(skippy_session_t * session, struct skippy_error ** out_error);
enum skippy_status skippy_trim_session(skippy_session_t * session, uint64_t token_count,
                                       struct skippy_error ** out_error);
enum skippy_status skippy_retire_verify_checkpoint(skippy_session_t * session, uint64_t token_start,
                                                   uint64_t token_count, struct skippy_error ** out_error);
enum skippy_status skippy_session_sample_current(skippy_session_t * session,
                                                 const struct skippy_sampling_config * sampling,
                                                 int32_t * out_token, struct skippy_error ** out_error);
/* OK when the sampler runs `sampling` (NULL or not enabled: greedy); else INVALID_ARGUMENT with
 * the reason a prefill or decode step given it would fail with (version, counts, a NaN). */
enum skippy_status skippy_sampling_check(const struct skippy_sampling_config * sampling,
                                         struct skippy_error ** out_error);

/* Copies the logits of the last execution (terminal only): 1 row after prefill/decode, one
 * row per token after verify.  capacity and *out_count are in floats; BUFFER_TOO_SMALL with
 * the required count when capacity is short.  For tests and diagnostics; no state change. */
enum skippy_status skippy_session_copy_logits(skippy_session_t * session, float * out, size_t capacity,
                                              size_t * out_count, struct skippy_error ** out_error);

/* ---- execution ---- */
enum skippy_status skippy_prefill_chunk_frame(
    skippy_session_t * session, const int32_t * token_ids, size_t token_count,
    const struct skippy_activation_desc * input_desc, const void * input_payload,
    struct skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
    size_t * out_output_payload_bytes, struct skippy_error ** out_error);

enum skippy_status skippy_prefill_chunk_frame_with_positions(
    skippy_session_t * session, const int32_t * token_ids, size_t token_count,
    const int32_t * positions, size_t position_count,
    const struct skippy_activation_desc * input_desc, const void * input_payload,
    struct skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
    size_t * out_output_payload_bytes, struct skippy_error ** out_error);

enum skippy_status skippy_prefill_chunk_frame_sampled(
    skippy_session_t * session, const int32_t * token_ids, size_t token_count,
    const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload,
    struct skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
    size_t * out_output_payload_bytes, int32_t * out_predicted_token, struct skippy_error ** out_error);

enum skippy_status skippy_prefill_chunk_frame_sampled_with_positions(
    skippy_session_t * session, const int32_t * token_ids, size_t token_count,
    const int32_t * positions, size_t position_count,
    const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload,
    struct skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
    size_t * out_output_payload_bytes, int32_t * out_predicted_token, struct skippy_error ** out_error);

enum skippy_status skippy_decode_step_frame_sampled(
    skippy_session_t * session, int32_t token_id, const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload,
    struct skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
    size_t * out_output_payload_bytes, int32_t * out_predicted_token, struct skippy_error ** out_error);

enum skippy_status skippy_decode_step_frame_sampled_mtp(
    skippy_session_t * session, int32_t token_id, const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload,
    struct skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
    size_t * out_output_payload_bytes, int32_t * out_predicted_token, size_t max_draft_tokens,
    struct skippy_native_mtp_draft * out_mtp_draft, struct skippy_error ** out_error);

enum skippy_status skippy_verify_tokens_frame_sampled(
    skippy_session_t * session, const int32_t * token_ids, size_t token_count,
    const struct skippy_sampling_config * sampling,
    const struct skippy_activation_desc * input_desc, const void * input_payload,
    struct skippy_activation_desc * output_desc, void * output_payload, size_t output_capacity,
    size_t * out_output_payload_bytes, int32_t * output_tokens, size_t output_token_capacity,
    size_t * out_token_count, size_t max_draft_tokens, struct skippy_native_mtp_draft * out_mtp_draft,
    struct skippy_error ** out_error);

/* Re-reads the last token_count rows of the last export (non-terminal); no state change. */
enum skippy_status skippy_session_copy_output_activation_frame(
    skippy_session_t * session, size_t token_count, struct skippy_activation_desc * output_desc,
    void * output_payload, size_t output_capacity, size_t * out_output_payload_bytes,
    struct skippy_error ** out_error);

/* Deprecated upstream, kept for the runtime port.  predicted_capacity >= request_count. */
enum skippy_status skippy_decode_step_frame_batch_sampled(
    skippy_session_t * const * sessions, const int32_t * token_ids,
    const struct skippy_sampling_config * const * sampling,
    const struct skippy_activation_desc * const * input_descs, const void * const * input_payloads,
    struct skippy_activation_desc * output_descs, void * const * output_payloads,
    const size_t * output_capacities, size_t * out_output_payload_bytes,
    int32_t * out_predicted_tokens, size_t predicted_capacity, size_t request_count,
    struct skippy_error ** out_error);

enum skippy_status skippy_iteration_batch_sampled(
    const struct skippy_iteration_request * requests, size_t request_count,
    struct skippy_activation_desc * output_descs, void * const * output_payloads,
    const size_t * output_capacities, size_t * out_output_payload_bytes,
    size_t * out_sampled_request_indexes, int32_t * out_predicted_tokens, size_t sampled_capacity,
    size_t * out_sampled_output_count, struct skippy_error ** out_error);

#ifdef __cplusplus
}
#endif

#endif /* SKIPPY_STAGE_H */
