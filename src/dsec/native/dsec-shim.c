/*
 * dsec-shim: the in-sandbox init and the crun launcher, one static binary.
 *
 *   dsec-shim init [gvisor]  PID 1 of a sandbox (started by the OCI runtime).
 *   dsec-shim runsc-keep ... like crun-wrap, for runsc: stays as the host side of a gVisor
 *                            sandbox (see run_keep).
 *   dsec-shim kill-others    inside a sandbox: SIGKILL everything but the init.
 *   dsec-shim idmap-run ...  run a command over an idmapped view of a layer (see run_idmap_run).
 *   dsec-shim vm-launch ...  start a microVM's QEMU confined (see run_vm_launch).
 *   dsec-shim crun-wrap A B HYBRID UP UPPER_OPTS ROOTFS OWNER IDMAP LOWERS N SRC... -- RUNTIME ARGS...
 *                            launch the runtime with fds A,B moved to 3,4, in a
 *                            private mount namespace holding the sandbox's
 *                            writable layer (ext4 or tmpfs), its N layers (idmapped read-only
 *                            clones on LOWERS/<i>, see dsec-idmap.h) and the
 *                            overlay root (and, on hybrid cgroup hosts, hiding
 *                            the v2 mount crun rejects).
 *
 * Why an init of our own: the edge needs a fast, unforgeable control path into
 * the sandbox. The shim talks to the edge over an anonymous SOCK_SEQPACKET
 * socketpair inherited at fd 3; there is no socket on any file system, so
 * nothing inside can connect to it. The shim also keeps the edge's end open at
 * fd 4 so that its messages survive an edge restart: the new edge takes a copy
 * of fd 4 with pidfd_getfd(2). Fd 5 is an O_PATH handle on the sandbox's
 * writable layer (its file system), which the edge uses for snapshots and forks. The shim is non-dumpable and sandbox processes
 * lack CAP_SYS_PTRACE, and seccomp denies ptrace, pidfd_getfd and
 * process_vm_*, so they can neither read its fds nor its memory. It handles
 * only SIGCHLD (through a signalfd), so as PID 1 it ignores every signal sent
 * from inside.
 *
 * Wire format (one datagram per message, little endian):
 *   edge -> shim  'S' u32 id, i32 uid, i32 gid, u16 argc, u16 envc, u8 ncg,
 *                 then NUL-terminated cwd, argv[argc], env[envc];
 *                 SCM_RIGHTS: stdin, stdout, stderr, ncg cgroup.procs fds
 *                 (the child writes "0" to each to join its own cgroup).
 *   edge -> shim  'K' u32 id, i32 signal      signal the child's process group (also shortly after it exited)
 *   edge -> shim  'P' u32 id                  ping, answered by 'p' u32 id
 *   edge -> shim  'C' u32 id, seccomp program gVisor's init only (see dsec-gvisor.h)
 *   edge -> shim  'W' u32 id; SCM_RIGHTS: src, dst
 *                 fill: a forked child of the shim (so inside the sandbox's
 *                 cgroups: its memory is charged to the sandbox) copies src (a
 *                 pipe the edge writes) into dst (a file the edge opened with
 *                 openat2) until EOF; no sandbox binary runs. Answered like 'S':
 *                 'R' then 'X' (exit 0, or the errno of the failed write as
 *                 the exit status; SIGKILL when the sandbox ran out of memory).
 *   shim -> edge  'R' u32 id, i32 pid         started (pid in the sandbox)
 *   shim -> edge  'X' u32 id, i32 status      exited (waitpid status)
 *   shim -> edge  'F' u32 id, i32 errno       could not start (errno)
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#include "dsec-idmap.h"
#include "dsec-child.h"
#include "dsec-landlock.h"
#include "dsec-levels.h"

#define CTL_FD 3
#define MAX_MSG 262144
#define MAX_FDS 8
#define MAX_CHILDREN 4096


struct child { pid_t pid; uint32_t id; char fill; };
static struct child children[MAX_CHILDREN];
static int nfills; /* of children: 'W' copies (the init's own code, in no exec level) */
/* The last children reaped: a 'K' for one of them still reaches its process group (what it
 * forked lives on after it, in a fork bomb say, where no cgroup holds the exec). */
#define RECENT 256
static struct child recent[RECENT];
static unsigned recent_next;

