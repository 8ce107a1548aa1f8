// identity.cpp — the activation identities (one SHA-256) and the descriptors built from them.

#include "stage_internal.h"

namespace skippy_stage {

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

}  // namespace skippy_stage
