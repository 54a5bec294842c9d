/*
 * dsec-levels.h: exec levels as PID namespaces, for an init whose kernel has no Landlock
 * signal scoping: dsec-shim in gVisor, dsec-guest in a microVM (the container's init uses
 * dsec-landlock.h). Inlined by the build. The rule, on every backend: nothing an exec leaves
 * running may signal, or reach through /proc, a later exec; a later exec may still signal
 * what earlier ones left (`pkill -f server`).
 *
 * A chain is NS_LEVELS nested PID namespaces below the init's, each with a holder as its
 * PID 1 (level k's holder starts level k + 1's) in a mount namespace of its own whose /proc
 * shows that namespace: a process sees, and can name, only its level and the deeper ones.
 * Each exec runs in the deepest level shallower than every process of the chain still
 * running, so everything that ran before is below it (visible, killable) and it is above all
 * of them (out of their sight). Two execs never share a level while the first has a process
 * left. A process's level is its /proc/<pid>/ns/pid. When level 0 is taken, a new chain
 * starts beside the old one (the two cannot see each other); chains with nothing left
 * running go, and past NS_CHAINS the oldest goes with its processes (a later exec could have
 * killed them anyway). A holder is killed only from a shallower level (a later exec): its
 * level and the deeper ones end with it.
 *
 * Holders are either active (gVisor, which has no setns(2) into a PID namespace: each one
 * forks its level's execs, speaking dsec-shim's protocol on a socket) or passive (the guest:
 * the agent forks into a level with setns(2) and the child joins its mount namespace; the
 * holder only reaps what is orphaned there).
 */
#define NS_LEVELS 4
#define NS_CHAINS 3

struct ns_level {
    int sock;                  /* active: the holder's socket (-1: its level ended) */
    int pidns, mntns, root;    /* passive: its namespaces and root directory */
    char ns[48];               /* readlink of /proc/<pid>/ns/pid of the level's processes */
};
struct ns_chain {
    pid_t first;               /* level 0's holder (0: no chain here) */
    unsigned seq;              /* build order */
    struct ns_level lv[NS_LEVELS];
};
static struct ns_chain ns_chains[NS_CHAINS];
static int ns_current = -1;
static unsigned ns_seq;
static int ns_active;                          /* holders fork (1) or only reap (0) */
static void (*ns_serve)(int sock);             /* active: the holder's loop (never returns) */
static void (*ns_ending)(int chain);           /* before a chain is ended */
/* Execs handed to a level and not ended (active holders: forked there, or about to be) */
static int ns_inflight[NS_CHAINS][NS_LEVELS];
static int (*ns_after_proc)(void);             /* after a level's /proc is mounted (masks) */

/* One datagram with descriptors (SCM_RIGHTS, at most 8): 0, or -1 with errno. */
static int send_fds(int sock, const void *data, size_t len, const int *fds, int nfds) {
    char cbuf[CMSG_SPACE(sizeof(int) * 8)];
    struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 8) { errno = EINVAL; return -1; }
    if (nfds) {
        msg.msg_control = cbuf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
    }
    return sendmsg(sock, &msg, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

/* A holder's report to the builder: an errno, its namespace, its descriptors. */
static int ns_send(int sock, int err, const char *ns, const int *fds, int nfds) {
    char data[4 + 48];
    memset(data, 0, sizeof data);
    memcpy(data, &err, 4);
    snprintf(data + 4, 48, "%s", ns);
    return send_fds(sock, data, sizeof data, fds, nfds);
}

/* Level 0's holder, PID 1 of its namespace, and in turn each deeper one (started by the
 * one above it): set up, report on `build`, start the next level, then serve. Never returns. */
static void ns_holder(int build) {
    int mine = -1;
    for (int k = 0;; k++) {
        int err = 0, fds[3] = {-1, -1, -1}, nfds = 0;
        char ns[48] = "";
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
            err = errno;
        if (!err && ns_after_proc) err = ns_after_proc();
        if (!err && readlink("/proc/self/ns/pid", ns, sizeof ns - 1) < 0) err = errno;
        if (!err && ns_active) {
            int s[2];
            if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, s) < 0) err = errno;
            else mine = s[0], fds[nfds++] = s[1];
        } else if (!err) {
            fds[0] = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
            fds[1] = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
            fds[2] = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
            nfds = 3;
            for (int i = 0; i < 3; i++) if (fds[i] < 0 && !err) err = errno;
        }
        if (ns_send(build, err, ns, err ? NULL : fds, err ? 0 : nfds) < 0 || err) _exit(1);
        for (int i = 0; i < nfds; i++) close(fds[i]);
        if (k + 1 < NS_LEVELS) {
            pid_t next = (pid_t)syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0);
            if (next == 0) { /* the next level's holder: nothing of this one's */
                if (mine >= 0) close(mine);
                continue;
            }
            if (next < 0) _exit(1); /* the builder sees the missing report */
        }
        break;
    }
    close(build);
    if (ns_active) ns_serve(mine);
    /* passive: hold nothing, take no signal, reap what ends here (SIGCHLD ignored: the
     * kernel does) */
    syscall(SYS_close_range, 3, ~0U, 0);
    for (int s = 1; s < NSIG; s++) signal(s, SIG_IGN);
    sigset_t none;
    sigemptyset(&none);
    for (;;) sigsuspend(&none);
}