static void send_msg(char type, uint32_t id, int32_t value) {
    char buf[9];
    buf[0] = type;
    memcpy(buf + 1, &id, 4);
    memcpy(buf + 5, &value, 4);
    while (send(CTL_FD, buf, sizeof buf, MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
}

static int track(pid_t pid, uint32_t id, char fill) {
    for (int i = 0; i < MAX_CHILDREN; i++) {
        if (children[i].pid == 0) {
            children[i].pid = pid;
            children[i].id = id;
            children[i].fill = fill;
            nfills += fill;
            return 0;
        }
    }
    return -1;
}

static void reap(void);
/* The process limit (RLIMIT_NPROC) the runtime gave: the user's processes get it, hard and
 * soft; the shim keeps the hard one (a reserve above the user's, so it can always start a
 * process). Unlimited where a host cgroup holds the pids limit instead. */
static struct rlimit user_nproc = {RLIM_INFINITY, RLIM_INFINITY};
/* `init gvisor`: the kernel gives PID 1 no protection from signals there (see run_init). */
static int ignore_all;
/* A level's holder (dsec-levels.h, gVisor): its own PID namespace, and the last exec it
 * started (the only one its level holds: a later exec goes to a shallower level). */
static char level_ns[48];
static uint32_t level_last;


static void close_fds(int *fds, int n) {
    for (int i = 0; i < n; i++) close(fds[i]);
}

#include "dsec-gvisor.h"

/* In the child: join cgroups, wire stdio, drop to the user, exec. Never returns. */
static void child_exec(int errfd, int *fds, int ncg, int32_t uid, int32_t gid,
                       const char *cwd, char **argv, char **envp) {
    int err = 0;
    child_reset_signals();
    if (ignore_all) /* the init ignored every signal it could (run_init): not its children */
        for (int s = 1; s < NSIG; s++)
            if (s != SIGKILL && s != SIGSTOP) signal(s, SIG_DFL);
    setsid();
    for (int i = 0; i < ncg && !err; i++)
        if (write(fds[3 + i], "0", 1) != 1) err = errno;
    /* fds[] and errfd are all >= 5 (0-2 are /dev/null, 3-4 the control socket): the control
     * socket must never reach a sandbox process. */
    if (!err) err = child_stdio(fds[0], fds[1], fds[2], &errfd);
    if (!err && gid >= 0 && setgroups(0, NULL) < 0 && errno != EPERM) err = errno;
    if (!err && gid >= 0 && setresgid(gid, gid, gid) < 0) err = errno;
    if (!err && uid >= 0 && setresuid(uid, uid, uid) < 0) err = errno;
    if (!err && cwd[0] && chdir(cwd) < 0) err = errno;
    if (!err) err = child_own_domain(); /* (no_new_privs: the runtime set it for the init) */
    if (!err && user_nproc.rlim_cur != RLIM_INFINITY) {
        struct rlimit lim = {user_nproc.rlim_cur, user_nproc.rlim_cur};
        if (setrlimit(RLIMIT_NPROC, &lim) < 0) err = errno;
    }
    child_run(err, errfd, argv, envp);
}

struct spawn_args {
    int errfd, *fds, ncg;
    int32_t uid, gid;
    const char *cwd;
    char **argv, **envp;
};

static void spawn_child(void *p) {
    struct spawn_args *a = p;
    child_exec(a->errfd, a->fds, a->ncg, a->uid, a->gid, a->cwd, a->argv, a->envp);
}

/* Every process of the sandbox but this one and its 'W' copies (a zombie is one until it is
 * reaped). *out: malloc'ed. */
static int sandbox_pids(pid_t **out) {
    int n = 0, cap = 64;
    pid_t *pids = malloc(sizeof(pid_t) * cap), me = getpid();
    DIR *d = opendir("/proc");
    struct dirent *e;
    while (pids && d && (e = readdir(d)) != NULL) {
        pid_t p = (pid_t)atoi(e->d_name);
        int skip = p <= 0 || p == me;
        for (int i = 0; !skip && nfills && i < MAX_CHILDREN; i++) skip = children[i].pid == p && children[i].fill;
        if (skip) continue;
        if (n == cap) {
            pid_t *more = realloc(pids, sizeof(pid_t) * (cap *= 2));
            if (!more) { free(pids); pids = NULL; break; }
            pids = more;
        }
        pids[n++] = p;
    }
    if (d) closedir(d);
    *out = pids;
    return pids ? n : -1;
}

/* The exec's process: at a level of its own (dsec-landlock.h), or forked here. */
static pid_t exec_fork(struct spawn_args *a) {
    pid_t *pids = NULL, pid;
    int n = 0;
    if (ll_levels) {
        reap(); /* what already ended is no process of a level */
        if ((n = sandbox_pids(&pids)) < 0) { errno = ENOMEM; return -1; }
    }
    pid = ll_fork(pids, n, spawn_child, a);
    int err = errno;
    free(pids);
    errno = err;
    return pid;
}

static void handle_spawn(const char *buf, ssize_t len, int *fds, int nfds) {
    uint32_t id; int32_t uid, gid; uint16_t argc, envc; uint8_t ncg;
    if (len < 18) { close_fds(fds, nfds); return; }
    memcpy(&id, buf + 1, 4);
    memcpy(&uid, buf + 5, 4);
    memcpy(&gid, buf + 9, 4);
    memcpy(&argc, buf + 13, 2);
    memcpy(&envc, buf + 15, 2);
    ncg = (uint8_t)buf[17];
    if (nfds != 3 + ncg || argc == 0) { close_fds(fds, nfds); send_msg('F', id, EINVAL); return; }

    char **argv = calloc(argc + 1, sizeof(char *));
    char **envp = calloc(envc + 1, sizeof(char *));
    const char *p = buf + 18, *end = buf + len;
    const char *cwd = NULL;
    int nstr = 1 + argc + envc;
    for (int i = 0; i < nstr; i++) {
        const char *z = memchr(p, 0, end - p);
        if (!z) { free(argv); free(envp); close_fds(fds, nfds); send_msg('F', id, EINVAL); return; }
        if (i == 0) cwd = p;
        else if (i <= argc) argv[i - 1] = (char *)p;
        else envp[i - 1 - argc] = (char *)p;
        p = z + 1;
    }

    int errpipe[2];
    if (pipe2(errpipe, O_CLOEXEC) < 0) {
        free(argv); free(envp); close_fds(fds, nfds); send_msg('F', id, errno); return;
    }
    struct spawn_args a = {errpipe[1], fds, ncg, uid, gid, cwd, argv, envp};
    pid_t pid = exec_fork(&a);
    /* At a process limit (a fork bomb that was just killed): what died may not be reaped
     * yet, and reaping it is what frees the slots. */
    for (int tries = 0; pid < 0 && errno == EAGAIN && tries < 50; tries++) {
        usleep(2000);
        reap();
        pid = exec_fork(&a);
    }
    int fork_err = errno;
    close(errpipe[1]);
    close_fds(fds, nfds);
    free(argv);
    free(envp);
    if (pid < 0) { close(errpipe[0]); send_msg('F', id, fork_err); return; }
    int child_err = 0;
    ssize_t n;
    do { n = read(errpipe[0], &child_err, sizeof child_err); } while (n < 0 && errno == EINTR);
    close(errpipe[0]);
    if (n == sizeof child_err) {
        /* exec failed: the child exits 127; reap it here so no 'X' follows. */
        waitpid(pid, NULL, 0);
        send_msg('F', id, child_err);
        return;
    }
    if (track(pid, id, 0) < 0) { kill(pid, SIGKILL); send_msg('F', id, EAGAIN); return; }
    level_last = id;
    send_msg('R', id, pid);
}

/* In the child of a 'W': copy fd 0 (a pipe) into fd 1 (a regular file) until EOF. The child
 * inherits the shim's cgroups, so every page it writes into the sandbox's tmpfs is charged to
 * the sandbox; it offers itself first to the OOM killer, so a full sandbox loses this write
 * rather than one of its own processes. It never execs: nothing of the sandbox runs. */
static void child_fill(int src, int dst) {
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom >= 0) {
        (void)!write(oom, "1000", 4);
        close(oom);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    setsid();
    if (dup2(src, 0) < 0 || dup2(dst, 1) < 0) _exit(errno & 0x7f);
    syscall(SYS_close_range, 2, ~0U, 0);
    static char buf[1 << 16];
    for (;;) {
        ssize_t n = splice(0, NULL, 1, NULL, 1 << 20, SPLICE_F_MOVE);
        if (n == 0) _exit(0);
        if (n > 0) continue;
        if (errno == EINTR) continue;
        if (errno != EINVAL) _exit(errno & 0x7f);
        break; /* no splice into this file: copy by hand */
    }
    for (;;) {
        ssize_t n = read(0, buf, sizeof buf);
        if (n == 0) _exit(0);
        if (n < 0) {
            if (errno == EINTR) continue;
            _exit(errno & 0x7f);
        }
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(1, buf + off, n - off);
            if (w < 0) {
                if (errno == EINTR) continue;
                _exit(errno & 0x7f);
            }
            off += w;
        }
    }
}

static void handle_fill(const char *buf, ssize_t len, int *fds, int nfds) {
    uint32_t id;
    if (len < 5) { close_fds(fds, nfds); return; }
    memcpy(&id, buf + 1, 4);
    if (nfds != 2) { close_fds(fds, nfds); send_msg('F', id, EINVAL); return; }
    struct stat st;
    if (fstat(fds[1], &st) < 0 || !S_ISREG(st.st_mode)) {
        close_fds(fds, nfds); send_msg('F', id, EINVAL); return;
    }
    pid_t pid = fork();
    if (pid == 0) child_fill(fds[0], fds[1]);
    int fork_err = errno;
    close_fds(fds, nfds);
    if (pid < 0) { send_msg('F', id, fork_err); return; }
    if (track(pid, id, 1) < 0) { kill(pid, SIGKILL); waitpid(pid, NULL, 0); send_msg('F', id, EAGAIN); return; }
    send_msg('R', id, pid);
}

static void handle_kill(const char *buf, ssize_t len) {
    uint32_t id; int32_t sig;
    if (len < 9) return;
    memcpy(&id, buf + 1, 4);
    memcpy(&sig, buf + 5, 4);
    for (int i = 0; i < MAX_CHILDREN; i++) {
        if (children[i].pid && children[i].id == id) {
            kill(-children[i].pid, sig);
            if (sig == SIGKILL && ignore_all) sweep(children[i].pid, id);
            return;
        }
    }
    for (unsigned n = 0; n < RECENT; n++) {
        struct child *c = &recent[(recent_next - 1 - n) % RECENT];
        if (c->pid && c->id == id) {
            kill(-c->pid, sig); /* ESRCH once the group is gone */
            if (sig == SIGKILL && ignore_all) sweep(c->pid, id);
            return;
        }
    }
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (int i = 0; i < MAX_CHILDREN; i++) {
            if (children[i].pid == pid) {
                send_msg('X', children[i].id, status);
                nfills -= children[i].fill;
                recent[recent_next++ % RECENT] = children[i];
                children[i].pid = 0;
                break;
            }
        }
    }
}

