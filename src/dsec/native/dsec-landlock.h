/*
 * dsec-landlock.h: exec levels of a container sandbox's init (dsec-shim), on a kernel with
 * Landlock signal scoping (ABI 6). Inlined by the build. The rule, on every backend: nothing
 * an exec leaves running may signal a later exec (kill it and fake its status), and a later
 * exec may still signal what earlier ones left (`pkill -f server`).
 *
 * Landlock's scope is one-way: a process of a scoped domain signals only processes of that
 * domain or of domains nested in it. So the init keeps a chain of LL_LEVELS threads, thread
 * j in a scoped domain nested j + 1 deep (level j; Landlock restricts the calling thread,
 * and a thread started by another starts in its domain), and forks each exec from the
 * thread of the deepest level that is shallower than every process of the chain still
 * running: everything that ran before is nested in the new exec's level (it may signal
 * them), the new exec is nested in none of theirs (they may not signal it). Two execs never
 * share a level while the first has a process left. The init's main thread is in no domain
 * (it signals everything). Which level a process is in is asked of the kernel: kill(pid, 0)
 * from level j's thread fails with EPERM unless the process is at level j or deeper.
 *
 * When level 0 is taken (LL_LEVELS generations of execs that each left a process running), a
 * new chain starts beside the old one: its execs cannot be signalled by anything of the old
 * chain, nor signal it (pkill no longer reaches what was started before). What ptrace may
 * reach is the exec's own domain's business (child_own_domain, dsec-child.h): siblings.
 */
#include <pthread.h>

#define LL_LEVELS 8
#define LL_SCOPE_SIGNAL 2ULL

struct ll_job {
    int probe;                               /* 1: kill(pid, 0) each of pids; 0: fork */
    const pid_t *pids;
    int n;
    unsigned char *reach;                    /* probe: 1 where this level may signal pids[i] (2: gone) */
    void (*child)(void *);                   /* fork: what the child runs (never returns) */
    void *arg;
    pid_t pid;
    int err;
};
struct ll_report { int level, err; };

static int ll_go[LL_LEVELS][2];              /* the main thread -> level j's thread: a job */
static int ll_done[2] = {-1, -1};            /* every level -> the main thread: started, done */
static int ll_on;                            /* a chain serves */

static int ll_spawn_thread(int level);

static void *ll_thread(void *arg) {
    int level = (int)(intptr_t)arg, go = ll_go[level][0]; /* (the main thread reuses ll_go) */
    struct ll_report r = {level, landlock_domain(LL_SCOPE_SIGNAL)};
    if (!r.err && level + 1 < LL_LEVELS) r.err = ll_spawn_thread(level + 1); /* nested in this */
    (void)!write(ll_done[1], &r, sizeof r);
    for (struct ll_job *job; !r.err;) {
        ssize_t n = read(go, &job, sizeof job);
        if (n < 0 && errno == EINTR) continue;
        if (n != sizeof job || job == NULL) break; /* retired: a new chain took over */
        if (job->probe) {
            for (int i = 0; i < job->n; i++) /* 1: at this level or deeper, 0: not, 2: gone */
                job->reach[i] = kill(job->pids[i], 0) == 0 ? 1 : errno == EPERM ? 0 : 2;
        } else {
            job->pid = fork();
            if (job->pid == 0) job->child(job->arg);
            job->err = errno;
        }
        (void)!write(ll_done[1], &r, sizeof r);
    }
    close(go);
    return NULL;
}

static int ll_spawn_thread(int level) {
    pthread_attr_t a;
    pthread_t t;
    pthread_attr_init(&a);
    pthread_attr_setstacksize(&a, 2 << 20); /* (an exec's child runs on it: execvp's argv copy) */
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    int err = pthread_create(&t, &a, ll_thread, (void *)(intptr_t)level);
    pthread_attr_destroy(&a);
    return err;
}

static void ll_run(int level, struct ll_job *job) {
    struct ll_report r;
    if (write(ll_go[level][1], &job, sizeof job) != sizeof job) { job->pid = -1; job->err = errno; return; }
    while (read(ll_done[0], &r, sizeof r) < 0 && errno == EINTR) {
    }
}

/* End the current chain's threads (their domains live on in their processes). */
static void ll_retire(void) {
    struct ll_job *none = NULL;
    for (int j = 0; ll_on && j < LL_LEVELS; j++) {
        (void)!write(ll_go[j][1], &none, sizeof none);
        close(ll_go[j][1]);
    }
    ll_on = 0;
}

