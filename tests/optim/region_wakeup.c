/* The native region's end-of-region wake-up (pipeoff/_native/hoststep.c, `parallel` and
 * `region_work`), with its lost-wake-up window held open.
 *
 * The caller of a region, once out of chunks, takes the region's mutex, sees
 * `done < chunks` and waits on `all_done`; the helper that finishes the last chunk
 * broadcasts `all_done`. The broadcast must be made holding that mutex: between the
 * caller's check and its pthread_cond_wait (which releases the mutex atomically) it
 * then cannot land, so it cannot be lost. Unlocked, it can, and the caller waits
 * forever (the kernel call never returns).
 *
 * This file includes hoststep.c as it is, and wraps three pthread calls with macros
 * (nothing in hoststep.c changes) so that the window is held open by order, not by
 * time: the caller, about to wait with `done < chunks`, waits until the helper that
 * holds the last chunk has finished it and either broadcast (then the broadcast is
 * unguarded: the caller goes on to wait, and with a correct kernel it would not have
 * seen `done < chunks`) or started to take the region's mutex (the guarded broadcast:
 * it comes once the caller waits). Which thread runs which chunk is held the same way:
 * the caller's first chunk waits until the helper holds one, and the helper's chunk
 * until the caller is about to wait.
 *
 * Exit 0 and "returned" when the region returns; with an unguarded broadcast it never
 * does (the test runs this under a timeout). Built by
 * tests/optim/test_host_kernel.py::test_the_last_chunks_wake_up_reaches_a_caller_about_to_wait.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

static pthread_mutex_t t_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t t_cond = PTHREAD_COND_INITIALIZER;
static pthread_t t_caller;
static int t_helper_in_chunk;  /* the helper holds a chunk */
static int t_caller_waiting;   /* the caller saw done < chunks and is about to wait */
static int t_helper_signalled; /* the helper's last chunk is done: it broadcast */
static int t_helper_locking;   /* ... or it is taking the region's mutex to */
static int t_held;             /* the caller's first wait was held (once) */

static int is_caller(void) { return pthread_equal(pthread_self(), t_caller); }

static void t_set(int *flag) {
    pthread_mutex_lock(&t_lock);
    *flag = 1;
    pthread_cond_broadcast(&t_cond);
    pthread_mutex_unlock(&t_lock);
}

static void t_wait_for(const int *a, const int *b) {
    pthread_mutex_lock(&t_lock);
    while (!*a && !(b && *b)) pthread_cond_wait(&t_cond, &t_lock);
    pthread_mutex_unlock(&t_lock);
}

/* The region's own calls, wrapped. */
static int hooked_mutex_lock(pthread_mutex_t *m) {
    if (!is_caller()) t_set(&t_helper_locking); /* a helper's only lock: its broadcast's */
    return pthread_mutex_lock(m);
}

static int hooked_cond_broadcast(pthread_cond_t *c) {
    int rc = pthread_cond_broadcast(c);
    if (!is_caller()) t_set(&t_helper_signalled);
    return rc;
}

static int hooked_cond_wait(pthread_cond_t *c, pthread_mutex_t *m) {
    if (is_caller() && !t_held) {
        t_held = 1;
        t_set(&t_caller_waiting);
        t_wait_for(&t_helper_signalled, &t_helper_locking);
    }
    return pthread_cond_wait(c, m);
}

#define pthread_mutex_lock hooked_mutex_lock
#define pthread_cond_broadcast hooked_cond_broadcast
#define pthread_cond_wait hooked_cond_wait
#include "hoststep.c"
#undef pthread_mutex_lock
#undef pthread_cond_broadcast
#undef pthread_cond_wait

static void chunk(void *arg, int64_t begin, int64_t end) {
    (void)arg;
    (void)begin;
    (void)end;
    static int caller_chunks;
    if (is_caller()) {
        if (caller_chunks++ == 0) t_wait_for(&t_helper_in_chunk, NULL);
    } else {
        t_set(&t_helper_in_chunk);
        t_wait_for(&t_caller_waiting, NULL); /* the last chunk to finish: this one */
    }
}

int main(void) {
    t_caller = pthread_self();
    /* Two threads (the caller and one helper) over a few chunks. */
    parallel(chunk, NULL, (int64_t)4 * MIN_PER_THREAD, 2);
    puts("returned");
    return 0;
}
