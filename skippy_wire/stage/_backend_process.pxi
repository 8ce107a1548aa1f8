# Process-wide switches and facts of the native backend (included by _backend.pyx): where
# ggml's and the stage's log lines go, the interrupt flag a long computation checks at every
# node, the memory a session's KV cache is checked against, and the sampler's own check of
# a sampling config.

cdef object _log_callback = None


cdef void _log_trampoline(int level, const char * text, void * user_data) noexcept with gil:
    cb = _log_callback
    if cb is None:
        return
    try:
        cb(level, text.decode("utf-8", "replace"))
    except BaseException:
        pass  # a logging failure must never unwind through C


def set_interrupted(bint interrupted):
    skippy_set_interrupted(interrupted)


def memory_available(str root=""):
    """Bytes this process can still allocate (``skippy_memory_available``: MemAvailable and the
    memory limits of its cgroups), None when unknown; ``root`` prefixes the paths read."""
    cdef uint64_t available = 0
    cdef bytes path = root.encode()
    return available if skippy_memory_available(path, &available) else None


def set_log_callback(callback):
    global _log_callback
    _log_callback = callback
    if callback is None:
        skippy_stage_log_set(NULL, NULL)
    else:
        skippy_stage_log_set(_log_trampoline, NULL)


def check_sampling(sampling):
    """None when the sampler runs ``sampling`` (a packed config, or None: greedy); else the
    StageRuntimeError a prefill or decode step given it would raise (``skippy_sampling_check``)."""
    cdef _Blob samp = _Blob.of(sampling, sizeof(skippy_sampling_config), "sampling")
    cdef skippy_error * e = NULL
    cdef skippy_status st = skippy_sampling_check(<const skippy_sampling_config *> samp.ptr, &e)
    _check(st, _take_message(e))