/* The protocol's loop: the init's, and (gVisor) each level's holder's. */
static int serve(int sfd) {
    static char buf[MAX_MSG];
    struct pollfd pfd[2 + NS_CHAINS * NS_LEVELS];
    for (;;) {
        pfd[0] = (struct pollfd){.fd = CTL_FD, .events = POLLIN};
        pfd[1] = (struct pollfd){.fd = sfd, .events = POLLIN};
        int nholders = gv_poll_set(pfd + 2);
        if (poll(pfd, 2 + nholders, -1) < 0) {
            if (errno == EINTR) continue;
            return 1;
        }
        if (pfd[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {
            }
            reap();
        }
        if (nholders) gv_poll_done(pfd + 2, nholders);
        if (pfd[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            char cbuf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
            struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
            struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1,
                                 .msg_control = cbuf, .msg_controllen = sizeof cbuf};
            ssize_t len = recvmsg(CTL_FD, &msg, MSG_CMSG_CLOEXEC);
            if (len < 0) {
                if (errno == EINTR || errno == EAGAIN) continue;
                return 1;
            }
            if (len == 0) {
                /* Both ends closed: nobody can ever talk to us again. */
                return 0;
            }
            int fds[MAX_FDS], nfds = 0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                    int n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                    for (int i = 0; i < n && nfds < MAX_FDS; i++) memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                }
            }
            if (msg.msg_flags & MSG_CTRUNC) {
                /* Descriptors lost (this process is out of them): refuse the request rather
                 * than leave the edge waiting for an answer. */
                close_fds(fds, nfds);
                uint32_t id = 0;
                if (len >= 5) memcpy(&id, buf + 1, 4);
                if (buf[0] == 'S' || buf[0] == 'W') send_msg('F', id, EMFILE);
                continue;
            }
            switch (buf[0]) {
            case 'S':
                if (gv_top) gv_spawn(buf, len, fds, nfds);
                else handle_spawn(buf, len, fds, nfds);
                break;
            case 'K':
                close_fds(fds, nfds);
                if (gv_top) gv_kill(buf, len);
                else handle_kill(buf, len);
                break;
            case 'W': handle_fill(buf, len, fds, nfds); break;
            case 'C': close_fds(fds, nfds); if (gv_top) gv_configure(buf, len); break;
            case 'P': {
                uint32_t id = 0;
                close_fds(fds, nfds);
                if (len >= 5) memcpy(&id, buf + 1, 4);
                send_msg('p', id, 0);
                break;
            }
            default: close_fds(fds, nfds); break;
            }
        }
    }
}