/* Start a new chain of levels (its threads start one another: ll_finish waits for them):
 * 0, or an errno. Needs no_new_privs (the runtime set it for the init). */
static int ll_building, ll_started, ll_failed, ll_expected, ll_err;
static int ll_start(void) {
    ll_retire();
    if (ll_done[0] < 0 && pipe2(ll_done, O_CLOEXEC) < 0) return errno;
    for (int j = 0; j < LL_LEVELS; j++)
        if (pipe2(ll_go[j], O_CLOEXEC) < 0) {
            int err = errno;
            while (j-- > 0) close(ll_go[j][0]), close(ll_go[j][1]);
            return err;
        }
    sigset_t all, old;
    sigfillset(&all); /* the threads take no signal: SIGCHLD is the main thread's signalfd's */
    pthread_sigmask(SIG_BLOCK, &all, &old);
    ll_err = ll_spawn_thread(0);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    ll_failed = -1, ll_started = 0, ll_expected = ll_err ? 0 : LL_LEVELS;
    ll_building = 1;
    return 0;
}

/* Wait until the chain ll_start began serves (0) or failed (an errno: its threads end). */
static int ll_finish(void) {
    ll_building = 0;
    while (ll_started < ll_expected) { /* each level reports once; one that fails starts no deeper one */
        struct ll_report r;
        if (read(ll_done[0], &r, sizeof r) != sizeof r) {
            if (errno == EINTR) continue;
            ll_err = errno;
            break;
        }
        ll_started++;
        if (r.err) ll_err = r.err, ll_failed = r.level, ll_expected = r.level + 1;
    }
    if (!ll_err) { ll_on = 1; return 0; }
    struct ll_job *none = NULL;
    for (int j = 0; j < LL_LEVELS; j++) {
        if (j >= ll_started) close(ll_go[j][0]); /* no thread: never started */
        else if (j != ll_failed) (void)!write(ll_go[j][1], &none, sizeof none); /* it closes its end */
        close(ll_go[j][1]);                        /* (the failed one closed its end and ended) */
    }
    return ll_err;
}

static int ll_build(void) {
    int err = ll_start();
    return err ? err : ll_finish();
}

/* Level j's thread: which of pids[0..n) it may signal, written to reach[]. */
static void ll_probe(int level, const pid_t *pids, int n, unsigned char *reach) {
    struct ll_job job = {.probe = 1, .pids = pids, .n = n, .reach = reach};
    ll_run(level, &job);
}

/* The level of the next exec: the deepest one shallower than every process of the chain
 * (pids: every process of the sandbox but the init and its own helpers); -1 when level 0 is
 * taken. */
static int ll_place(pid_t *pids, int n) {
    if (n == 0) return LL_LEVELS - 1;
    unsigned char *reach = malloc((size_t)n);
    if (!reach) return -1;
    ll_probe(0, pids, n, reach); /* the chain's processes (not an older chain's, nor ended) */
    int m = 0;
    for (int i = 0; i < n; i++)
        if (reach[i] == 1) pids[m++] = pids[i];
    int level = LL_LEVELS - 1;
    for (int j = LL_LEVELS - 1; m > 0 && j >= 0; j--) {
        ll_probe(j, pids, m, reach); /* those at level j or deeper: off the list */
        int rest = 0, here = 0;
        for (int i = 0; i < m; i++) {
            if (!reach[i]) pids[rest++] = pids[i];
            here |= reach[i] == 1;
        }
        if (here) level = j - 1;
        m = rest;
    }
    free(reach);
    return level;
}

/* Fork at a level (a new chain first when none is left, or none serves yet); the child runs
 * child(arg). Without levels (a kernel without signal scoping: ll_levels 0), fork here.
 * Returns the pid, or -1 with errno. */
static int ll_levels;
static pid_t ll_fork(pid_t *pids, int n, void (*child)(void *), void *arg) {
    if (!ll_levels) {
        pid_t pid = fork();
        if (pid == 0) child(arg);
        return pid;
    }
    if (ll_building) ll_finish(); /* (started with the init: see run_init) */
    int level = ll_on ? ll_place(pids, n) : -1, err = 0;
    if (level < 0 && (err = ll_build()) == 0) level = LL_LEVELS - 1;
    if (level < 0) { errno = err ? err : EAGAIN; return -1; } /* never an exec in no level */
    struct ll_job job = {.probe = 0, .child = child, .arg = arg};
    ll_run(level, &job);
    errno = job.err;
    return job.pid;
}
