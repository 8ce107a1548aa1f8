# Included by _frame.pyx: stage replies (wire-format.md 11.2), walked in the reference's
# order like the message writer (see _frame_write.pxi).

def write_reply(reply):
    """Serialize a reply (``send_reply_message``)."""
    cdef _Out out = _Out.__new__(_Out)
    try:
        return _write_reply(out, reply)
    except WireError as error:
        error.partial = out.partial()
        raise
    except _CONVERSION_ERRORS:
        raise reply_out_of_range_error(reply) from None


cdef Py_ssize_t _reply_size(object reply) except -2:
    """The byte count of a successful write, or -1 when it cannot be computed up front."""
    try:
        draft = reply.native_mtp_draft
        n = 12 + 4 * len(reply.predicted_tokens) + 8 + 8 * STATS_COUNT
        if draft is not None:
            n += 4 + 4 * len(draft.token_ids) + 8
        return n
    except _CONVERSION_ERRORS:
        return -1


cdef object _write_reply(_Out out, object reply):
    cdef Py_ssize_t n, nd, cap = _reply_size(reply)
    cdef int i
    out.init(cap if cap >= 0 else 256)
    tokens = reply.predicted_tokens
    n = len(tokens)
    if n > MAX_PREDICTED:
        raise InvalidInputError("too many predicted tokens")
    out.u32(as_i32(reply.kind))
    out.u32(as_i32(reply.predicted))
    out.u32(<uint32_t>n)
    _write_i32_seq(out, tokens, n)
    out.u32(as_i32(reply.window.window_id))
    draft = reply.native_mtp_draft
    if draft is None:
        out.u32(0)
    else:
        nd = len(draft.token_ids)
        if nd > MAX_PREDICTED:
            raise InvalidInputError("too many native MTP draft tokens")
        out.u32(1)
        out.u32(<uint32_t>nd)
        _write_i32_seq(out, draft.token_ids, nd)
        out.u64(as_i64(draft.proposal_compute_us))
    values = reply.stats.as_tuple()
    if len(values) != STATS_COUNT:
        raise TypeError("reply statistics of the wrong length")
    for i in range(STATS_COUNT):
        out.u64(as_i64(values[i]))
    return out.finish()


def read_reply_from_buffer(data, Py_ssize_t offset=0):
    """Parse one reply at ``offset`` -> (reply, consumed) (section 11.2 order)."""
    cdef Py_buffer view
    cdef Cur c
    cdef int32_t kind_id, predicted, count, marker, dcount
    cdef int i
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if offset < 0 or offset > view.len:
            raise ValueError("offset outside the buffer")
        c.p = <const uint8_t*>view.buf
        c.pos = offset
        c.start = offset
        c.end = view.len
        kind_id = rd_i32(&c)
        kind = _REPLY_KINDS[kind_id] if 0 <= kind_id < len(_REPLY_KINDS) else None
        if kind is None:
            raise InvalidDataError("unknown stage reply kind")
        predicted = rd_i32(&c)
        count = rd_i32(&c)
        if count < 0:
            raise InvalidDataError("negative predicted token count")
        if count > MAX_PREDICTED:
            raise InvalidDataError("predicted token count exceeds maximum")
        tokens = rd_i32_list(&c, count)
        window = PyDict_Copy(_WINDOW_KEYS)
        window["window_id"] = rd_i32(&c)
        window = _instance(StageReplyWindow, window)
        marker = rd_i32(&c)
        draft = None
        if marker == 1:
            dcount = rd_i32(&c)
            if dcount < 0:
                raise InvalidDataError("negative native MTP draft token count")
            if dcount > MAX_PREDICTED:
                raise InvalidDataError("native MTP draft token count exceeds maximum")
            draft_tokens = rd_i32_list(&c, dcount)
            need(&c, 8)
            draft = NativeMtpDraft(draft_tokens, <int64_t>ld_u64(c.p + c.pos))
            c.pos += 8
        elif marker != 0:
            raise InvalidDataError("unknown native MTP draft reply marker")
        need(&c, 8 * STATS_COUNT)
        # Built like the messages (_instance): a reply is read on every hop of every token,
        # and running three dataclass __init__s there costs more than the parse itself.
        stats = PyDict_Copy(_STATS_KEYS)
        for i in range(STATS_COUNT):
            stats[_STATS_NAMES[i]] = <int64_t>ld_u64(c.p + c.pos + 8 * i)
        c.pos += 8 * STATS_COUNT
        reply = PyDict_Copy(_REPLY_KEYS)
        reply["kind"] = kind
        reply["predicted"] = predicted
        reply["predicted_tokens"] = tokens
        reply["window"] = window
        reply["native_mtp_draft"] = draft
        reply["stats"] = _instance(StageReplyStats, stats)
        return _instance(StageReply, reply), c.pos - c.start
    finally:
        PyBuffer_Release(&view)
