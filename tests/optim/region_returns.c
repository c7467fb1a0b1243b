/* The native region's return (pipeoff/_native/hoststep.c, `parallel`): the caller,
 * out of chunks, waits until every chunk is done before it returns, so that what the
 * region wrote is whole when the kernel call returns.
 *
 * This file includes hoststep.c as it is and wraps pthread_cond_wait with a macro
 * (nothing in hoststep.c changes), so that a helper's chunk is held open by order,
 * not by time: the helper, holding a chunk, waits until the caller is about to wait
 * for the region's end (the caller's first chunk waits until the helper holds one).
 * With the wait, the caller waits, the helper's chunk finishes, the region returns
 * with every chunk done: "returned". Without it, the caller returns with the
 * helper's chunk still open: "early" and exit 1, every time.
 *
 * Built by tests/optim/test_host_kernel.py::test_the_region_returns_after_its_last_chunk.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

static pthread_mutex_t t_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t t_cond = PTHREAD_COND_INITIALIZER;
static pthread_t t_caller;
static int t_helper_in_chunk; /* a helper holds a chunk */
static int t_caller_waiting;  /* the caller is about to wait for the region's end */
static int t_started, t_finished;

static int is_caller(void) { return pthread_equal(pthread_self(), t_caller); }

static void t_set(int *flag) {
    pthread_mutex_lock(&t_lock);
    *flag = 1;
    pthread_cond_broadcast(&t_cond);
    pthread_mutex_unlock(&t_lock);
}

static void t_wait_for(const int *flag) {
    pthread_mutex_lock(&t_lock);
    while (!*flag) pthread_cond_wait(&t_cond, &t_lock);
    pthread_mutex_unlock(&t_lock);
}

static int hooked_cond_wait(pthread_cond_t *c, pthread_mutex_t *m) {
    if (is_caller()) t_set(&t_caller_waiting);
    return pthread_cond_wait(c, m);
}

#define pthread_cond_wait hooked_cond_wait
#include "hoststep.c"
#undef pthread_cond_wait

static void chunk(void *arg, int64_t begin, int64_t end) {
    (void)arg;
    (void)begin;
    (void)end;
    static int caller_chunks;
    __atomic_add_fetch(&t_started, 1, __ATOMIC_ACQ_REL);
    if (is_caller()) {
        if (caller_chunks++ == 0) t_wait_for(&t_helper_in_chunk);
    } else if (!t_helper_in_chunk) {
        t_set(&t_helper_in_chunk);
        t_wait_for(&t_caller_waiting); /* open until the caller waits for the region */
    }
    __atomic_add_fetch(&t_finished, 1, __ATOMIC_ACQ_REL);
}

int main(void) {
    t_caller = pthread_self();
    /* Two threads (the caller and one helper) over a few chunks. */
    parallel(chunk, NULL, (int64_t)4 * MIN_PER_THREAD, 2);
    int started = __atomic_load_n(&t_started, __ATOMIC_ACQUIRE);
    int finished = __atomic_load_n(&t_finished, __ATOMIC_ACQUIRE);
    if (finished < started) {
        printf("early: %d of %d chunks done\n", finished, started);
        return 1;
    }
    puts("returned");
    return 0;
}
