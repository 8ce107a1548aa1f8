/*
 * ggml_build_info.cpp — which ggml the backend extension carries (skippy_wire.stage._ggml
 * reads it through ctypes).  The ggml_cpu_has_* answers are the instruction sets ggml-cpu
 * was compiled with (on x86 they test the compiler's __AVX512F__ etc.): the live variant.
 */
#include "ggml-cpu.h"
#include "ggml.h"

#include <string>

extern "C" {

const char *skippy_ggml_version(void) { return ggml_version(); }

/* Comma-separated compiled CPU features of the linked ggml-cpu, in a fixed order. */
const char *skippy_ggml_cpu_features(void) {
    static const std::string features = [] {
        static const struct {
            const char *name;
            int (*has)(void);
        } table[] = {
            {"sse3", ggml_cpu_has_sse3},
            {"ssse3", ggml_cpu_has_ssse3},
            {"avx", ggml_cpu_has_avx},
            {"avx2", ggml_cpu_has_avx2},
            {"bmi2", ggml_cpu_has_bmi2},
            {"f16c", ggml_cpu_has_f16c},
            {"fma", ggml_cpu_has_fma},
            {"avx_vnni", ggml_cpu_has_avx_vnni},
            {"avx512", ggml_cpu_has_avx512},
            {"avx512_vbmi", ggml_cpu_has_avx512_vbmi},
            {"avx512_vnni", ggml_cpu_has_avx512_vnni},
            {"avx512_bf16", ggml_cpu_has_avx512_bf16},
            {"amx_int8", ggml_cpu_has_amx_int8},
            {"neon", ggml_cpu_has_neon},
            {"dotprod", ggml_cpu_has_dotprod},
            {"llamafile", ggml_cpu_has_llamafile},
        };
        std::string out;
        for (const auto &f : table) {
            if (f.has()) out += (out.empty() ? "" : ",") + std::string(f.name);
        }
        return out.empty() ? std::string("none") : out;
    }();
    return features.c_str();
}

}  // extern "C"