static int run_init(int gvisor) {
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (getrlimit(RLIMIT_NPROC, &user_nproc) == 0 && user_nproc.rlim_cur != user_nproc.rlim_max) {
        struct rlimit mine = {user_nproc.rlim_max, user_nproc.rlim_max};
        setrlimit(RLIMIT_NPROC, &mine);
    } else {
        user_nproc.rlim_cur = RLIM_INFINITY; /* nothing to keep in reserve */
    }
    signal(SIGPIPE, SIG_IGN);
    /* A kernel protects the init of a pid namespace from signals it does not handle; gVisor
     * does not (a `kill -TERM 1` inside would end the sandbox): there, ignore every signal
     * that can be ignored (children reset them). SIGCHLD stays (blocked, read from the
     * signalfd). */
    ignore_all = gvisor;
    if (ignore_all)
        for (int s = 1; s < NSIG; s++)
            if (s != SIGKILL && s != SIGSTOP && s != SIGCHLD) signal(s, SIG_IGN);
    /* Each exec at a level of its own: Landlock domains where the kernel scopes signals (ABI
     * 6, dsec-landlock.h), PID namespaces in gVisor (dsec-levels.h, dsec-gvisor.h). A kernel
     * without either (Landlock older than 6.12): every exec forks from here, as before, and
     * what one leaves running can signal a later one. */
    if (gvisor) gv_start();
    else ll_levels = landlock_abi() >= 6;
    /* Our stdio came from the runtime's launcher: hold nothing of the host. */
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull >= 0) {
        for (int i = 0; i < 3; i++) dup2(devnull, i);
        if (devnull > 2) close(devnull);
    }
    if (ll_levels) ll_start(); /* (its threads start while the edge finishes the create) */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) return 1;
    fcntl(CTL_FD, F_SETFD, FD_CLOEXEC);
    fcntl(4, F_SETFD, FD_CLOEXEC);
    fcntl(5, F_SETFD, FD_CLOEXEC); /* the writable layer (see crun-wrap), if given */
    return serve(sfd);
}

