"""Host RAM this process may still take: the machine's MemAvailable, or its cgroup's memory limit net of its use
where that is tighter (containers). Read by the kept first pass (kept_forward.py) and `kt-sft doctor`."""
from __future__ import annotations

import os


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _levels(mount: str, path: str) -> list[str]:
    """The directories of this process's cgroup and of each one above it, up to the mount's root (a limit set on a
    parent binds its children: a Slurm job over its steps, a systemd slice over its services). Only the root where
    the path /proc/self/cgroup names is not under the mount: a container without a cgroup namespace of its own
    sees the host's path there, while its own cgroup is mounted as the root."""
    if not os.path.isdir(os.path.join(mount, path)):
        return [mount]
    levels = [os.path.join(mount, path)]
    while path:
        path = os.path.dirname(path)
        levels.append(os.path.join(mount, path))
    return levels


def _cgroup_headroom(proc: str, cgroup: str) -> tuple[int, int] | None:
    """(limit − use net of reclaimable file cache, limit) of the tightest memory cgroup over this process (v2 and
    v1), or None where memory is not limited or cannot be read."""
    paths = {}  # controller ("" for v2's unified hierarchy) → this process's cgroup path
    for line in (_read(f"{proc}/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2].strip().strip("/")
    tries = []
    if "" in paths:
        tries += [(level, "memory.max", "memory.current", "inactive_file") for level in _levels(cgroup, paths[""])]
    if "memory" in paths:
        tries += [(level, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
                  for level in _levels(os.path.join(cgroup, "memory"), paths["memory"])]
    found = []
    for base, limit_file, usage_file, cache_key in tries:
        stat = (_read(f"{base}/memory.stat") or "").split()
        try:
            limit, used = int(_read(f"{base}/{limit_file}")), int(_read(f"{base}/{usage_file}"))
            cache = int(dict(zip(stat[::2], stat[1::2])).get(cache_key, 0))
        except (TypeError, ValueError):  # absent, or "max" (v2's unlimited)
            continue
        if limit < 1 << 60:  # above: v1's unlimited
            found.append((limit - max(used - cache, 0), limit))
    return min(found) if found else None


def host_headroom(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(bytes of host RAM this process may still take, the total they are part of), the tighter of the machine's
    MemAvailable and its cgroup's limit; None where neither can be read."""
    info = dict(line.split(":", 1) for line in (_read(f"{proc}/meminfo") or "").splitlines() if ":" in line)
    found = []
    try:
        found.append((int(info["MemAvailable"].split()[0]) * 1024, int(info["MemTotal"].split()[0]) * 1024))
    except (KeyError, ValueError, IndexError):
        pass
    group = _cgroup_headroom(proc, cgroup)
    if group:
        found.append(group)
    return min(found) if found else None