static void ns_close_chain(struct ns_chain *c) {
    for (int k = 0; k < NS_LEVELS; k++) {
        struct ns_level *l = &c->lv[k];
        int *fds[] = {&l->sock, &l->pidns, &l->mntns, &l->root};
        for (int i = 0; i < 4; i++) if (*fds[i] >= 0) close(*fds[i]), *fds[i] = -1;
    }
    c->first = 0;
}

/* End chain c: SIGKILL to level 0's holder ends every level of it (the kernel kills a PID
 * namespace's processes when its init ends). It is reaped as a child of ours. */
static void ns_end_chain(int c) {
    if (ns_ending && ns_chains[c].first) ns_ending(c);
    if (ns_chains[c].first > 0) kill(ns_chains[c].first, SIGKILL);
    ns_close_chain(&ns_chains[c]);
    if (ns_current == c) ns_current = -1;
}

/* A new chain in slot c: 0 or an errno. */
static int ns_build(int c) {
    struct ns_chain *ch = &ns_chains[c];
    memset(ch, 0, sizeof *ch);
    for (int k = 0; k < NS_LEVELS; k++) ch->lv[k].sock = ch->lv[k].pidns = ch->lv[k].mntns = ch->lv[k].root = -1;
    int b[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, b) < 0) return errno;
    pid_t first = (pid_t)syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0);
    if (first == 0) { close(b[0]); ns_holder(b[1]); }
    int err = first < 0 ? errno : 0;
    close(b[1]);
    for (int k = 0; !err && k < NS_LEVELS; k++) {
        char data[52], cbuf[CMSG_SPACE(sizeof(int) * 3)];
        struct iovec iov = {.iov_base = data, .iov_len = sizeof data};
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
        ssize_t n;
        do { n = recvmsg(b[0], &msg, MSG_CMSG_CLOEXEC); } while (n < 0 && errno == EINTR);
        if (n != (ssize_t)sizeof data) { err = n < 0 ? errno : ECHILD; break; }
        int fds[3] = {-1, -1, -1}, nfds = 0;
        for (struct cmsghdr *m = CMSG_FIRSTHDR(&msg); m; m = CMSG_NXTHDR(&msg, m))
            if (m->cmsg_level == SOL_SOCKET && m->cmsg_type == SCM_RIGHTS)
                for (size_t i = 0; i < (m->cmsg_len - CMSG_LEN(0)) / sizeof(int) && nfds < 3; i++)
                    memcpy(&fds[nfds++], CMSG_DATA(m) + i * sizeof(int), sizeof(int));
        memcpy(&err, data, 4);
        struct ns_level *l = &ch->lv[k];
        snprintf(l->ns, sizeof l->ns, "%s", data + 4);
        if (ns_active) l->sock = fds[0];
        else l->pidns = fds[0], l->mntns = fds[1], l->root = fds[2];
        if (!err && nfds != (ns_active ? 1 : 3)) err = EPROTO;
    }
    close(b[0]);
    ch->first = first > 0 ? first : 0;
    if (err) { ns_end_chain(c); return err; }
    ch->seq = ++ns_seq;
    ns_current = c;
    return 0;
}

/* How many processes each level of each chain holds (its holder included: 0 means the
 * level ended). */
