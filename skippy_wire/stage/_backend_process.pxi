# Process-wide switches of the native backend (included by _backend.pyx): where ggml's and
# the stage's log lines go, and the interrupt flag a long computation checks at every node.

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


def set_log_callback(callback):
    global _log_callback
    _log_callback = callback
    if callback is None:
        skippy_stage_log_set(NULL, NULL)
    else:
        skippy_stage_log_set(_log_trampoline, NULL)