/* Mount the sandbox's writable layer (UPPER_OPTS "ext4=/dev/loopN,OPTS": that device's
 * ext4, see dsec/backends/writable.py; else a tmpfs's options) and its overlay root in a
 * mount namespace of our own, then exec the runtime in it: the container's namespace is cloned from
 * this one, so the sandbox's mounts never appear in the host's mount table (which
 * would make every later create copy and scan one more pair of mounts, and could
 * leak). They go away with the container's mount namespace.
 *
 * Each lower is a read-only clone of its layer directory mounted on LOWERS/<i>,
 * idmapped (IDMAP "FROM:TO:COUNT": the store's canonical range FROM.. shown as the
 * sandbox's own range TO..) so that no host id the sandbox maps owns a file of
 * the layer store; the overlay stacks those clones. */
static int mount_rootfs(const char *up, const char *upper_opts, const char *rootfs, uid_t owner,
                        const char *idmap, const char *lowers, int nlower, char **srcs) {
    char path[4096], dev[64];
    static char opts[65536];
    int n = 0, ext4 = sscanf(upper_opts, "ext4=%63[^,],%n", dev, &n) >= 1 && n > 0 && !strncmp(dev, "/dev/loop", 9);
    if (mount(ext4 ? dev : "dsec-upper", up, ext4 ? "ext4" : "tmpfs", MS_NOSUID | MS_NODEV,
              upper_opts + (ext4 ? n : 0)) < 0) {
        perror("dsec-shim: mount the writable layer");
        return -1;
    }
    const char *subs[] = {"upper", "work"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", up, subs[i]);
        if (mkdir(path, 0755) < 0 || chown(path, owner, owner) < 0) {
            perror("dsec-shim: upper dirs");
            return -1;
        }
    }
    int userns = -1;
    if (strcmp(idmap, "-") != 0) {
        long from, to, count;
        if (sscanf(idmap, "%ld:%ld:%ld", &from, &to, &count) != 3 || from < 0 || to < 0 || count <= 0) {
            fprintf(stderr, "dsec-shim: bad idmap %s\n", idmap);
            return -1;
        }
        userns = idmap_userns(from, to, count);
        if (userns < 0) {
            perror("dsec-shim: idmap user namespace");
            return -1;
        }
    }
    size_t off = (size_t)snprintf(opts, sizeof opts, "lowerdir=");
    for (int i = 0; i < nlower; i++) {
        snprintf(path, sizeof path, "%s/%d", lowers, i);
        if (mkdir(path, 0700) < 0 && errno != EEXIST) {
            perror("dsec-shim: lower mount point");
            return -1;
        }
        if (idmap_bind(srcs[i], path, userns) < 0) {
            fprintf(stderr, "dsec-shim: mount layer %s: %s\n", srcs[i], strerror(errno));
            return -1;
        }
        off += (size_t)snprintf(opts + off, sizeof opts - off, "%s%s", i ? ":" : "", path);
        if (off >= sizeof opts) {
            fprintf(stderr, "dsec-shim: too many layers\n");
            return -1;
        }
    }
    if (userns >= 0) close(userns);
    off += (size_t)snprintf(opts + off, sizeof opts - off, ",upperdir=%s/upper,workdir=%s/work", up, up);
    if (off >= sizeof opts) {
        fprintf(stderr, "dsec-shim: too many layers\n");
        return -1;
    }
    if (mount("dsec-rootfs", rootfs, "overlay", 0, opts) < 0) {
        perror("dsec-shim: mount overlay");
        return -1;
    }
    return 0;
}