static void ns_count(int counts[NS_CHAINS][NS_LEVELS]) {
    memset(counts, 0, sizeof(int) * NS_CHAINS * NS_LEVELS);
    DIR *d = opendir("/proc");
    if (d == NULL) return;
    struct dirent *e;
    char path[64], ns[48];
    pid_t me = getpid();
    while ((e = readdir(d)) != NULL) {
        pid_t p = (pid_t)atoi(e->d_name);
        if (p <= 0 || p == me) continue;
        snprintf(path, sizeof path, "/proc/%d/ns/pid", p);
        ssize_t n = readlink(path, ns, sizeof ns - 1);
        if (n <= 0) continue;
        ns[n] = 0;
        for (int c = 0; c < NS_CHAINS; c++)
            for (int k = 0; ns_chains[c].first && k < NS_LEVELS; k++)
                if (strcmp(ns, ns_chains[c].lv[k].ns) == 0) counts[c][k]++;
    }
    closedir(d);
    for (int c = 0; c < NS_CHAINS; c++)
        for (int k = 0; k < NS_LEVELS; k++) counts[c][k] += ns_inflight[c][k];
}

/* Where the next exec runs: *chain and its level (a new chain when the current one has no
 * free level). 0 or an errno. */
static int ns_place(int *chain, int *level) {
    int counts[NS_CHAINS][NS_LEVELS];
    ns_count(counts);
    int c = ns_current;
    if (c >= 0) {
        int top = NS_LEVELS;
        for (int k = 0; k < NS_LEVELS && top == NS_LEVELS; k++)
            if (counts[c][k] >= 2) top = k; /* a process besides the holder */
        int k = top - 1;
        if (k >= 0 && counts[c][k] >= 1) { *chain = c, *level = k; return 0; } /* (0: it ended) */
    }
    /* A new chain: first the chains with nothing left running go, then, if every slot is
     * taken, the oldest with what runs in it. */
    int slot = -1;
    for (int i = 0; i < NS_CHAINS; i++) {
        int busy = 0;
        for (int k = 0; k < NS_LEVELS; k++) busy |= counts[i][k] >= 2;
        if (ns_chains[i].first && !busy) ns_end_chain(i);
        if (!ns_chains[i].first && slot < 0) slot = i;
    }
    if (slot < 0) {
        slot = 0;
        for (int i = 1; i < NS_CHAINS; i++)
            if (ns_chains[i].seq < ns_chains[slot].seq) slot = i;
        ns_end_chain(slot);
    }
    int err = ns_build(slot);
    if (err) return err;
    *chain = slot, *level = NS_LEVELS - 1;
    return 0;
}

/* --- a passive chain's manager (the guest agent; unused by the shim) --------------------- */

/* Fork into the next exec's level (its PID namespace: setns sets where this process's
 * children go); the child then joins the rest (ns_join). *level for the child. */
__attribute__((unused)) static pid_t ns_fork(const struct ns_level **level) {
    static int own = -1; /* this process's PID namespace, for the forks after */
    int c, k, err = 0;
    if (own < 0 && (own = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC)) < 0) return -1;
    if ((err = ns_place(&c, &k)) != 0) { errno = err; return -1; }
    *level = &ns_chains[c].lv[k];
    if (setns((*level)->pidns, CLONE_NEWPID) < 0) return -1;
    pid_t pid = fork();
    err = errno;
    if (pid != 0) (void)setns(own, CLONE_NEWPID); /* (the manager's other forks: its own) */
    errno = err;
    return pid;
}

/* In the child of ns_fork: the level's mount namespace (whose /proc is its PID namespace's)
 * and root. 0 or an errno. */
__attribute__((unused)) static int ns_join(const struct ns_level *level) {
    if (setns(level->mntns, CLONE_NEWNS) < 0 || fchdir(level->root) < 0 || chroot(".") < 0) return errno;
    return 0;
}

/* The masked and read-only paths under /proc (of the lists given, each NUL-terminated), for
 * each level's /proc (ns_after_proc applies them): 0, or -1 when out of memory. */
static char *ns_masked, *ns_readonly;
static int ns_nmasked, ns_nreadonly;
__attribute__((unused)) static int ns_keep_proc_paths(const char *masked, int nmasked, const char *readonly,
                                                      int nreadonly) {
    const char *in[2] = {masked, readonly};
    int n[2] = {nmasked, nreadonly}, *nout[2] = {&ns_nmasked, &ns_nreadonly};
    char **out[2] = {&ns_masked, &ns_readonly};
    for (int l = 0; l < 2; l++) {
        size_t size = 1;
        const char *p = in[l];
        for (int i = 0; i < n[l]; i++, p += strlen(p) + 1) size += strlen(p) + 1;
        if (!(*out[l] = malloc(size))) return -1;
        char *o = *out[l];
        p = in[l];
        for (int i = 0; i < n[l]; i++, p += strlen(p) + 1)
            if (strncmp(p, "/proc/", 6) == 0 || strcmp(p, "/proc") == 0) {
                o = stpcpy(o, p) + 1;
                (*nout[l])++;
            }
    }
    return 0;
}
