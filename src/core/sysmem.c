// sysmem.c: how much memory this process may still use (/proc/meminfo and a
// cgroup limit: the planner's default limit).
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>

#include "fitlm/core.h"

static size_t read_size_file(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[64] = "";
    size_t v = 0;
    if (fgets(line, sizeof line, f) && isdigit((unsigned char)line[0]))
        v = (size_t)strtoull(line, NULL, 10);
    fclose(f);
    return v; // 0 also for "max" (no limit)
}

size_t fl_mem_available(void) {
    size_t avail = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        size_t kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %zu kB", &kb) == 1) {
                avail = kb * 1024;
                break;
            }
        fclose(f);
    }
    // a container's limit, when it is below what the machine has available
    static const char *const limits[][2] = {
        {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
        {"/sys/fs/cgroup/memory/memory.limit_in_bytes",
         "/sys/fs/cgroup/memory/memory.usage_in_bytes"},
    };
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        size_t max = read_size_file(limits[i][0]), used = read_size_file(limits[i][1]);
        if (!max || max >= ((size_t)1 << 60)) continue; // no limit
        size_t left = max > used ? max - used : 0;
        if (!avail || left < avail) avail = left;
        break;
    }
    return avail;
}
