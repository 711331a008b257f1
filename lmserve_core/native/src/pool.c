/*
 * Persistent thread pool. A dispatch publishes a job of n tasks and bumps a generation
 * counter; workers spin on it for ~150 us (a forward pass dispatches hundreds of jobs per
 * token, so wake-up must take microseconds), then sleep on a futex (condition variable off
 * Linux) so an idle server does not burn cores. The caller is thread 0 and runs task 0.
 *
 * Tasks are claimed from one atomic word (generation | n | next index), so a worker that the
 * OS has descheduled never holds up a job: whoever is running claims the remaining tasks.
 * Claiming with the generation in the word also means a late worker cannot run a task of a
 * job that has already finished.
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

#define SPIN_NS 150000   /* how long an idle worker spins before it sleeps */
#define MAX_TASKS 0xFFFF /* tasks per job (16 bits of the claim word) */

struct lm_pool {
    int n; /* threads including the caller */
    pthread_t *threads;
    struct worker *workers;
    _Atomic uint32_t gen;   /* futex word: bumped once per job */
    _Atomic uint64_t claim; /* gen << 32 | n_tasks << 16 | next task */
    _Atomic int done;       /* tasks finished in the current job */
    _Atomic int sleepers;   /* workers blocked (or about to block) on gen */
    _Atomic int stop;
    _Atomic int busy; /* one dispatcher at a time; others run inline */
    lm_job_fn fn;
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

/* Claim and run tasks of the job published in `claim` until none is left; returns the
 * generation it worked on. */
static uint32_t run_claimed(lm_pool *p, int thread) {
    uint64_t c = atomic_load_explicit(&p->claim, memory_order_acquire);
    for (;;) {
        const int n = (int)((c >> 16) & MAX_TASKS);
        const int task = (int)(c & MAX_TASKS);
        if (task >= n) {
            return (uint32_t)(c >> 32);
        }
        if (atomic_compare_exchange_weak_explicit(&p->claim, &c, c + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            /* fn and ctx belong to this generation: the job cannot finish before our task */
            p->fn(p->ctx, task, n, thread);
            atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
            c = atomic_load_explicit(&p->claim, memory_order_acquire);
        }
    }
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    lm_pool *p = w->pool;
    uint32_t seen = 0;
    for (;;) {
        int64_t t0 = now_ns();
        unsigned spins = 0;
        while (atomic_load_explicit(&p->gen, memory_order_acquire) == seen) {
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
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) {
            return NULL;
        }
        seen = run_claimed(p, w->ith);
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

void lm_pool_run_tasks(lm_pool *pool, lm_job_fn fn, void *ctx, int n_tasks) {
    if (n_tasks <= 0) {
        return;
    }
    if (n_tasks > MAX_TASKS) {
        n_tasks = MAX_TASKS;
    }
    if (pool->n <= 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) {
            fn(ctx, t, n_tasks, 0);
        }
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
    const uint32_t gen = atomic_load_explicit(&pool->gen, memory_order_relaxed) + 1;
    /* task 0 is the caller's: publish the job with next = 1 */
    atomic_store(&pool->claim, (uint64_t)gen << 32 | (uint64_t)n_tasks << 16 | 1u);
    atomic_store(&pool->gen, gen);
    if (atomic_load(&pool->sleepers) > 0) {
        wake_all(pool);
    }
    fn(ctx, 0, n_tasks, 0);
    atomic_fetch_add_explicit(&pool->done, 1, memory_order_relaxed);
    run_claimed(pool, 0);
    unsigned spins = 0;
    while (atomic_load_explicit(&pool->done, memory_order_acquire) < n_tasks) {
        /* a claimed task is running on a worker; yield if that takes long (the worker
         * may have been descheduled and need this core) */
        if (++spins < 4096) {
            cpu_relax();
        } else {
            sched_yield();
        }
    }
}

struct run_adapter {
    lm_task_fn fn;
    void *ctx;
};

static void run_adapter_fn(void *arg, int task, int n_tasks, int thread) {
    (void)thread;
    const struct run_adapter *a = arg;
    a->fn(a->ctx, task, n_tasks);
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
    struct run_adapter a = {fn, ctx};
    lm_pool_run_tasks(pool, run_adapter_fn, &a, pool->n);
    lm_pool_release(pool);
}

#undef SPIN_NS
#undef MAX_TASKS