/* What crun-wrap and runsc-keep share: fds A,B at 3,4, a private mount namespace
 * with the sandbox's layers, the writable layer's handle at 5, an audit session. Returns
 * the runtime's argv, or NULL (the error printed). */
static char **prepare_launch(int argc, char **argv, const char *mode) {
    /* argv: MODE FD_A FD_B HYBRID UP UPPER_OPTS ROOTFS OWNER IDMAP LOWERS N SRC*N -- runtime args... */
    int nlower = argc > 11 ? atoi(argv[11]) : -1;
    int dashes = 12 + nlower;
    if (nlower < 0 || nlower > 500 || argc < dashes + 2 || strcmp(argv[dashes], "--") != 0) {
        fprintf(stderr, "usage: dsec-shim %s FD_A FD_B HYBRID UP UPPER_OPTS ROOTFS OWNER IDMAP LOWERS N "
                        "SRC... -- RUNTIME ARGS...\n", mode);
        return NULL;
    }
    char **runtime = argv + dashes + 1;
    int a = atoi(argv[2]), b = atoi(argv[3]);
    int hybrid = atoi(argv[4]);
    if (a >= 0 && b >= 0) {
        /* Move the two fds out of the way first, then to 3 and 4. */
        int ta = fcntl(a, F_DUPFD, 10), tb = fcntl(b, F_DUPFD, 10);
        if (ta < 0 || tb < 0 || dup2(ta, 3) < 0 || dup2(tb, 4) < 0) { perror("dsec-shim: dup"); return NULL; }
        close(ta);
        close(tb);
    }
    if (unshare(CLONE_NEWNS) < 0) { perror("dsec-shim: unshare"); return NULL; }
    if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0) { perror("dsec-shim: make-rslave"); return NULL; }
    if (hybrid &&
        mount("dsec-cg2", "/sys/fs/cgroup/unified", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k") < 0) {
        perror("dsec-shim: hide cgroup2");
        return NULL;
    }
    if (argv[5][0]) {
        if (mount_rootfs(argv[5], argv[6], argv[7], (uid_t)atoi(argv[8]), argv[9], argv[10], nlower, argv + 12) < 0)
            return NULL;
        /* The writable layer's root at fd 5: the edge takes a copy (pidfd_getfd) for
         * snapshots and forks; nothing inside can reach it. */
        int up = open(argv[5], O_PATH | O_DIRECTORY);
        if (up < 0 || dup2(up, 5) < 0) { perror("dsec-shim: open upper"); return NULL; }
        if (up != 5) close(up);
    }
    /* An audit session of its own: setting the login uid (allowed once, to a process with
     * CAP_AUDIT_CONTROL, which no sandbox process has) gives this process a new audit
     * session id, inherited by the runtime, the init and every process of the sandbox and
     * unchangeable from inside. The kernel's seccomp audit records carry it (ses=), so the
     * edge can attribute a refused system call even after its process is gone. */
    int lu = open("/proc/self/loginuid", O_WRONLY | O_CLOEXEC);
    if (lu >= 0) {
        if (write(lu, argv[8], strlen(argv[8])) < 0) { /* audit off: denials go uncounted */ }
        close(lu);
    }
    return runtime;
}

static int run_crun_wrap(int argc, char **argv) {
    char **runtime = prepare_launch(argc, argv, "crun-wrap");
    if (runtime == NULL) return 1;
    /* The init (the shim, PID 1 of the container) holds fds 3-5 from here on. */
    /* crun (like runc) guards against CVE-2019-5736 by copying its own binary and
     * re-executing the copy (a second dynamic load, ~1-2 ms per sandbox) unless it
     * already runs from a read-only file and _LIBCONTAINER_CLONED_BINARY is set. A
     * read-only bind of the runtime onto itself, in this private mount namespace,
     * gives the same protection (nothing can open the binary for writing) for the
     * price of two mount calls. */
    if (mount(runtime[0], runtime[0], NULL, MS_BIND, NULL) == 0 &&
        mount(NULL, runtime[0], NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) == 0)
        setenv("_LIBCONTAINER_CLONED_BINARY", "1", 1);
    execv(runtime[0], runtime);
    perror("dsec-shim: exec runtime");
    return 127;
}

