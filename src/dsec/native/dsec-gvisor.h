/*
 * dsec-gvisor.h: dsec-shim's init inside gVisor (`init gvisor`), inlined into dsec-shim.c by
 * the build. gVisor's kernel has no Landlock: an exec's level is a PID
 * namespace (dsec-levels.h) whose PID 1, a holder, is a copy of this init that starts the
 * exec and speaks the same protocol on its own socket. The init itself (PID 1 of the
 * sandbox, out of sight of every exec) starts no exec: it places each one at a level and
 * forwards its messages ('S', 'K') to that level's holder, and the holder's answers ('R',
 * 'F', 'X') to the edge. A holder is what the init used to be for every exec: the sandbox's
 * capabilities and seccomp filter (the init keeps CAP_SYS_ADMIN and no filter, to make PID
 * and mount namespaces and mount their /proc), every catchable signal ignored.
 *
 *   edge -> init  'C' u32 id, then the seccomp program (struct sock_filter[]): every holder
 *                 installs it (the edge sends it before its first ping; no answer)
 */
#include <linux/filter.h>
#include <linux/seccomp.h>

static struct sock_fprog user_filter;
static int gv_top; /* this process places execs at levels (gVisor's init) */

struct route { uint32_t id; int8_t chain, level, live; };
#define ROUTES (MAX_CHILDREN + RECENT)
static struct route routes[ROUTES];
static unsigned route_next;

static int serve(int sfd);
static void handle_kill(const char *buf, ssize_t len);

/* SIGKILL what an exec started where no cgroup holds it (gVisor): in a level's holder, for
 * its last exec, every process of its level (setsid leaves nothing of it); otherwise every
 * process of session `sid` (a child leads its own, see child_exec: what moved to a process
 * group of its own is still in it; only setsid leaves it). Where a cgroup holds the exec,
 * the edge kills that instead. */
static void sweep(pid_t sid, uint32_t id) {
    int level = level_ns[0] && id == level_last;
    DIR *d = opendir("/proc");
    if (d == NULL) return;
    struct dirent *e;
    char path[64], stat[1024];
    while ((e = readdir(d)) != NULL) {
        pid_t p = (pid_t)atoi(e->d_name);
        if (p <= 1) continue;
        snprintf(path, sizeof path, level ? "/proc/%d/ns/pid" : "/proc/%d/stat", p);
        if (level) {
            ssize_t n = readlink(path, stat, sizeof stat - 1);
            if (n > 0 && (stat[n] = 0, strcmp(stat, level_ns) == 0)) kill(p, SIGKILL);
            continue;
        }
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t n = read(fd, stat, sizeof stat - 1);
        close(fd);
        if (n <= 0) continue;
        stat[n] = 0;
        char *rp = strrchr(stat, ')'); /* comm may hold spaces and parentheses */
        int session = 0;
        if (rp && sscanf(rp + 1, " %*c %*d %*d %d", &session) == 1 && session == sid) kill(p, SIGKILL);
    }
    closedir(d);
}

static void gv_configure(const char *buf, ssize_t len) {
    size_t flen = len > 5 ? (size_t)len - 5 : 0;
    if (!flen || flen % sizeof(struct sock_filter) || flen / sizeof(struct sock_filter) > BPF_MAXINSNS) return;
    struct sock_filter *f = malloc(flen);
    if (!f) return;
    memcpy(f, buf + 5, flen);
    free(user_filter.filter);
    user_filter.filter = f;
    user_filter.len = (unsigned short)(flen / sizeof(struct sock_filter));
    if (gv_top && ns_current < 0) ns_build(0); /* (else, or on failure: at the first exec) */
}

/* Drop `cap` from every set, the bounding one included (needs CAP_SETPCAP, dropped last). */
static int drop_caps(const int *caps, int n) {
    struct __user_cap_header_struct hdr = {.version = _LINUX_CAPABILITY_VERSION_3, .pid = 0};
    struct __user_cap_data_struct data[2];
    for (int i = 0; i < n; i++)
        if (prctl(PR_CAPBSET_DROP, caps[i], 0, 0, 0) < 0 && errno != EINVAL) return errno;
    if (syscall(SYS_capget, &hdr, data) < 0) return errno;
    for (int i = 0; i < n; i++) {
        uint32_t bit = 1U << (caps[i] % 32);
        data[caps[i] / 32].effective &= ~bit;
        data[caps[i] / 32].permitted &= ~bit;
        data[caps[i] / 32].inheritable &= ~bit;
    }
    if (syscall(SYS_capset, &hdr, data) < 0) return errno;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    return 0;
}

/* A level's holder from here on (the level below it exists already): confined as the init
 * was, the protocol on CTL_FD, nothing else of the init held. Never returns. */
