"""The memory a session's KV cache is checked against: MemAvailable and the memory limits of
this process's cgroups (a container's limit, which MemAvailable does not see), read under a
directory laid out as Linux lays out /proc and /sys/fs/cgroup."""

from __future__ import annotations

from skippy_wire.stage import _backend as backend
from skippy_wire.stage import native

MIB = 1 << 20
V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 reports for no limit


def tree(root, files: dict[str, str]):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def meminfo(available_mib: int) -> str:
    return f"MemTotal:       99999999 kB\nMemFree:        1 kB\nMemAvailable:   {available_mib * 1024} kB\n"


def test_a_cgroup_v2_limit_below_memavailable_is_what_is_left_under_it(tmp_path):
    root = tree(tmp_path, {
        "proc/meminfo": meminfo(8192),
        "proc/self/cgroup": "0::/box/job\n",
        "sys/fs/cgroup/box/job/memory.max": f"{512 * MIB}\n",
        "sys/fs/cgroup/box/job/memory.current": f"{200 * MIB}\n",
        # page cache the kernel reclaims before it refuses memory (the model file's, active
        # or not): not counted as used
        "sys/fs/cgroup/box/job/memory.stat": f"anon 1\nfile 2\ninactive_file {50 * MIB}\nactive_file {60 * MIB}\n",
    })
    assert backend.memory_available(root) == (512 - 200 + 50 + 60) * MIB


def test_a_limit_of_a_cgroup_above_this_one_counts_too(tmp_path):
    root = tree(tmp_path, {
        "proc/meminfo": meminfo(8192),
        "proc/self/cgroup": "0::/box/job\n",
        "sys/fs/cgroup/box/job/memory.max": "max\n",
        "sys/fs/cgroup/box/job/memory.current": f"{10 * MIB}\n",
        "sys/fs/cgroup/box/memory.max": f"{256 * MIB}\n",
        "sys/fs/cgroup/box/memory.current": f"{100 * MIB}\n",
        "sys/fs/cgroup/memory.max": "max\n",
    })
    assert backend.memory_available(root) == 156 * MIB


def test_a_cgroup_v1_memory_limit_in_a_shared_hierarchy(tmp_path):
    root = tree(tmp_path, {
        "proc/meminfo": meminfo(8192),
        "proc/self/cgroup": "5:cpu,cpuacct:/docker/abc\n4:cpuacct,memory:/docker/abc\n0::/\n",
        "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{1024 * MIB}\n",
        "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{300 * MIB}\n",
        "sys/fs/cgroup/memory/docker/abc/memory.stat": (f"cache 5\ninactive_file 7\ntotal_active_file {20 * MIB}\n"
                                                        f"total_inactive_file {100 * MIB}\n"),
        "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED + "\n",
    })
    assert backend.memory_available(root) == (1024 - 300 + 120) * MIB


def test_inside_a_cgroup_namespace_the_mount_root_is_the_own_cgroup(tmp_path):
    root = tree(tmp_path, {
        "proc/meminfo": meminfo(8192),
        "proc/self/cgroup": "0::/\n",
        "sys/fs/cgroup/memory.max": f"{300 * MIB}\n",
        "sys/fs/cgroup/memory.current": f"{100 * MIB}\n",
    })
    assert backend.memory_available(root) == 200 * MIB


def test_a_path_missing_under_the_mount_falls_back_to_the_levels_that_are_there(tmp_path):
    """This machine's kind: /proc/self/cgroup names a path the (namespaced) mount does not show."""
    root = tree(tmp_path, {
        "proc/meminfo": meminfo(4096),
        "proc/self/cgroup": "4:memory:/process_api/915bfed3\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{2048 * MIB}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{48 * MIB}\n",
    })
    assert backend.memory_available(root) == 2000 * MIB


def test_memavailable_is_the_answer_when_it_is_the_smaller_or_no_cgroup_limits(tmp_path):
    root = tree(tmp_path, {
        "proc/meminfo": meminfo(700),
        "proc/self/cgroup": "0::/box\n",
        "sys/fs/cgroup/box/memory.max": f"{1024 * MIB}\n",
    })
    assert backend.memory_available(root) == 700 * MIB
    (tmp_path / "sys/fs/cgroup/box/memory.max").write_text("max\n")
    assert backend.memory_available(root) == 700 * MIB
    (tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes").parent.mkdir(parents=True)
    (tmp_path / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(V1_UNLIMITED)
    (tmp_path / "proc/self/cgroup").write_text("4:memory:/\n")
    assert backend.memory_available(root) == 700 * MIB


def test_a_cgroup_over_its_limit_leaves_nothing_and_a_limit_alone_is_enough(tmp_path):
    root = tree(tmp_path, {
        "proc/self/cgroup": "0::/box\n",
        "sys/fs/cgroup/box/memory.max": f"{100 * MIB}\n",
        "sys/fs/cgroup/box/memory.current": f"{150 * MIB}\n",
    })
    assert backend.memory_available(root) == 0  # no /proc/meminfo: the cgroup alone answers


def test_nothing_readable_is_unknown_and_odd_files_are_survived(tmp_path):
    assert backend.memory_available(str(tmp_path)) is None
    root = tree(tmp_path, {
        "proc/self/cgroup": "0::box\n" + "x" * 10000 + "\n::\n4:memory\n9:memory:" + "/a" * 3000 + "\n",
        "sys/fs/cgroup/memory.max": "garbage\n",
    })
    assert backend.memory_available(root) is None


def test_this_machine_answers_at_most_its_memavailable():
    with open("/proc/meminfo", encoding="ascii") as fh:
        available = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    got = native.memory_available()
    assert got is not None and 0 < got <= available * 1.5  # the machine's memory moves between reads


def test_a_cgroup_v2_memory_high_counts_where_it_is_lower(tmp_path):
    """Past memory.high the kernel throttles the cgroup and reclaims its pages (systemd's
    MemoryHigh): a cache that large would crawl."""
    root = tree(tmp_path, {
        "proc/meminfo": meminfo(8192),
        "proc/self/cgroup": "0::/svc\n",
        "sys/fs/cgroup/svc/memory.max": "max\n",
        "sys/fs/cgroup/svc/memory.high": f"{512 * MIB}\n",
        "sys/fs/cgroup/svc/memory.current": f"{12 * MIB}\n",
    })
    assert backend.memory_available(root) == 500 * MIB
    (tmp_path / "sys/fs/cgroup/svc/memory.max").write_text(f"{300 * MIB}\n")
    assert backend.memory_available(root) == 288 * MIB


def test_a_cgroup_path_longer_than_a_line_buffer_is_read_whole(tmp_path):
    """A 4,000-character path used to be read in two pieces, the second taken for a line of
    its own (here: a made-up limit of /x)."""
    long = "/" + "a" * 5000
    root = tree(tmp_path, {
        "proc/meminfo": meminfo(8192),
        "proc/self/cgroup": f"0::{long}/x:memory:/lim\n",
        "sys/fs/cgroup/memory/lim/memory.limit_in_bytes": f"{1 * MIB}\n",
    })
    assert backend.memory_available(root) == 8192 * MIB
