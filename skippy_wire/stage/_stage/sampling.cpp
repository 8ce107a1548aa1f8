// sampling.cpp — sampling config validation and the sampler chain.

#include "stage_internal.h"

namespace skippy_stage {

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
    // A NaN in a number the chain uses would switch a filter off or ban tokens without a word
    // (the command line and the API refuse it; a sampling block from the wire or an embedder
    // need not have).
    const struct { const char * name; float value; } numbers[] = {
        {"temperature", s->temperature}, {"top_p", s->top_p}, {"min_p", s->min_p},
        {"presence_penalty", s->presence_penalty}, {"frequency_penalty", s->frequency_penalty},
        {"repeat_penalty", s->repeat_penalty}};
    for (const auto & n : numbers) {
        if (std::isnan(n.value)) return err(SKIPPY_STATUS_INVALID_ARGUMENT, strf("sampling %s is NaN", n.name));
    }
    for (uint32_t i = 0; i < s->logit_bias_count; i++) {
        if (std::isnan(s->logit_bias[i].bias)) {
            return err(SKIPPY_STATUS_INVALID_ARGUMENT,
                       strf("the logit bias of token %d is NaN", s->logit_bias[i].token));
        }
    }
    return {};
}

namespace {

uint64_t splitmix64(uint64_t * state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// llama.cpp's greedy rule (the first maximum: a tie goes to the lower id, so an all -inf row
// gives id 0), with NaN ranked as -inf: a NaN never compares greater, and a NaN at id 0 must
// not win over the numbers after it.
int32_t argmax(const float * l, int n) {
    int32_t best = 0;
    float top = std::isnan(l[0]) ? -std::numeric_limits<float>::infinity() : l[0];
    for (int i = 1; i < n; i++) {
        if (l[i] > top) { best = i; top = l[i]; }  // first max wins
    }
    return best;
}

}  // namespace

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

    // Greedy: every filter below keeps the best candidate first (logit descending, ties by
    // id), so the answer is the first maximum; skip sorting the whole vocabulary.
    if (!(cfg->temperature > 0.0f)) return argmax(l.data(), nv);

    // NaN ranks as -inf, as in argmax: the sort needs a strict weak order, and a NaN logit
    // (a NaN bias, inf - inf after penalties and bias) is no candidate above a number.
    for (float & x : l) {
        if (std::isnan(x)) x = -std::numeric_limits<float>::infinity();
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
    // Softmax of the kept candidates (best first).  Without a finite maximum there is none
    // (exp(inf - inf) is NaN): +inf candidates share the mass equally (the softmax's limit),
    // and an all -inf row gives it all to the first candidate, the lowest id (the greedy tie
    // rule).  A -inf candidate otherwise gets 0, also at a temperature of +inf.
    auto probs = [&](std::vector<double> & p, float temp) {
        p.assign(cand.size(), 0.0);
        const float mx = l[cand[0]];
        if (std::isinf(mx)) {
            size_t n = 1;
            while (mx > 0 && n < cand.size() && l[cand[n]] == mx) n++;
            for (size_t i = 0; i < n; i++) p[i] = 1.0 / (double) n;
            return;
        }
        double sum = 0;  // >= 1: the first candidate's term is exp(0)
        for (size_t i = 0; i < cand.size(); i++) {
            const double d = (double) l[cand[i]] - mx;
            p[i] = std::isinf(d) ? 0.0 : std::exp(d / temp);
            sum += p[i];
        }
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
    probs(p, cfg->temperature);
    const double u = (double) (splitmix64(&s->rng) >> 11) * (1.0 / 9007199254740992.0);
    double cum = 0;
    size_t last = 0;
    for (size_t i = 0; i < cand.size(); i++) {
        if (!(p[i] > 0.0)) continue;
        cum += p[i];
        last = i;
        if (u < cum) return cand[i];
    }
    return cand[last];  // rounding left the sum below u: the last candidate with mass
}

}  // namespace skippy_stage
