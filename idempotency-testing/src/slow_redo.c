/*
 * Loaded into mariadbd with LD_PRELOAD by idempotency_testing::mariadb_server::SlowRedo.
 *
 * While the file named by SLOW_REDO_FLAG exists, every write to InnoDB's redo log
 * (ib_logfile*) waits SLOW_REDO_MS milliseconds before it is made: a slow disk under the
 * log, so that a test can crash the server between a commit becoming visible to other
 * sessions and its redo record reaching the file. Every other write, and every write while
 * the flag is absent, goes straight through.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

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
        const char *ms = getenv("SLOW_REDO_MS");
        usleep((useconds_t)(ms != NULL ? atoi(ms) : 1000) * 1000);
    }
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off_t offset) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (real == NULL) {
        real = (ssize_t (*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite64");
    }
    hold_back(fd);
    return real(fd, buf, count, offset);
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (real == NULL) {
        real = (ssize_t (*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite");
    }
    hold_back(fd);
    return real(fd, buf, count, offset);
}