/* runsc-keep: the host side of a gVisor sandbox. Its init (the shim) runs inside the
 * sentry, which is not a host process: nothing of it can be reached with pidfd_getfd,
 * and its mounts are not in any host process's view. So this keeper stays for the
 * sandbox's life and holds what the edge needs: the edge's end of the control socket
 * (fd 4, for an edge that restarts), the writable layer (fd 5), the mount namespace
 * with the overlay root (the gofer serves it from there; the edge's file API reaches it
 * through /proc/<keeper>/root), and the network namespace the sentry uses
 * (--network=host in it: the edge's nftables policy applies there). It starts runsc
 * with only fd 3 (the shim's end), becomes the reaper of the sentry and the gofer, and
 * exits when both are gone: the namespaces, mounts and fds go with it.
 * Exit status: runsc's, when runsc fails to start the sandbox; 0 otherwise. */
static int run_keep(int argc, char **argv) {
    char **runtime = prepare_launch(argc, argv, "runsc-keep");
    if (runtime == NULL) return 1;
    /* runsc binds ROOTFS/tmp at /tmp (its own tmpfs would keep /tmp out of the writable
     * layer), and resolves the source on the host: it must be a directory of the overlay,
     * not a symlink a sandbox left there (nothing runs in this rootfs yet: no race). */
    char tmp[4096];
    struct stat st;
    snprintf(tmp, sizeof tmp, "%s/tmp", argv[7]);
    if (lstat(tmp, &st) < 0 || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "dsec-shim: the sandbox's /tmp is not a directory (a symlink or missing): "
                        "refusing to bind it\n");
        return 3;
    }
    if (unshare(CLONE_NEWNET) < 0) { perror("dsec-shim: unshare net"); return 1; }
    /* A new network namespace has its loopback down (an OCI runtime brings it up). */
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) < 0 || (ifr.ifr_flags |= IFF_UP, ioctl(s, SIOCSIFFLAGS, &ifr)) < 0) {
        perror("dsec-shim: loopback up");
        return 1;
    }
    close(s);
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) { perror("dsec-shim: subreaper"); return 1; }
    fcntl(4, F_SETFD, FD_CLOEXEC);
    fcntl(5, F_SETFD, FD_CLOEXEC);
    pid_t rt = fork();
    if (rt < 0) { perror("dsec-shim: fork"); return 1; }
    if (rt == 0) {
        execv(runtime[0], runtime);
        perror("dsec-shim: exec runsc");
        _exit(127);
    }
    close(3);
    int status = 0;
    while (waitpid(rt, &status, 0) < 0 && errno == EINTR) {
    }
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devnull >= 0) { /* the log file was runsc's: hold nothing of it from here */
        for (int i = 0; i < 3; i++) dup2(devnull, i);
        if (devnull > 2) close(devnull);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    for (;;) {
        if (wait(NULL) < 0) {
            if (errno == EINTR) continue;
            return 0; /* ECHILD: the sentry and the gofer are gone */
        }
    }
}

/* kill-others: run inside a sandbox as its root, SIGKILL every process but the init and
 * itself (before a restore, around a verifier; where no host cgroup holds the processes). */
static int run_kill_others(void) {
    for (int round = 0; round < 100; round++) {
        if (kill(-1, SIGKILL) < 0) return errno == ESRCH ? 0 : 1;
        usleep(2000);
    }
    return 1;
}

/* idmap-run FROM:TO:COUNT SRC MOUNTPOINT -- CMD...: run CMD in a mount namespace of its own
 * where MOUNTPOINT is a read-only view of the directory SRC, its owners shown through the
 * idmap (the microVM backend makes a layer's disk image from the guest's view of it). */
static int run_idmap_run(int argc, char **argv) {
    long from, to, count;
    if (argc < 7 || strcmp(argv[5], "--") != 0 ||
        sscanf(argv[2], "%ld:%ld:%ld", &from, &to, &count) != 3 || from < 0 || to < 0 || count <= 0) {
        fprintf(stderr, "usage: dsec-shim idmap-run FROM:TO:COUNT SRC MOUNTPOINT -- CMD...\n");
        return 2;
    }
    if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0) {
        perror("dsec-shim: mount namespace");
        return 1;
    }
    int userns = idmap_userns(from, to, count);
    if (userns < 0 || idmap_bind(argv[3], argv[4], userns) < 0) {
        fprintf(stderr, "dsec-shim: idmapped view of %s: %s\n", argv[3], strerror(errno));
        return 1;
    }
    close(userns);
    execvp(argv[6], argv + 6);
    perror("dsec-shim: exec");
    return 127;
}

