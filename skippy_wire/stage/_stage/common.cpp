// common.cpp — errors, logging and the core count of the stage backend.

#include "stage_internal.h"

namespace skippy_stage {

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


skippy_status finish(skippy_error ** out_error, const result & r) {
    return r.is_ok() ? ok(out_error) : fail(out_error, r.status, r.message);
}

std::mutex g_log_mutex;
skippy_stage_log_callback g_log_cb = nullptr;
void * g_log_ud = nullptr;

// The first error ggml logged on this thread since the last take_log_error(): why a call
// that reports only failure (gguf_init_from_file returns null) failed.
static thread_local std::string t_first_error;

std::string take_log_error() {
    std::string text = std::move(t_first_error);
    t_first_error.clear();
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    const size_t colon = text.find(": ");  // "gguf_init_from_file_impl: the reason"
    return colon == std::string::npos ? text : text.substr(colon + 2);
}

static void log_trampoline(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR && t_first_error.empty() && text) t_first_error = text;
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


void set_log_callback(skippy_stage_log_callback callback, void * user_data) {
    {
        std::lock_guard<std::mutex> lock(g_log_mutex);
        g_log_cb = callback;
        g_log_ud = user_data;
    }
    ensure_log_installed();
}

std::atomic<bool> g_interrupted{false};

bool interrupted_callback(void *) { return g_interrupted.load(std::memory_order_relaxed); }

result compute_result(ggml_status status) {
    if (status == GGML_STATUS_SUCCESS) return {};
    if (status == GGML_STATUS_ABORTED) return err(SKIPPY_STATUS_RUNTIME_ERROR, "computation interrupted");
    return err(SKIPPY_STATUS_RUNTIME_ERROR, "ggml graph compute failed");
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

}  // namespace skippy_stage
