/*
 * Persistent thread pool. A dispatch bumps a generation counter; workers spin on it for
 * ~150 us (a forward pass dispatches hundreds of ops per token, so wake-up must take
 * microseconds), then sleep on a futex (condition variable off Linux) so an idle server
 * does not burn cores. The caller is thread 0.
 */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "lm_internal.h"

#define SPIN_NS 150000 /* how long an idle worker spins before it sleeps */

struct lm_pool {
    int n; /* threads including the caller */
    pthread_t *threads;
    struct worker *workers;
    _Atomic uint32_t gen; /* futex word: bumped once per dispatch */
    _Atomic int pending;  /* workers still running the current task */
    _Atomic int sleepers; /* workers blocked (or about to block) on gen */
    _Atomic int stop;
    _Atomic int busy; /* one dispatcher at a time; others run inline */
    lm_task_fn fn;
    void *ctx;
    void *scratch;
    size_t scratch_size;
#ifndef __linux__
    pthread_mutex_t mu;
    pthread_cond_t cv;
#endif
};

struct worker {
    lm_pool *pool;
    int ith;
};

/* ------------------------------------------------------------------ small helpers */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void *lm_aligned_alloc(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) {
        return NULL;
    }
    return p;
}

void lm_aligned_free(void *p) {
    free(p);
}

/* ------------------------------------------------------------------ sleeping */
static void wait_gen(lm_pool *p, uint32_t seen) {
#ifdef __linux__
    /* Returns at once if gen already moved on: the kernel compares before sleeping. */
    syscall(SYS_futex, (uint32_t *)&p->gen, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->gen) == seen && !atomic_load(&p->stop)) {
        pthread_cond_wait(&p->cv, &p->mu);
    }
    pthread_mutex_unlock(&p->mu);
#endif
}

static void wake_all(lm_pool *p) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)&p->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
#endif
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    lm_pool *p = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g;
        int64_t t0 = now_ns();
        unsigned spins = 0;
        while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen) {
            cpu_relax();
            if ((++spins & 127u) == 0 && now_ns() - t0 > SPIN_NS) {
                /* sleepers++ before re-reading gen pairs with the dispatcher's gen++
                 * before reading sleepers (both seq_cst): one of us sees the other. */
                atomic_fetch_add(&p->sleepers, 1);
                if (atomic_load(&p->gen) == seen) {
                    wait_gen(p, seen);
                }
                atomic_fetch_sub(&p->sleepers, 1);
                t0 = now_ns();
            }
        }
        seen = g;
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) {
            return NULL;
        }
        p->fn(p->ctx, w->ith, p->n);
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_release);
    }
}

/* ------------------------------------------------------------------ lifecycle */
lm_pool *lm_pool_new(int n_threads) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > 1024) {
        n_threads = 1024;
    }
    lm_pool *p = calloc(1, sizeof *p);
    if (p == NULL) {
        return NULL;
    }
    p->n = n_threads;
#ifndef __linux__
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
#endif
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (p->threads == NULL || p->workers == NULL) {
            free(p->threads);
            free(p->workers);
            free(p);
            return NULL;
        }
        for (int i = 0; i < n_threads - 1; i++) {
            p->workers[i].pool = p;
            p->workers[i].ith = i + 1;
            if (pthread_create(&p->threads[i], NULL, worker_main, &p->workers[i]) != 0) {
                /* run with the workers we have */
                p->n = i + 1;
                break;
            }
        }
    }
    return p;
}

void lm_pool_free(lm_pool *pool) {
    if (pool == NULL) {
        return;
    }
    atomic_store(&pool->stop, 1);
    atomic_fetch_add(&pool->gen, 1);
    wake_all(pool);
    for (int i = 0; i < pool->n - 1; i++) {
        pthread_join(pool->threads[i], NULL);
    }
#ifndef __linux__
    pthread_mutex_destroy(&pool->mu);
    pthread_cond_destroy(&pool->cv);
#endif
    lm_aligned_free(pool->scratch);
    free(pool->threads);
    free(pool->workers);
    free(pool);
}

int lm_pool_size(const lm_pool *pool) {
    return pool ? pool->n : 1;
}

/* ------------------------------------------------------------------ dispatch */
int lm_pool_acquire(lm_pool *pool) {
    int expected = 0;
    return pool != NULL && atomic_compare_exchange_strong(&pool->busy, &expected, 1);
}

void lm_pool_release(lm_pool *pool) {
    atomic_store_explicit(&pool->busy, 0, memory_order_release);
}

void *lm_pool_scratch(lm_pool *pool, size_t bytes) {
    if (bytes > pool->scratch_size) {
        void *p = lm_aligned_alloc(bytes);
        if (p == NULL) {
            return NULL;
        }
        lm_aligned_free(pool->scratch);
        pool->scratch = p;
        pool->scratch_size = bytes;
    }
    return pool->scratch;
}

void lm_pool_run_acquired(lm_pool *pool, lm_task_fn fn, void *ctx) {
    if (pool->n <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->pending, pool->n - 1, memory_order_relaxed);
    atomic_fetch_add(&pool->gen, 1);
    if (atomic_load(&pool->sleepers) > 0) {
        wake_all(pool);
    }
    fn(ctx, 0, pool->n);
    unsigned spins = 0;
    while (atomic_load_explicit(&pool->pending, memory_order_acquire) > 0) {
        /* a worker may have been descheduled: stop hogging the core after a while */
        if (++spins < 20000) {
            cpu_relax();
        } else {
            sched_yield();
        }
    }
}

void lm_pool_run(lm_pool *pool, lm_task_fn fn, void *ctx) {
    if (fn == NULL) {
        return;
    }
    /* NULL pool, or a pool already dispatching (nested or concurrent use): run inline. */
    if (!lm_pool_acquire(pool)) {
        fn(ctx, 0, 1);
        return;
    }
    lm_pool_run_acquired(pool, fn, ctx);
    lm_pool_release(pool);
}

#undef SPIN_NS
