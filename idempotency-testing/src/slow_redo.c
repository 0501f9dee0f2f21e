/*
 * Loaded into mariadbd with LD_PRELOAD by idempotency_testing::mariadb_server::SlowRedo.
 *
 * While the file named by SLOW_REDO_FLAG exists, every write to InnoDB's redo log
 * (ib_logfile*) waits SLOW_REDO_MS milliseconds before it is made: a slow disk under the
 * log, so that a test can crash the server between a commit becoming visible to other
 * sessions and its redo record reaching the file. The first write held back creates the file
 * SLOW_REDO_ENGAGED, so that the test can tell the library took hold. Every other write, and
 * every write while the flag is absent, goes straight through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

typedef ssize_t (*pwrite_fn)(int, const void *, size_t, off_t);
typedef ssize_t (*pwrite64_fn)(int, const void *, size_t, off64_t);

static pwrite_fn real_pwrite;
static pwrite64_fn real_pwrite64;

__attribute__((constructor)) static void find_the_real_writes(void) {
    real_pwrite = (pwrite_fn)dlsym(RTLD_NEXT, "pwrite");
    real_pwrite64 = (pwrite64_fn)dlsym(RTLD_NEXT, "pwrite64");
    if (real_pwrite == NULL || real_pwrite64 == NULL) {
        fprintf(stderr, "slow_redo: pwrite or pwrite64 not found\n");
        abort();
    }
}

static int is_redo_log(int fd) {
    char link[64];
    char path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n <= 0) {
        return 0;
    }
    path[n] = 0;
    return strstr(path, "ib_logfile") != NULL;
}

static void hold_back(int fd) {
    const char *flag = getenv("SLOW_REDO_FLAG");
    struct stat st;
    if (flag != NULL && stat(flag, &st) == 0 && is_redo_log(fd)) {
        const char *engaged = getenv("SLOW_REDO_ENGAGED");
        if (engaged != NULL) {
            int marker = open(engaged, O_WRONLY | O_CREAT, 0644);
            if (marker >= 0) {
                close(marker);
            }
        }
        const char *ms = getenv("SLOW_REDO_MS");
        usleep((useconds_t)(ms != NULL ? atoi(ms) : 1000) * 1000);
    }
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    hold_back(fd);
    return real_pwrite(fd, buf, count, offset);
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off64_t offset) {
    hold_back(fd);
    return real_pwrite64(fd, buf, count, offset);
}
