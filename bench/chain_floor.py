"""What a chain of processes pays a token outside its work on this host, with none of our code.

    python bench/chain_floor.py [--stages 1,2,3] [--tokens 200] [--work-ms 18] [--size 2304] [--cpus all,0]

A driver and N processes on 127.0.0.1, each process passing a SIZE-byte message on to the
next after busy-waiting its share of WORK_MS (a stage's compute), the last one answering,
every answer relayed back to the driver (``sendall`` / ``recv_into`` over TCP_NODELAY
sockets, as a pipeline's stages and replies go): the time a token takes beyond WORK_MS,
and per hop (over N hops, as ``bench/hop_bench.py`` counts them).  The same chain is timed
in Python and, where a C compiler (``cc``) is found, as a small C program, so that the
floor under ``hop_bench``'s per-hop figure is known for interpreted and native code alike.
``--cpus 0`` pins every process of the chain to vCPU 0 (wake-ups then switch processes on
one CPU instead of waking a halted one).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from skippy_wire.tools.bench_rows import comma_list, cpu_text, one_of, script_main, script_options
from skippy_wire.tools.options import float_between, int_between, int_list

#: The most processes in a chain (the C program's socket arrays).
MAX_CHAIN = 64

C_CHAIN = r"""
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void link_pair(int *c, int *s) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1; struct sockaddr_in a = {0}; socklen_t n = sizeof a;
    a.sin_family = AF_INET; a.sin_addr.s_addr = htonl(0x7f000001);
    bind(l, (void *)&a, sizeof a); listen(l, 1); getsockname(l, (void *)&a, &n);
    *c = socket(AF_INET, SOCK_STREAM, 0); connect(*c, (void *)&a, sizeof a); *s = accept(l, 0, 0); close(l);
    setsockopt(*c, IPPROTO_TCP, TCP_NODELAY, &one, 4); setsockopt(*s, IPPROTO_TCP, TCP_NODELAY, &one, 4);
}
static void recv_all(int s, char *b, int size) {
    for (int g = 0, r; g < size; g += r) if ((r = recv(s, b + g, size - g, 0)) <= 0) exit(1);
}
int main(int argc, char **argv) {
    int k = atoi(argv[1]), tokens = atoi(argv[2]), size = atoi(argv[4]), c[64], s[64];  /* MAX_CHAIN */
    double work = atof(argv[3]) / k; char *buf = calloc(size, 1);
    pid_t parent = getpid();
    for (int i = 0; i < k; i++) link_pair(&c[i], &s[i]);
    for (int i = 0; i < k; i++) if (fork() == 0) {
        /* its links stay open in its siblings: it would wait in recv for good once the driver is killed */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() != parent) _exit(1);
        for (int j = 0; j < tokens; j++) {
            recv_all(s[i], buf, size);
            for (double t = now(); now() - t < work;) {}
            if (i + 1 < k) { send(c[i + 1], buf, size, 0); recv_all(c[i + 1], buf, size); }
            send(s[i], buf, size, 0);
        }
        _exit(0);
    }
    double t = now();
    for (int j = 0; j < tokens; j++) { send(c[0], buf, size, 0); recv_all(c[0], buf, size); }
    printf("%f\n", (now() - t) / tokens);
    return 0;
}
"""


def _link_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        near = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
    for sock in (near, far):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return near, far


def _recv_all(sock: socket.socket, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the chain broke")
        got += n


def python_chain(stages: int, tokens: int, work_s: float, size: int) -> float:
    """Seconds a token takes through a Python chain of ``stages`` processes."""
    links = [_link_pair() for _ in range(stages)]
    share, children = work_s / stages, []
    for index in range(stages):
        pid = os.fork()
        if pid == 0:
            buf, up = bytearray(size), links[index][1]
            down = links[index + 1][0] if index + 1 < stages else None
            for _ in range(tokens):
                _recv_all(up, buf)
                started = time.perf_counter()
                while time.perf_counter() - started < share:
                    pass
                if down is not None:
                    down.sendall(buf)
                    _recv_all(down, buf)
                up.sendall(buf)
            os._exit(0)
        children.append(pid)
    buf, entry = bytearray(size), links[0][0]
    try:
        started = time.perf_counter()
        for _ in range(tokens):
            entry.sendall(buf)
            _recv_all(entry, buf)
        return (time.perf_counter() - started) / tokens
    finally:  # a stop (SIGTERM, Ctrl-C to this process alone) left the children waiting in recv for good
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for pair in links:
            for sock in pair:
                sock.close()


def c_chain(binary: str, stages: int, tokens: int, work_s: float, size: int) -> float:
    """Seconds a token takes through the same chain as a C program (given 600 s for its hops and
    ten times the work's time: 40,000 tokens of 18 ms passed the 600 s it had, a traceback)."""
    out = subprocess.run([binary, str(stages), str(tokens), repr(work_s), str(size)], check=True,
                         capture_output=True, text=True, timeout=600 + 10 * tokens * work_s)
    return float(out.stdout)


def main(argv=None) -> int:
    args = script_options(__doc__, argv, types={"stages": int_list(1, MAX_CHAIN), "tokens": int_between(1, 100_000),
                                                "cpus": comma_list(one_of("all", "0")), "size": int_between(1, 1 << 26),
                                                "work-ms": float_between(0, 1000)},
                          stages="1,2,3", tokens=200, size=2304, cpus="all", **{"work-ms": 18.0})
    work_s = args.work_ms / 1000.0
    compiler, c_missing = shutil.which("cc"), "; no C compiler: Python only"
    with tempfile.TemporaryDirectory() as scratch:
        binary = None
        if compiler:
            source = os.path.join(scratch, "chain.c")
            with open(source, "w", encoding="ascii") as fh:
                fh.write(C_CHAIN)
            built = subprocess.run([compiler, "-O2", "-o", os.path.join(scratch, "chain"), source],
                                   capture_output=True, text=True)
            if built.returncode == 0:
                binary, c_missing = os.path.join(scratch, "chain"), ""
            else:  # e.g. a compiler without the C library's headers
                said = (built.stderr.strip().splitlines() or [f"exit status {built.returncode}"])[0]
                c_missing = f"; {compiler} failed ({said}): Python only"
        print(f"# a chain of processes on 127.0.0.1, {args.size}-byte messages, {args.work_ms:g} ms of work a "
              f"token split between them, {args.tokens} tokens; CPU: {cpu_text()}"
              + c_missing)
        print("| cpus | stages | Python outside work per token | per hop | C outside work per token | per hop |")
        print("|---|---|---|---|---|---|")
        everywhere = os.sched_getaffinity(0)
        for cpus in args.cpus:
            os.sched_setaffinity(0, everywhere if cpus == "all" else {0})  # children inherit it
            for n in args.stages:
                py = (python_chain(n, args.tokens, work_s, args.size) - work_s) * 1e6
                c = (c_chain(binary, n, args.tokens, work_s, args.size) - work_s) * 1e6 if binary else None
                c_cells = f"{c:.0f} us | {c / n:.0f} us" if c is not None else "- | -"
                print(f"| {cpus} | {n} | {py:.0f} us | {py / n:.0f} us | {c_cells} |")
        os.sched_setaffinity(0, everywhere)
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
