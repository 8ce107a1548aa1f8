# The multi-session calls of skippy_stage.h (included by _backend.pyx).


cdef BatchResult _batch_result(vector[skippy_activation_desc] & descs, list bufs, list sizes, list indexes,
                               list predicted):
    cdef BatchResult r = BatchResult.__new__(BatchResult)
    cdef size_t i
    r.out_descs = [_desc_bytes(&descs[i]) for i in range(descs.size())]
    r.out_payloads = [_out_payload(bufs[i], sizes[i]) for i in range(descs.size())]
    r.out_bytes = sizes
    r.sampled_request_indexes = indexes
    r.predicted_tokens = predicted
    return r


cdef skippy_session_t * _session_ptr(object s) except? NULL:
    if s is None:
        return NULL
    if not isinstance(s, Session):
        raise TypeError(f"expected a Session or None, not {type(s).__name__}")
    if (<Session> s).ptr == NULL:
        raise ValueError("Session is closed")
    return (<Session> s).ptr


cdef list _enter_all(sessions):
    """Session._enter() for each distinct Session of a batch (a repeated one is native's to
    refuse), or for none of them."""
    cdef list entered = []
    try:
        for s in sessions:
            if isinstance(s, Session) and not any(s is t for t in entered):
                (<Session> s)._enter()
                entered.append(s)
    except BaseException:
        _leave_all(entered)
        raise
    return entered


cdef _leave_all(list entered):
    for s in entered:
        (<Session> s)._leave()


def iteration_batch_sampled(requests, capacities, size_t sampled_capacity):
    cdef size_t n = len(requests)
    if <size_t> len(capacities) != n:
        raise ValueError(f"{len(capacities)} capacities for {n} requests")
    cdef vector[skippy_iteration_request] reqs
    cdef vector[vector[int32_t]] toks
    cdef vector[vector[int32_t]] poss
    cdef vector[size_t] caps
    cdef vector[void *] out_ptrs
    cdef vector[size_t] out_bytes
    cdef vector[size_t] idx
    cdef vector[int32_t] pred
    cdef vector[skippy_activation_desc] out_descs
    cdef size_t n_sampled = 0
    cdef size_t i
    cdef _Blob b
    cdef _Payload p
    keep = []
    bufs = []
    reqs.resize(n)
    toks.resize(n)
    poss.resize(n)
    caps.resize(n)
    out_ptrs.resize(n)
    out_bytes.resize(n)
    out_descs.resize(n)
    idx.resize(sampled_capacity if sampled_capacity else 1)
    pred.resize(sampled_capacity if sampled_capacity else 1)
    for i in range(n):
        session, tokens, positions, sampling, input_desc, input_payload, sample_last = requests[i]
        memset(&reqs[i], 0, sizeof(skippy_iteration_request))
        reqs[i].session = _session_ptr(session)
        toks[i] = _int32s(tokens, "tokens")
        reqs[i].token_ids = toks[i].data() if toks[i].size() else NULL
        reqs[i].token_count = toks[i].size()
        if positions is not None:
            poss[i] = _int32s(positions, "positions")
            if poss[i].size():
                reqs[i].positions = poss[i].data()
                reqs[i].position_count = poss[i].size()
        b = _Blob.of(sampling, sizeof(skippy_sampling_config), "sampling")
        keep.append(b)
        reqs[i].sampling = <const skippy_sampling_config *> b.ptr
        db = _Blob.of(input_desc, sizeof(skippy_activation_desc), "input_desc")
        keep.append(db)
        reqs[i].input_desc = <const skippy_activation_desc *> (<_Blob> db).ptr
        p = _Payload.of(input_payload)
        keep.append(p)
        _check_payload(<_Blob> db, p, f"request {i}: ")
        reqs[i].input_payload = p.ptr
        reqs[i].sample_last = bool(sample_last)
        caps[i] = capacities[i]
        buf = _new_payload(caps[i])
        bufs.append(buf)
        out_ptrs[i] = <void *> _payload_ptr(buf)
    cdef skippy_error * e = NULL
    cdef skippy_status st
    entered = _enter_all([request[0] for request in requests])
    try:
        with nogil:
            st = skippy_iteration_batch_sampled(reqs.data(), n, out_descs.data(), out_ptrs.data(), caps.data(),
                                                out_bytes.data(), idx.data(), pred.data(), sampled_capacity,
                                                &n_sampled, &e)
    finally:
        _leave_all(entered)
    sizes = [out_bytes[i] for i in range(n)]
    _check(st, _take_message(e), sizes)
    cdef size_t ns = min(n_sampled, sampled_capacity)
    return _batch_result(out_descs, bufs, sizes, [idx[i] for i in range(ns)], [pred[i] for i in range(ns)])


def decode_step_frame_batch_sampled(sessions, token_ids, samplings, input_descs, input_payloads, capacities,
                                    size_t predicted_capacity):
    cdef size_t n = len(sessions)
    for name, seq in (("token_ids", token_ids), ("samplings", samplings), ("input_descs", input_descs),
                      ("input_payloads", input_payloads), ("capacities", capacities)):
        if <size_t> len(seq) != n:
            raise ValueError(f"{len(seq)} {name} for {n} sessions")
    cdef vector[skippy_session_t *] sess
    cdef vector[int32_t] toks
    cdef vector[const skippy_sampling_config *] samps
    cdef vector[const skippy_activation_desc *] descs
    cdef vector[const void *] pays
    cdef vector[size_t] caps
    cdef vector[void *] out_ptrs
    cdef vector[size_t] out_bytes
    cdef vector[int32_t] pred
    cdef vector[skippy_activation_desc] out_descs
    cdef size_t i
    cdef _Blob b
    cdef _Blob d
    cdef _Payload p
    keep = []
    bufs = []
    sess.resize(n)
    toks.resize(n)
    samps.resize(n)
    descs.resize(n)
    pays.resize(n)
    caps.resize(n)
    out_ptrs.resize(n)
    out_bytes.resize(n)
    out_descs.resize(n)
    pred.resize(predicted_capacity if predicted_capacity > n else (n if n else 1))
    for i in range(n):
        sess[i] = _session_ptr(sessions[i])
        toks[i] = token_ids[i]
        b = _Blob.of(samplings[i], sizeof(skippy_sampling_config), "sampling")
        d = _Blob.of(input_descs[i], sizeof(skippy_activation_desc), "input_desc")
        p = _Payload.of(input_payloads[i])
        keep.extend((b, d, p))
        _check_payload(d, p, f"request {i}: ")
        samps[i] = <const skippy_sampling_config *> b.ptr
        descs[i] = <const skippy_activation_desc *> d.ptr
        pays[i] = p.ptr
        caps[i] = capacities[i]
        buf = _new_payload(caps[i])
        bufs.append(buf)
        out_ptrs[i] = <void *> _payload_ptr(buf)
    cdef skippy_error * e = NULL
    cdef skippy_status st
    entered = _enter_all(sessions)
    try:
        with nogil:
            st = skippy_decode_step_frame_batch_sampled(sess.data(), toks.data(), samps.data(), descs.data(),
                                                        pays.data(), out_descs.data(), out_ptrs.data(), caps.data(),
                                                        out_bytes.data(), pred.data(), predicted_capacity, n, &e)
    finally:
        _leave_all(entered)
    sizes = [out_bytes[i] for i in range(n)]
    _check(st, _take_message(e), sizes)
    return _batch_result(out_descs, bufs, sizes, list(range(n)), [pred[i] for i in range(n)])
