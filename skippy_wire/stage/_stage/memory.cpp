// memory.cpp — the memory a session's KV cache is checked against (skippy_memory_available).

#include "stage_internal.h"

namespace {

// The first number on the line of `path` that starts with `key` (a file of "key value" lines
// such as memory.stat), or the whole file's number when `key` is empty; "max" reads as
// unlimited.  False (and `out` untouched) when the file or the line is missing.
bool read_number(const std::string & path, const char * key, uint64_t * out) {
    FILE * f = fopen(path.c_str(), "r");
    if (!f) return false;
    char line[512];
    bool found = false;
    const size_t key_len = strlen(key);
    while (!found && fgets(line, sizeof line, f)) {
        if (key_len && (strncmp(line, key, key_len) != 0 || (line[key_len] != ' ' && line[key_len] != ':'))) continue;
        const char * value = line + key_len + (key_len ? 1 : 0);
        while (*value == ' ') value++;
        unsigned long long n = 0;
        if (strncmp(value, "max", 3) == 0) {
            *out = UINT64_MAX;
            found = true;
        } else if (sscanf(value, "%llu", &n) == 1) {
            *out = (uint64_t) n;
            found = true;
        }
        if (!key_len) break;
    }
    fclose(f);
    return found;
}

// What a cgroup directory's limit still leaves: the limit (v2: memory.max, or memory.high
// where lower, past which the kernel throttles and reclaims) less its usage but the file
// pages on the LRU lists, which the kernel reclaims before it refuses memory (the model
// file's page cache, once the weights are copied out of it; tmpfs and shared memory are
// not among them).  False when the directory sets no limit.
bool cgroup_headroom(const std::string & dir, bool v2, uint64_t * out) {
    uint64_t limit = UINT64_MAX, high = UINT64_MAX, usage = 0, active = 0, inactive = 0;  // kept where unread
    read_number(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes"), "", &limit);
    if (v2) read_number(dir + "/memory.high", "", &high);
    limit = std::min(limit, high);
    if (limit >= (1ull << 62)) return false;  // none: no file, "max" (v2), or v1's page-rounded LONG_MAX
    read_number(dir + (v2 ? "/memory.current" : "/memory.usage_in_bytes"), "", &usage);
    read_number(dir + "/memory.stat", v2 ? "active_file" : "total_active_file", &active);
    read_number(dir + "/memory.stat", v2 ? "inactive_file" : "total_inactive_file", &inactive);
    const uint64_t reclaimable = active + inactive;
    const uint64_t used = usage > reclaimable ? usage - reclaimable : 0;
    *out = limit > used ? limit - used : 0;
    return true;
}

}  // namespace

// What this process can still allocate without swapping (Linux's MemAvailable) or passing a
// memory limit of its cgroup or of the cgroups above it (v2 memory.max or memory.high, v1
// memory.limit_in_bytes: a container's limit, which MemAvailable does not see).  The cgroup
// directory is this process's path (/proc/self/cgroup) under the mount, walked up to the
// mount's root; inside a cgroup namespace the path is "/" and the mount's root is the
// process's own cgroup.  A KV cache larger than that is refused: allocated, it would be zeroed
// page by page until the out-of-memory killer ended the process.  (net/supervision.py checks
// one session over all of a pipeline's layers with this before starting its stages.)
extern "C" bool skippy_memory_available(const char * root, uint64_t * out_bytes) {
    const std::string prefix = root ? root : "";
    uint64_t kib = 0;
    bool known = read_number(prefix + "/proc/meminfo", "MemAvailable", &kib);
    uint64_t available = known ? kib * 1024 : UINT64_MAX;
    if (FILE * f = fopen((prefix + "/proc/self/cgroup").c_str(), "r")) {
        char * line = nullptr;  // whole lines, however long the path
        size_t capacity = 0;
        while (getline(&line, &capacity, f) != -1) {
            line[strcspn(line, "\n")] = '\0';
            char * controllers = strchr(line, ':');
            char * path = controllers ? strchr(controllers + 1, ':') : nullptr;
            if (!path) continue;
            *controllers++ = '\0';  // line: the hierarchy id; controllers: its list
            *path++ = '\0';
            const std::string list = std::string(",") + controllers + ",";
            const bool v2 = strcmp(line, "0") == 0 && list == ",,";
            if (!v2 && list.find(",memory,") == std::string::npos) continue;
            const std::string mount = prefix + (v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory");
            std::string rel = path;
            while (true) {
                while (!rel.empty() && rel.back() == '/') rel.pop_back();
                uint64_t headroom = 0;
                if (cgroup_headroom(mount + rel, v2, &headroom)) {
                    available = std::min(available, headroom);
                    known = true;
                }
                if (rel.empty()) break;
                const size_t slash = rel.rfind('/');
                rel.resize(slash == std::string::npos ? 0 : slash);
            }
        }
        free(line);
        fclose(f);
    }
    if (known && out_bytes) *out_bytes = available;
    return known;
}