/* vm-launch UID TAPFD KVMGID -- QEMU ARGS...: QEMU of a microVM sandbox, confined before it
 * runs. In a network namespace of its own, make the tap "tap0" (the guest's NIC: nothing lies
 * beyond it until the edge links this namespace to its gateway) and put its descriptor at
 * TAPFD (QEMU takes it as -netdev tap,fd=TAPFD: it never opens /dev/net/tun), bring it up,
 * then become host uid and gid UID (the sandbox's own range; no capabilities in any set, no
 * new privileges; its only supplementary group KVMGID, the group that may open /dev/kvm, or
 * none for "-"), turn off transparent huge pages and exec QEMU with an environment of its own
 * (PATH and LC_ALL only). QEMU's own -runas is no
 * help: it drops privileges after installing its seccomp filter, which then kills it at
 * setgid. */
static int run_vm_launch(int argc, char **argv) {
    long uid, tapfd, kvmgid = -1;
    char *end;
    if (argc < 7 || strcmp(argv[5], "--") != 0) goto usage;
    uid = strtol(argv[2], &end, 10);
    if (*end || uid <= 0 || uid > 0x7fffffff) goto usage;
    tapfd = strtol(argv[3], &end, 10);
    if (*end || tapfd < 3 || tapfd > 1000) goto usage;
    if (strcmp(argv[4], "-") != 0) {
        kvmgid = strtol(argv[4], &end, 10);
        if (*end || kvmgid <= 0 || kvmgid > 0x7fffffff) goto usage;
    }
    if (unshare(CLONE_NEWNET) < 0) { perror("dsec-shim: network namespace"); return 1; }
    int tun = open("/dev/net/tun", O_RDWR);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, IFNAMSIZ, "tap0");
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
    if (tun < 0 || ioctl(tun, TUNSETIFF, &ifr) < 0) { perror("dsec-shim: tap0"); return 1; }
    if (tun != tapfd && (dup2(tun, (int)tapfd) < 0 || close(tun) < 0)) { perror("dsec-shim: dup2"); return 1; }
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) < 0) { perror("dsec-shim: tap0 flags"); return 1; }
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0) { perror("dsec-shim: tap0 up"); return 1; }
    close(s);
    for (int cap = 0; cap <= CAP_LAST_CAP; cap++) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
    gid_t gid = (gid_t)uid, kvm = (gid_t)kvmgid;
    if (setgroups(kvmgid > 0 ? 1 : 0, kvmgid > 0 ? &kvm : NULL) < 0 || setresgid(gid, gid, gid) < 0 ||
        setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) {
        perror("dsec-shim: drop privileges");
        return 1;
    }
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL) return 1;
    /* No transparent huge pages for QEMU (kept across the exec): it asks for them on its own
     * RAM blocks (the ROMs: one 2 MiB page for a few KB written) and TCG's code buffer, where
     * a 4 KB write costs 2 MiB of the host's memory. Guest RAM is a memfd (shmem): not
     * concerned. 3 MiB less per idle VM here, no slower. */
    prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0);
    /* Nothing of the edge's environment (tokens, database URLs, paths): QEMU needs none of it,
     * and a guest that escaped into QEMU would read it from /proc/self/environ. */
    char *const env[] = {"PATH=/usr/bin:/bin", "LC_ALL=C", NULL};
    execve(argv[6], argv + 6, env);
    perror("dsec-shim: exec");
    return 127;
usage:
    fprintf(stderr, "usage: dsec-shim vm-launch UID TAPFD KVMGID|- -- QEMU ARGS...\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "init") == 0) return run_init(argc >= 3 && strcmp(argv[2], "gvisor") == 0);
    if (argc >= 2 && strcmp(argv[1], "crun-wrap") == 0) return run_crun_wrap(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "runsc-keep") == 0) return run_keep(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "kill-others") == 0) return run_kill_others();
    if (argc >= 2 && strcmp(argv[1], "idmap-run") == 0) return run_idmap_run(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "vm-launch") == 0) return run_vm_launch(argc, argv);
    fprintf(stderr, "usage: dsec-shim init | crun-wrap ... | runsc-keep ... | kill-others (see the source)\n");
    return 2;
}