static void gv_holder(int sock) {
    static const int init_only[] = {CAP_SYS_ADMIN, CAP_SETPCAP};
    if (!user_filter.len || drop_caps(init_only, 2) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &user_filter) < 0 || dup3(sock, CTL_FD, O_CLOEXEC) < 0)
        _exit(1);
    syscall(SYS_close_range, CTL_FD + 1, ~0U, 0); /* the init's sockets, its layer, its signalfd */
    memset(children, 0, sizeof children);
    memset(recent, 0, sizeof recent);
    nfills = 0;
    gv_top = 0;
    prctl(PR_SET_NAME, "dsec-level", 0, 0, 0);
    ssize_t n = readlink("/proc/self/ns/pid", level_ns, sizeof level_ns - 1);
    if (n <= 0) _exit(1);
    level_ns[n] = 0;
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    _exit(sfd < 0 ? 1 : serve(sfd));
}

static struct route *route_of(uint32_t id) {
    for (unsigned n = 1; n <= ROUTES; n++) { /* newest first: an id is not reused while live */
        struct route *r = &routes[(route_next - n) % ROUTES];
        if (r->id == id && (r->live || r->chain >= 0)) return r;
    }
    return NULL;
}

static void route_end(struct route *r) {
    if (r->live) ns_inflight[r->chain][r->level]--;
    r->live = 0;
}

/* 'S' at the init: place the exec, hand the request (and its descriptors) to the holder. */
static void gv_spawn(const char *buf, ssize_t len, int *fds, int nfds) {
    uint32_t id = 0;
    if (len >= 5) memcpy(&id, buf + 1, 4);
    int c = -1, k = -1, err = user_filter.len ? 0 : EPERM; /* never an exec without the filter */
    reap(); /* (the init's own: 'W' copies, ended holders) */
    if (!err) err = ns_place(&c, &k);
    if (!err && send_fds(ns_chains[c].lv[k].sock, buf, (size_t)len, fds, nfds) < 0) err = errno;
    close_fds(fds, nfds);
    if (err) { send_msg('F', id, err); return; }
    struct route *r = &routes[route_next++ % ROUTES];
    for (unsigned n = 0; r->live && n < ROUTES; n++) r = &routes[route_next++ % ROUTES];
    *r = (struct route){id, (int8_t)c, (int8_t)k, 1};
    ns_inflight[c][k]++;
}

/* 'K' at the init: to the holder of the exec's level (also shortly after it ended). */
static void gv_kill(const char *buf, ssize_t len) {
    uint32_t id;
    if (len < 9) return;
    memcpy(&id, buf + 1, 4);
    struct route *r = route_of(id);
    if (!r) handle_kill(buf, len); /* one of the init's own: a 'W' copy */
    else if (ns_chains[r->chain].lv[r->level].sock >= 0)
        send(ns_chains[r->chain].lv[r->level].sock, buf, 9, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* The holders' sockets to watch (pfd[0..n)), in chain and level order. */
static int gv_poll_set(struct pollfd *pfd) {
    int n = 0;
    for (int c = 0; gv_top && c < NS_CHAINS; c++)
        for (int k = 0; k < NS_LEVELS; k++)
            if (ns_chains[c].first && ns_chains[c].lv[k].sock >= 0)
                pfd[n++] = (struct pollfd){.fd = ns_chains[c].lv[k].sock, .events = POLLIN};
    return n;
}

/* A level ended (its holder was killed: by a later exec, or with its chain): what it ran
 * was killed with it. */
static void gv_level_ended(int c, int k) {
    for (unsigned i = 0; i < ROUTES; i++) {
        struct route *r = &routes[i];
        if (r->live && r->chain == c && r->level == k) {
            send_msg('X', r->id, SIGKILL); /* (a wait status: killed by SIGKILL) */
            route_end(r);
        }
    }
    close(ns_chains[c].lv[k].sock);
    ns_chains[c].lv[k].sock = -1;
}

/* The holders' answers, to the edge. */
static void gv_poll_done(struct pollfd *pfd, int n) {
    int i = 0;
    for (int c = 0; c < NS_CHAINS; c++)
        for (int k = 0; k < NS_LEVELS; k++) {
            if (!ns_chains[c].first || ns_chains[c].lv[k].sock < 0) continue;
            if (i >= n) return;
            short ev = pfd[i++].revents;
            if (!ev) continue;
            char m[16];
            ssize_t got = recv(ns_chains[c].lv[k].sock, m, sizeof m, MSG_DONTWAIT);
            if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            if (got <= 0) { gv_level_ended(c, k); continue; }
            if (got != 9 || (m[0] != 'R' && m[0] != 'F' && m[0] != 'X')) continue;
            uint32_t id;
            memcpy(&id, m + 1, 4);
            struct route *r = route_of(id);
            if (!r || !r->live) continue;
            if (m[0] != 'R') route_end(r);
            while (send(CTL_FD, m, 9, MSG_NOSIGNAL) < 0 && errno == EINTR) {
            }
        }
}

static void gv_chain_ending(int c) {
    for (int k = 0; k < NS_LEVELS; k++)
        if (ns_chains[c].lv[k].sock >= 0) gv_level_ended(c, k);
}

/* gVisor's init: levels of active holders, each running gv_holder. */
static void gv_start(void) {
    gv_top = 1;
    ns_active = 1;
    ns_serve = gv_holder;
    ns_ending = gv_chain_ending;
    for (unsigned i = 0; i < ROUTES; i++) routes[i].chain = -1;
}
