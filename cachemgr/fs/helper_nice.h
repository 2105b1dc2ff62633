/* The priority of a helper thread that cachemgr's C extensions start (a scan's stat threads,
 * the unlinkers): `by` (cachemgr.fs.NICE) nicer than the thread that started it, whose
 * niceness it inherits, and at most 19. Relative, not absolute: under `nice -n 19`, run by
 * root, helpers set to 10 would run ahead of the daemon's own threads. Per thread on Linux;
 * best effort (a failure leaves the helper at its starter's priority). */
#ifndef HELPER_NICE_H
#define HELPER_NICE_H

#include <errno.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline void helper_nice(int by) {
    if (by == 0)
        return;
    id_t tid = (id_t)syscall(SYS_gettid);
    errno = 0;
    int now = getpriority(PRIO_PROCESS, tid); /* -1 is a niceness too: errno tells */
    if (errno == 0)
        setpriority(PRIO_PROCESS, tid, now + by > 19 ? 19 : now + by);
}

#endif
